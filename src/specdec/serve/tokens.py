"""Text to token ids and back for the server, off the engine's worker where it can be.

Request threads (`asyncio.to_thread` in serve.app) tokenize prompts and predictions and build a
prediction's n-gram index while the request waits; the worker only detokenizes the tokens it
commits, round by round (serve.text.TextAssembler needs the text to find stop strings), with a
private copy of the tokenizer so that a long prompt being tokenized never stalls the running
streams (HF fast tokenizers cannot be called from two threads at once: "Already borrowed").

A request's prediction is drafted from through its n-gram index (core.prediction.PredictionIndex,
~1.5 KiB a token). It is built while the request waits, off the engine, as long as the indexes
alive stay within PREBUILT_INDEX_TOKENS; past that, the worker builds it when the request
starts, so that waiting requests hold only their token ids.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from specdec.backends import chat as prompting
from specdec.backends.fim import Extra, FimTokens, fim_prompt, fim_tokens, plain_encoder
from specdec.core.prediction import PredictionDrafter, PredictionIndex
from specdec.core.sampling import TokenLogprob
from specdec.serve.errors import bad
from specdec.serve.gen_params import GenParams
from specdec.serve.tools import ToolFormat, tool_format

log = logging.getLogger(__name__)

#: Prediction tokens whose n-gram indexes may be alive at once having been built ahead, while
#: their requests wait: ~50 MiB, a 32k-token prediction's whole index (measured: 1.5 KiB a
#: token). 65 requests in flight once held ~420 MB of them (issue 33). Built ahead, an index
#: costs the engine no time; built by the worker, it delays its own request's start (0.4 s for
#: 32k random ids on this repository's 2-core box, 1.2 s in issue 21's measurement).
PREBUILT_INDEX_TOKENS = 1 << 15


class _IndexBudget:
    """Tokens of prebuilt prediction indexes alive, bounded: an index's tokens come back when
    the index is freed (its request ended and let go of it), whatever path it took."""

    def __init__(self, tokens: int) -> None:
        self.free = tokens
        self._lock = threading.Lock()

    def take(self, tokens: int) -> bool:
        with self._lock:
            if tokens > self.free:
                return False
            self.free -= tokens
            return True

    def give(self, tokens: int) -> None:
        with self._lock:
            self.free += tokens


def _copy_tokenizer(tokenizer: object) -> object | None:
    """A private copy of `tokenizer` for the worker; None when it cannot be copied (the worker
    then shares the original under the lock)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # a tokenizer that does not pickle: share it, locked
        log.warning("the tokenizer cannot be copied; the worker shares it under a lock")
        return None


@dataclass(frozen=True)
class TokenEntry:
    """One token's logprob as responses carry it: its text, its bytes (a token may hold part
    of a character), its log-probability, and the likeliest tokens ((text, bytes, logprob))."""

    text: str
    bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable symbol that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF = _byte_symbols()


class Tokens:
    """The served model's tokenizer (None: a mock without one; prompts come as ids)."""

    def __init__(self, tokenizer: object | None, model_id: str) -> None:
        self.model_id = model_id
        self.lock = threading.Lock()  # request threads encode while the worker decodes
        self._index_budget = _IndexBudget(PREBUILT_INDEX_TOKENS)
        self.tokenizer = tokenizer

    @property
    def tokenizer(self) -> object | None:
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: object | None) -> None:
        self._tokenizer = tokenizer
        self._decoder = _copy_tokenizer(tokenizer)  # the worker's own
        self.__dict__.pop("fim", None)  # another vocabulary: its FIM tokens are looked up anew

    @functools.cached_property
    def tool_format(self) -> ToolFormat | None:
        """How the chat template writes tool calls (serve.tools; None: no format known)."""
        if self._tokenizer is None:
            return None
        with self.lock:
            return tool_format(self._tokenizer)

    def text_of(self, ids: list[int]) -> str:
        """Text of `ids`, for a request thread (e.g. a completion's echo)."""
        with self.lock:
            return prompting.decode(self._tokenizer, ids)

    def entries(self, logprobs: list[TokenLogprob]) -> tuple[TokenEntry, ...]:
        """Logprobs as responses carry them (the worker's tokenizer)."""

        def one(t: int) -> tuple[str, bytes]:
            raw = self._token_bytes(t)
            return raw.decode("utf-8", errors="replace"), raw

        return tuple(
            TokenEntry(*one(e.token), e.logprob, tuple((*one(t), lp) for t, lp in e.top))
            for e in logprobs
        )

    def _token_bytes(self, t: int) -> bytes:
        """The bytes token `t` stands for: byte-level BPE's symbols mapped back to bytes; the
        text of a token outside that alphabet (an added token) as UTF-8."""
        tok = self._decoder if self._decoder is not None else self._tokenizer
        if tok is None:
            return str(t).encode()
        piece = tok.convert_ids_to_tokens(t)
        if piece is None:
            return b""
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return prompting.decode(tok, [t]).encode("utf-8")

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, for the worker (its own tokenizer: no lock shared with requests)."""
        if self._decoder is not None:
            return prompting.decode(self._decoder, ids)
        with self.lock:
            return prompting.decode(self._tokenizer, ids)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template's rendering of `messages` and `tools` (backends.chat.
        encode_messages)."""
        with self.lock:
            try:
                return prompting.encode_messages(self._tokenizer, messages, tools)
            except prompting.NoChatTemplateError as e:
                raise bad(
                    f"{self.model_id} has no chat template (a mock or base model); use "
                    "/v1/completions",
                    param="messages",
                    code="no_chat_template",
                ) from e
            except ValueError as e:
                raise bad(str(e), "messages") from e

    def encode_text(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise bad(f"{self.model_id} has no tokenizer; pass the prompt as token ids", "prompt")
        with self.lock:
            return prompting.encode(self._tokenizer, text, chat=False)

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """The tokenizer's FIM tokens (backends.fim), looked up once per tokenizer."""
        return fim_tokens(self._tokenizer)

    def encode_fim(
        self, prefix: str, suffix: str, extra: list[Extra], current: str, n_ctx: int, n_predict: int
    ) -> tuple[list[int], frozenset[int]]:
        """The FIM prompt asking for the middle between `prefix` and `suffix` (backends.fim),
        and the tokens that end a middle; 400 naming the model when its vocabulary has none."""
        fim = self.fim
        if fim is None:
            raise bad(
                f"{self.model_id} has no fill-in-the-middle tokens in its vocabulary; a suffix "
                "needs a FIM-trained code model",
                "suffix",
                code="fim_not_supported",
            )
        with self.lock:
            encode = plain_encoder(self._tokenizer)
            ids = fim_prompt(
                fim, encode, prefix, suffix, extra, current, n_ctx=n_ctx, n_predict=n_predict
            )
        return ids, fim.ends

    def encode_prediction(self, text: str) -> list[int]:
        """A request's prediction as token ids (backends.chat.encode_prediction)."""
        if self._tokenizer is None:
            raise bad(f"{self.model_id} has no tokenizer to read a prediction with", "prediction")
        with self.lock:
            return prompting.encode_prediction(self._tokenizer, text)

    def prediction_index(self, prediction: list[int], instruction: str) -> PredictionIndex:
        """A request's prediction with its n-gram index, and the rewrites its instruction names
        as hints (backends.chat.prediction_hints)."""
        return PredictionIndex(prediction, PredictionDrafter.N_MAX, self._hints(instruction))

    def _hints(self, instruction: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
        with self.lock:
            return tuple(prompting.prediction_hints(self._tokenizer, instruction))

    def prepare_prediction(self, params: GenParams, instruction: str) -> GenParams:
        """`params` with its prediction's hints, and its index built where
        PREBUILT_INDEX_TOKENS allows (else the worker builds it when the request starts). Call
        off the event loop."""
        pred = params.prediction
        if pred is None:
            return params
        pred = pred.with_hints(self._hints(instruction))
        if self._index_budget.take(len(pred.tokens)):
            weakref.finalize(pred.build(), self._index_budget.give, len(pred.tokens))
        return dataclasses.replace(params, prediction=pred)
