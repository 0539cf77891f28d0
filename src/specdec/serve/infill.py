"""`POST /infill`: code completion as llama.cpp's server answers it, for the editors that call it
on every keystroke (llama.vscode, llama.vim), under lossless speculation.

The request is llama.cpp's (tools/server's /infill): `input_prefix`, `input_suffix` (both
required), `input_extra` ([{"text", "filename"}], other files), `prompt` (the current line up to
the cursor), `n_predict` (or `max_tokens`), `n_indent`, `t_max_predict_ms`, `stream`, `stop`,
`n_cmpl` (or `n`), `response_fields`, and the sampling fields `temperature`, `top_k`, `top_p`,
`min_p`, `seed`; specdec's `speculation` too. Ignored, as the answer does not depend on them
here: `cache_prompt` (the prompt cache is always on where it is exact), `id_slot` (the engine
places a request), `t_max_prompt_ms` (llama.cpp ignores it too), `samplers` (the chain is
top-k, top-p, min-p, then temperature; llama.cpp's "infill" sampler, which reshapes the
distribution, is not applied), `model`, `lora`, `n_probs`. Temperature defaults to llama.cpp's
0.8; `samplers` without "temperature" means 1, as in llama.cpp's chain.

The prompt is backends.fim's (the model's own FIM tokens; the current line after the middle
token, so a keystroke changes only the prompt's end). The answer stops at the model's end and
FIM end tokens, at `n_predict`, at a stop string, and as llama.cpp's does:
    n_indent          on a line after the first, at its first non-blank character, if it is
                      indented less than n_indent: the text is cut there (the newline and the
                      short indent kept)
    t_max_predict_ms  at a newline, once this long has passed since the first token
Both cut the target's own answer, so at T = 0 it is a prefix of target-only's, token for token.

The answer is llama.cpp's record (`content`, `tokens`, `stop`, `stop_type`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `truncated`, `generation_settings`, `timings`), compact JSON
on one line (llama.vim reads it with a regex); `response_fields` keeps only the named paths,
each under its path ("timings/prompt_n"); `n_cmpl` > 1 answers a list. A stream sends each
piece as {"content", "tokens", "stop": false} and the record last, without [DONE].
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from specdec.backends.fim import Extra
from specdec.core.metrics import GenerationStats
from specdec.serve.errors import ApiError, bad
from specdec.serve.gen_params import GenParams
from specdec.serve.requests import Delta, Done, Failed, Status
from specdec.serve.requests import Request as Sample
from specdec.serve.samples import sample_events, submitted
from specdec.serve.wire import CompletionRequest

#: llama.cpp's default temperature (common_params_sampling).
LLAMA_TEMPERATURE = 0.8
#: n_predict when a request gives none or -1 (llama.cpp: until the context ends).
DEFAULT_N_PREDICT = 128


class InfillRequest(BaseModel):
    """The fields of llama.cpp's /infill that the answer depends on (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    input_prefix: str
    input_suffix: str
    input_extra: list[dict[str, Any]] = []
    prompt: str = ""
    n_predict: int | None = None
    max_tokens: int | None = None
    n_indent: int = 0
    t_max_predict_ms: int = 0
    stream: bool = False
    stop: list[str] = []
    n_cmpl: int | None = None
    n: int | None = None
    response_fields: list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    samplers: list[str] | str | None = None
    speculation: dict[str, Any] | None = None

    def extra(self) -> list[Extra]:
        """input_extra as chunks (parse_infill checked them)."""
        return [Extra(c["text"], c.get("filename") or "") for c in self.input_extra]

    def max_new(self) -> int:
        """Tokens at most: n_predict (or max_tokens); -1 or none: DEFAULT_N_PREDICT."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return DEFAULT_N_PREDICT if n is None or n < 0 else n

    def temperature_or_default(self) -> float:
        if self.temperature is not None:
            return self.temperature
        chain = self.samplers
        if chain is not None and "temperature" not in chain:
            return 1.0  # llama.cpp applies temperature only where the chain names it
        return LLAMA_TEMPERATURE

    def completion(self, model: str, ids: list[int]) -> CompletionRequest:
        """The completion the engine runs: the FIM prompt as token ids."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": ids,
            "max_tokens": self.max_new(),
            "temperature": self.temperature_or_default(),
            "n": self.n or 1,
            "stop": self.stop or None,
        }
        for name in ("top_k", "top_p", "min_p", "seed", "speculation"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return CompletionRequest.model_validate(body)


def parse_infill(obj: Any) -> InfillRequest:
    """The request, or a 400 naming its first problem."""
    if not isinstance(obj, dict):
        raise bad("the request body must be a JSON object", code="invalid_type")
    for name in ("input_prefix", "input_suffix"):
        if name not in obj:
            raise bad(f'"{name}" is required', name)
    extra = obj.get("input_extra", [])
    if not isinstance(extra, list) or not all(isinstance(c, dict) for c in extra):
        raise bad('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk.get("text"), str):
            raise bad('an input_extra chunk must hold a "text" string', "input_extra")
        if chunk.get("filename") is not None and not isinstance(chunk["filename"], str):
            raise bad('an input_extra chunk\'s "filename" must be a string', "input_extra")
    try:
        req = InfillRequest.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False, include_context=False, include_input=False)[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise bad(f"{param}: {err['msg']}", param) from None
    if req.n_indent < 0:
        raise bad(f"n_indent must be >= 0, got {req.n_indent}", "n_indent")
    if req.n_predict == 0:
        raise bad("n_predict must be >= 1 (or -1 for the default)", "n_predict")
    # llama.cpp's n_cmpl is OpenAI's n: one field from here on
    return req.model_copy(update={"n": req.n_cmpl}) if req.n_cmpl is not None else req


# ------------------------------------------------------------------------------ the stop rules
@dataclass
class Middle:
    """One sample's middle as its deltas arrive, with llama.cpp's editor stop rules."""

    n_indent: int
    t_max_predict_ms: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    stop_type: str = "none"  # llama.cpp's: none, eos, word, limit
    stats: GenerationStats | None = None
    first_at: float | None = None

    def take(self, ev: Delta) -> str:
        """A delta's text, cut where a rule stops the middle (then `stop_type` is "limit")."""
        if ev.token_ids and self.first_at is None:
            self.first_at = time.perf_counter()
        start = len(self.text)
        self.text += ev.text
        self.ids += ev.token_ids
        cut = self._indent_cut(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stop_type = "limit"
        elif "\n" in ev.text and self._late():
            self.stop_type = "limit"
        return self.text[start:]

    def _indent_cut(self, start: int) -> int | None:
        """Where a line after the first starts less indented than n_indent (its first
        non-blank character), if one does."""
        if self.n_indent <= 0:
            return None
        first_nl = self.text.find("\n")
        if first_nl < 0:
            return None
        at = max(first_nl + 1, self.text.rfind("\n", 0, max(start, first_nl + 1)) + 1)
        while at <= len(self.text):
            end = self.text.find("\n", at)
            line = self.text[at : end if end >= 0 else len(self.text)]
            body = line.lstrip(" \t")
            if body and len(line) - len(body) < self.n_indent:
                return at + len(line) - len(body)
            if end < 0:
                return None
            at = end + 1
        return None

    def _late(self) -> bool:
        if self.t_max_predict_ms <= 0 or self.first_at is None:
            return False
        return (time.perf_counter() - self.first_at) * 1000 > self.t_max_predict_ms

    @property
    def stopped(self) -> bool:
        return self.stop_type == "limit"

    def end(self, ev: Done) -> None:
        self.stats = ev.stats
        if self.stop_type == "none":
            reason = ev.status.finish_reason
            self.stop_type = "limit" if reason == "length" else "eos"


def record(m: Middle, p: GenParams, n_ctx: int, model: str, index: int) -> dict[str, Any]:
    """llama.cpp's final record for one middle."""
    st = m.stats
    prompt_n = len(p.prompt_ids) - (st.cached_prompt_tokens if st else 0)
    prompt_ms = 1000 * st.ttft_s if st and st.ttft_s is not None else 0.0
    predicted_n = len(m.ids)
    predicted_ms = max(0.0, 1000 * st.wall_s - prompt_ms) if st and st.wall_s else 0.0
    return {
        "index": index,
        "content": m.text,
        "tokens": [],
        "stop": True,
        "model": model,
        "tokens_predicted": predicted_n,
        "tokens_evaluated": len(p.prompt_ids),
        "generation_settings": {
            "n_ctx": n_ctx,
            "n_predict": p.max_tokens,
            "temperature": p.warp.temperature,
            "top_k": p.warp.top_k,
            "top_p": p.warp.top_p,
            "min_p": p.warp.min_p,
            "seed": p.seed,
            "stop": list(p.stop),
        },
        "has_new_line": "\n" in m.text,
        "truncated": False,
        "stop_type": m.stop_type,
        "stopping_word": "",
        "tokens_cached": len(p.prompt_ids) + predicted_n,
        "timings": {
            "cache_n": st.cached_prompt_tokens if st else 0,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else None,
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else None,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else None,
            "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else None,
        },
    }


def pick(obj: dict[str, Any], paths: list[str] | None) -> dict[str, Any]:
    """llama.cpp's response_fields: the values at the given paths ("a/b" walks into "a"), each
    under its path; paths that lead nowhere are left out. None: the whole record."""
    if not paths:
        return obj
    out = {}
    for path in paths:
        at: Any = obj
        for part in path.split("/"):
            if not isinstance(at, dict) or part not in at:
                break
            at = at[part]
        else:
            out[path] = at
    return out


def dumps(obj: Any) -> str:
    """Compact JSON on one line, as llama.cpp writes it (llama.vim matches `"content":"`)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------ the route
async def answer(
    request: Request,
    req: InfillRequest,
    engine: Any,
    params: GenParams,
    samples: list[Sample],
    reservations: list[Any],
    model: str,
) -> Response:
    """Queue the samples, then answer with the record(s) or a stream of pieces, on serve.samples'
    skeleton (`submitted`). Unlike serve.answers' `respond`, this does not wait for the request
    to start before it answers: a stream's 200 goes out at once, and a failure in the queue is
    its last event."""
    middles = [Middle(req.n_indent, req.t_max_predict_ms) for _ in samples]
    n_ctx = engine.models.n_ctx

    def final(i: int) -> dict[str, Any]:
        return pick(record(middles[i], params, n_ctx, model, i), req.response_fields)

    async def run() -> Any:
        """(i, text, ids) per piece, until every middle has ended or been cut."""
        async for i, ev in sample_events(engine, samples):
            m = middles[i]
            if isinstance(ev, Failed):
                if m.stopped:  # cut by a rule and withdrawn: its end is the cut
                    continue
                raise ev.error
            if isinstance(ev, Done):
                m.end(ev)
            elif isinstance(ev, Delta) and not m.stopped:
                text = m.take(ev)
                yield i, text, ev.token_ids
                if m.stopped:
                    gen = samples[i].gen
                    m.stats = gen.stats if gen is not None else None
                    engine.withdraw(samples[i], Status.CANCELLED)
            if all(x.stats is not None or x.stopped for x in middles):
                return

    async def stream() -> AsyncIterator[str]:
        try:
            async for i, text, ids in run():
                if text or ids:
                    piece = {"index": i, "content": text, "tokens": list(ids), "stop": False}
                    yield f"data: {dumps(piece)}\n\n"
        except ApiError as e:
            yield f"data: {dumps(e.body())}\n\n"
            return
        for i in range(len(middles)):
            yield f"data: {dumps({**final(i), 'content': ''})}\n\n"

    with submitted(request, engine, samples, reservations) as held:
        if req.stream:
            return held.stream(stream())
        async for _ in run():
            pass
        out = [final(i) for i in range(len(middles))]
        body = out[0] if len(out) == 1 else out
        return Response(dumps(body), media_type="application/json; charset=utf-8")


def prepare(models: Any, req: InfillRequest, model_id: str) -> GenParams:
    """The request's GenParams: its FIM prompt (serve.tokens.encode_fim) run as a completion,
    ending at the FIM end tokens too. 501 for a model with no FIM tokens, as llama.cpp. Call
    off the event loop."""
    if models.tokens.fim is None:
        raise ApiError(
            501,
            f"infill is not supported by this model: {model_id} has no fill-in-the-middle "
            "tokens in its vocabulary",
            type="not_supported_error",
            code="fim_not_supported",
        )
    ids, ends = models.tokens.encode_fim(
        req.input_prefix, req.input_suffix, req.extra(), req.prompt, models.n_ctx, req.max_new()
    )
    params, _ = models.prepare(req.completion(model_id, ids))
    return dataclasses.replace(params, stop_ids=ends)
