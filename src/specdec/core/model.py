"""The model contract every backend implements (paper, section 4, "Model abstraction").

A `SpecModel` owns one KV cache holding a prefix of some token sequence. The decoder only ever
needs four operations:

    extend(tokens)  -> logits   append tokens to the cache; logits for the new positions
    truncate(n)                 roll the cache back to its first n tokens (no-op if already <= n)
    n_cached                    how many tokens the cache holds
    forward(tokens) -> logits   stateless evaluation of a whole sequence (the cache is untouched)

and, where the backend can copy its cache (`save` is None where it cannot), `save()` -> a Saved
copy of it and `restore(saved)`, which makes any slot's cache hold it again, bit for bit: a
server keeps many prompts' KV in RAM this way (serve.prompt_store).

A server's concurrent sequences are `slots(n)`: n models on the same weights with a cache each
(slot 0 is the model itself), and `extend_together` extends several of them in one pass where
the backend can (llama.cpp: one context, a KV stream per sequence); elsewhere one after another.
Either way each slot's logits are what its own `extend` would return.

Contract at the boundary, for every backend:
    * logits are float32, on the CPU, shape [len(tokens), vocab_size]; row i is the next-token
      distribution after tokens[: i + 1] (given whatever the cache held before);
    * `vocab_size` is the logit width (model families pad their output layer differently, so it
      can exceed the tokenizer's vocabulary; `check_pair` takes the min of two widths);
    * rollback is a length: `truncate(n)` is the only way back, and is a no-op when n >= n_cached.

The base class keeps the cached token ids (`cached_tokens`) so the decoder can assert, after
every round, that each cache holds a prefix of the committed sequence.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.core.checks import check_int

#: Token ids as the API takes them: a list (or any iterable) of ints, a 1-D integer tensor (or
#: [1, n]: a batch of one), or a tokenizer's output holding input_ids (a BatchEncoding, a dict).
TokenIds = Iterable[int] | torch.Tensor | Mapping[str, Any]

_WHAT_TO_PASS = (
    "pass token ids: a list of ints, a 1-D integer tensor, or a tokenizer's output (a "
    "BatchEncoding or a dict holding input_ids), e.g. tokenizer(text)['input_ids'] or "
    "tokenizer.apply_chat_template(messages, add_generation_prompt=True)"
)


class SpecModelError(ValueError):
    """Bad input to a model: names the problem and the fix."""


def as_token_list(tokens: TokenIds, what: str = "token ids") -> list[int]:
    """Token ids as a plain list of Python ints (`TokenIds` says what is accepted); a
    SpecModelError naming `what` and what to pass for anything else."""
    if isinstance(tokens, Mapping):
        if "input_ids" not in tokens:
            keys = ", ".join(map(repr, list(tokens)[:4]))
            raise _refused(what, f"a mapping without input_ids (keys {keys})")
        tokens = tokens["input_ids"]
    if isinstance(tokens, torch.Tensor):
        return _tensor_ids(tokens, what)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise _refused(what, _describe(tokens))
    ids = list(tokens)
    if all(type(t) is int for t in ids):  # the common case, checked at C speed
        return ids
    first = ids[0] if len(ids) == 1 else None
    if isinstance(first, (list, tuple)) or (isinstance(first, torch.Tensor) and first.dim()):
        return as_token_list(first, what)  # a batch of one sequence
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))  # ints, numpy integers, one-element integer tensors
        except TypeError:
            raise _refused(what, f"an id of type {type(t).__name__} ({_short(t)})") from None
    return out


def _tensor_ids(t: torch.Tensor, what: str) -> list[int]:
    if t.dim() == 2 and t.shape[0] == 1:  # return_tensors="pt" gives a batch of one
        t = t[0]
    if t.dim() != 1:
        raise _refused(what, f"a tensor of shape {tuple(t.shape)}: one sequence is [n] or [1, n]")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise _refused(what, f"a {t.dtype} tensor")
    return [int(x) for x in t.tolist()]


def _refused(what: str, got: str) -> SpecModelError:
    return SpecModelError(f"{what}: got {got}; {_WHAT_TO_PASS}")


def _describe(x: object) -> str:
    """What was passed instead of token ids, for an error message."""
    if isinstance(x, (str, bytes)):
        return f"text ({_short(x)}), which must be tokenized first"
    return f"an object of type {type(x).__name__}"


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 30 else text[:27] + "..."


@dataclass(frozen=True, eq=False)
class Saved:
    """A copy of a cache (SpecModel.save): the tokens it held and the backend's state for them
    (opaque; `nbytes` of memory)."""

    owner: SpecModel  # the weights it was computed on: it restores into their slots only
    tokens: tuple[int, ...]
    state: Any
    nbytes: int


class SpecModel(ABC):
    """One model with one KV cache. See the module docstring for the contract."""

    #: short human name, e.g. "llamacpp:qwen2.5-coder-1.5b"
    name: str = "model"
    #: logit width V
    vocab_size: int
    #: maximum number of positions the cache can hold (the context window)
    n_ctx: int
    #: where the model computes (logits always come back on the CPU)
    device: torch.device = torch.device("cpu")
    #: the Hugging Face tokenizer that is the single source of truth for ids (None for mock models)
    tokenizer: Any = None
    #: every logit is bit-identical whatever batch shape computed it (mock models; llama.cpp's
    #: deterministic mode): only then may a server reuse one request's KV for the next by default
    batch_invariant: bool = False

    def __init__(self) -> None:
        self.cached_tokens: list[int] = []
        #: the model whose slot this is (`slots`): itself, unless made by another's slots()
        self.owner: SpecModel = self

    # ----------------------------------------------------------------------------- public API
    @property
    def n_cached(self) -> int:
        return len(self.cached_tokens)

    def extend(self, tokens: TokenIds) -> torch.Tensor:
        """Append `tokens` to the cache; return [len(tokens), V] float32 CPU logits."""
        ids = self._validate(tokens)
        self._check_room(len(ids))
        logits = self._extend(ids)  # [len(ids), V]
        self.cached_tokens.extend(ids)
        return logits

    def prefill(self, tokens: TokenIds) -> None:
        """Append `tokens` to the cache without asking for their logits.

        The same cache as `extend` (bit for bit where the backend is batch-invariant), but the
        backend may skip the output layer: for a prompt of n tokens that saves n rows of
        [hidden x V] work and an [n, V] copy, a large share of TTFT with V = 151936.
        """
        ids = self._validate(tokens)
        self._check_room(len(ids))
        self._prefill(ids)
        self.cached_tokens.extend(ids)

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first n tokens; a no-op when n >= n_cached."""
        check_int("truncate's length", n, 0, error=SpecModelError)
        if n >= self.n_cached:
            return
        self._truncate(n)
        del self.cached_tokens[n:]

    def reset(self) -> None:
        """Empty the cache, unconditionally: also when `n_cached` is already 0, since a backend
        pass that raised midway may have left state that the token list does not show."""
        self._truncate(0)
        self.cached_tokens.clear()

    def save(self) -> Saved | None:
        """A copy of the cache as it is now, for `restore`; None where the backend cannot copy
        one (the caller then prefills again)."""
        state = self._save_state()
        if state is None:
            return None
        data, nbytes = state
        return Saved(self.owner, tuple(self.cached_tokens), data, nbytes)

    def restore(self, saved: Saved) -> None:
        """Make the cache hold what it held at `saved` (taken from this model or another slot
        of the same weights), bit for bit; what it held before is dropped."""
        if saved.owner is not self.owner:
            raise SpecModelError(
                f"{self.name}: a cache saved from {saved.owner.name} restores only into slots "
                "of the same model"
            )
        self.reset()
        if saved.tokens:
            self._restore_state(saved.state)
            self.cached_tokens.extend(saved.tokens)

    def forward(self, tokens: TokenIds) -> torch.Tensor:
        """Stateless: logits [len(tokens), V] for `tokens` evaluated from an empty context.

        The cache (its length and contents) is the same after the call as before it.
        """
        ids = self._validate(tokens)
        if len(ids) > self.n_ctx:
            raise SpecModelError(
                f"{self.name}: {len(ids)} tokens exceed the context window of {self.n_ctx}"
            )
        return self._forward(ids)

    def slots(self, n: int) -> list[SpecModel]:
        """`n` models on these weights with a cache each, slot 0 being this model: a server's
        concurrent sequences (their extends may share a pass: `extend_together`)."""
        check_int("slots", n, 1, error=SpecModelError)
        return [self] if n == 1 else self._make_slots(n)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless a backend holds resources
        """Release backend resources (optional)."""

    # ------------------------------------------------------------------ backend implementation
    @abstractmethod
    def _extend(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` on top of the cache; return [len(ids), V] float32 CPU logits."""

    @abstractmethod
    def _truncate(self, n: int) -> None:
        """Drop cache positions >= n (0 <= n < n_cached, or n = 0 from `reset` at any length)."""

    def _prefill(self, ids: list[int]) -> None:
        self._extend(ids)  # backends that can skip the output layer override this

    def _save_state(self) -> tuple[Any, int] | None:
        """The backend's state for the cached tokens and its size in bytes; None: the backend
        cannot copy its cache (the default)."""
        return None

    def _restore_state(self, state: Any) -> None:
        """Load `state` (from `_save_state` of a slot of the same weights) into an empty cache."""
        raise SpecModelError(f"{self.name}: this backend cannot restore a saved cache")

    def _extend_slots(self, calls: list[tuple[SpecModel, list[int]]]) -> list[torch.Tensor]:
        """Run each call's checked ids on its slot of this model (`extend_together`), returning
        each one's logits; the caller records the tokens once every call has run. A backend
        whose slots can share one pass (llama.cpp: sequences of one context) overrides this;
        here they run one after another, and a failure rolls back those that ran, so a failed
        call leaves every cache as it was either way."""
        out: list[torch.Tensor] = []
        try:
            for m, ids in calls:
                out.append(m._extend(ids))
        except BaseException:
            for (m, _), _ in zip(calls, out, strict=False):
                m._truncate(m.n_cached)  # the backend's cache back to the recorded tokens
            raise
        return out

    def _make_slots(self, n: int) -> list[SpecModel]:
        raise SpecModelError(
            f"{self.name}: this backend holds one sequence, so it serves one request at a time; "
            "run several requests at once (--parallel) with a llamacpp: or mock: model"
        )

    def _forward(self, ids: list[int]) -> torch.Tensor:
        # Generic fallback: evaluate from an empty cache, then rebuild the old cache. Backends
        # with a cheaper stateless path (HF, mock) override this.
        saved = list(self.cached_tokens)
        self.reset()
        try:
            logits = self.extend(ids)
        finally:
            self.reset()
            if saved:
                self.extend(saved)
        return logits

    # ---------------------------------------------------------------------------- validation
    def _check_room(self, n: int) -> None:
        if self.n_cached + n > self.n_ctx:
            raise SpecModelError(
                f"{self.name}: extending a cache of {self.n_cached} tokens by {n} exceeds "
                f"the context window of {self.n_ctx}; shorten the prompt or max_new_tokens, or "
                "load the model with a larger n_ctx"
            )

    def _validate(self, tokens: TokenIds) -> list[int]:
        ids = as_token_list(tokens)
        if not ids:
            raise SpecModelError(f"{self.name}: empty token list; pass at least one token id")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise SpecModelError(
                f"{self.name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); "
                "were the ids produced by this model's tokenizer?"
            )
        return ids

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} V={self.vocab_size} cached={self.n_cached}>"


def extend_together(calls: Sequence[tuple[SpecModel, TokenIds]]) -> list[torch.Tensor]:
    """`[m.extend(tokens) for m, tokens in calls]`, as one pass where the models are slots of one
    model (SpecModel.slots, one `owner`: its `_extend_slots`, one pass where the backend can):
    the same logits, each slot's own, bit for bit on a batch-invariant backend. Every call is
    checked before any model work."""
    checked = []
    for m, tokens in calls:
        ids = m._validate(tokens)
        m._check_room(len(ids))
        checked.append((m, ids))
    if len({id(m) for m, _ in checked}) != len(checked):
        raise SpecModelError("extend_together: a model appears twice; one call per slot")
    owner = checked[0][0].owner if len(checked) > 1 else None
    if owner is None or any(m.owner is not owner for m, _ in checked):
        return [m.extend(ids) for m, ids in checked]
    out = owner._extend_slots(checked)
    for m, ids in checked:  # after the pass: a failed pass leaves every cache as it was
        m.cached_tokens.extend(ids)
    return out
