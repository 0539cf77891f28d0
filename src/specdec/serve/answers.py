"""From a validated request to its response: its samples' events (serve.samples) turned into
the response records, whole or streamed.

A request asks for n samples (OpenAI's `n`; serve.samples says how they run). Each
sample's text goes through its `Choice`: the tool-call parser when tools are on (serve.tools),
its logprobs, its finish reason. Responses carry OpenAI's records and the
extensions (`usage.speculation`, `spec`; core.metrics defines the numbers).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specdec.core.metrics import GenerationStats
from specdec.serve.engine import Engine
from specdec.serve.gen_params import GenParams
from specdec.serve.job_queue import Reservation
from specdec.serve.requests import Delta, Done, Failed
from specdec.serve.requests import Request as Sample
from specdec.serve.samples import next_event, sample_events, submitted
from specdec.serve.speculation import Speculation
from specdec.serve.tokens import TokenEntry
from specdec.serve.tools import Call, ToolParser
from specdec.serve.wire import ChatRequest, CompletionRequest


# ------------------------------------------------------------------------------ records
def _counts(st: GenerationStats) -> dict[str, Any]:
    """GenerationStats' per-request counts, as responses carry them (core.metrics defines them)."""
    return {
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "rounds": st.rounds,
        "drafting_rounds": st.drafting_rounds,
        "tokens_per_round": st.tokens_per_round,
        "mean_acceptance_length": st.mean_acceptance_length,
        "drafted_per_position": list(st.drafted_per_pos),
        "accepted_per_position": list(st.accepted_per_pos),
    }


def spec_record(st: GenerationStats) -> dict[str, Any]:
    """The per-response `spec` object: GenerationStats' numbers (core.metrics defines them)."""
    return {**_counts(st), "ttft_s": st.ttft_s, "wall_s": st.wall_s}


def speculation_usage(st: GenerationStats, sp: Speculation) -> dict[str, Any]:
    """usage.speculation: the settings the request ran with and what its speculation did.

    Beyond `spec_record`'s counts: `by_source` {source: {drafted, accepted}} (the drafters'
    source names: "model", "lookup3", "lookup8+", "prediction", "grammar" (tokens a grammar
    forced), ...) and `k_histogram` {K: rounds that verified K drafted tokens} (K = 0: plain
    target steps; keys are strings, as JSON's are)."""
    by_source = {
        src: {"drafted": n, "accepted": st.accepted_by_source.get(src, 0)}
        for src, n in sorted(st.drafted_by_source.items())
    }
    return {
        **sp.settings(),
        **_counts(st),
        "by_source": by_source,
        "k_histogram": {str(k): n for k, n in sorted(st.k_histogram.items())},
    }


def usage(stats: list[GenerationStats], sp: Speculation | None = None) -> dict[str, Any]:
    """OpenAI's usage object over a request's samples (the prompt counted once); the
    prediction counts are core.metrics' definitions (0 without a prediction, as OpenAI reports
    them). With `sp` and one sample, the extension `speculation` too (with several, each
    choice carries its own `spec`)."""
    st = stats[0]
    generated = sum(s.generated for s in stats)
    out = {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": st.prompt_tokens + generated,
        # prompt tokens whose KV came from the previous request (the engine's prompt cache)
        "prompt_tokens_details": {"cached_tokens": st.cached_prompt_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in stats),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in stats),
        },
    }
    if sp is not None and len(stats) == 1:
        out["speculation"] = speculation_usage(st, sp)
    return out


# ------------------------------------------------------------------------------ one sample
@dataclass
class Choice:
    """One sample's answer as its events arrive."""

    index: int
    parser: ToolParser | None = None  # tool calls are read out of the text (serve.tools)
    text: list[str] = field(default_factory=list)  # content, tool calls taken out
    ids: list[int] = field(default_factory=list)
    entries: list[TokenEntry] = field(default_factory=list)  # logprobs, when asked
    finish: str | None = None
    stats: GenerationStats | None = None

    @property
    def calls(self) -> list[Call]:
        return self.parser.calls if self.parser is not None else []

    @property
    def ended(self) -> GenerationStats:
        """Its stats, once it has ended (`end`): an answer is written after every Done."""
        assert self.stats is not None, "the sample has not ended"
        return self.stats

    def take(self, ev: Delta) -> tuple[str, list[Call]]:
        """A delta's content (tool calls taken out) and the calls it finished."""
        self.ids += ev.token_ids
        self.entries += ev.logprobs
        text, calls = self.parser.push(ev.text) if self.parser is not None else (ev.text, [])
        self.text.append(text)
        return text, calls

    def end(self, ev: Done) -> str:
        """The sample ended: what the parser held back, as content."""
        rest = self.parser.flush() if self.parser is not None else ""
        self.text.append(rest)
        self.stats = ev.stats
        self.finish = (ev.status.with_calls() if self.calls else ev.status).finish_reason
        return rest


def chat_logprobs(entries: list[TokenEntry]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(text: str, raw: bytes, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {
        "content": [
            {**one(e.text, e.bytes, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenEntry], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs`: parallel lists, text_offset from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


@dataclass
class Reply:
    """The response objects of one request: the whole completion, or its SSE chunks."""

    model: str  # the id responses carry (the target spec the server was started with)
    chat: bool
    req: ChatRequest | CompletionRequest
    prompt_ids: list[int]
    speculation: Speculation | None = None  # usage.speculation's settings
    logprobs: bool = False  # each choice carries its tokens' logprobs
    echo: str = ""  # completions with echo: the prompt's text, before the answer's
    replica: str | None = None  # usage.replica: which replica answered (serve.cluster)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _usage(self, stats: list[GenerationStats], streamed: bool) -> dict[str, Any]:
        # usage.speculation in a stream only when asked (include_speculation): the default
        # stream stays byte for byte what it was before the extension
        opted = not streamed or self.req.include_speculation
        out = usage(stats, self.speculation if opted else None)
        if self.replica is not None:
            out["replica"] = self.replica
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, entries: list[TokenEntry], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    def completion(self, choices: list[Choice]) -> dict[str, Any]:
        """The non-streamed response."""
        out = []
        for c in choices:
            text = "".join(c.text)
            choice: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish,
                "logprobs": self._logprobs(c.entries, len(self.echo)),
            }
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if c.calls:
                    message.update(content=text or None, tool_calls=[x.record() for x in c.calls])
                choice["message"] = message
            else:
                choice["text"] = self.echo + text
            if self.req.return_token_ids:
                choice["token_ids"] = c.ids
            if len(choices) > 1:
                choice["spec"] = spec_record(c.ended)
            out.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", out)
        stats = [c.ended for c in choices]
        body.update(usage=self._usage(stats, streamed=False))
        if len(choices) == 1:
            body["spec"] = spec_record(stats[0])
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        ids: list[int] | tuple[int, ...] = (),
        finish: str | None = None,
        origins: dict[str, Any] | None = None,
        entries: list[TokenEntry] | tuple[TokenEntry, ...] = (),
        tool_deltas: list[dict[str, Any]] | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        """One streamed chunk of choice `index` (text None: a chat chunk with an empty delta);
        `origins`: its round's token origins (serve.origins), for include_speculation."""
        c: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if entries:
            c["logprobs"] = self._logprobs(list(entries), offset)
        if self.chat:
            c["delta"] = {} if text is None else {"content": text}
            if tool_deltas:
                c["delta"] = {"tool_calls": tool_deltas}
        else:
            c["text"] = text or ""
        if self.req.return_token_ids:
            c["token_ids"] = list(ids)
        if origins is not None:
            c["speculation"] = origins
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [c])

    def first_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's opening chunk: the assistant role (and the prompt ids, if asked)."""
        first = self.chunk(index, "")
        first["choices"][0]["delta"]["role"] = "assistant"
        if self.req.return_token_ids:
            first["prompt_token_ids"] = self.prompt_ids
        return first

    def last_chunk(self, c: Choice, n: int) -> dict[str, Any]:
        last = self.chunk(c.index, None, (), c.finish)
        if n == 1:
            last.update(usage=self._usage([c.ended], streamed=True), spec=spec_record(c.ended))
        else:
            last["choices"][0]["spec"] = spec_record(c.ended)
        return last

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        stats = [c.ended for c in choices]
        body.update(usage=self._usage(stats, streamed=True))
        if len(choices) == 1:
            body["spec"] = spec_record(stats[0])
        return body


# ------------------------------------------------------------------------------ the answer
async def respond(
    request: Request,
    engine: Engine,
    reply: Reply,
    params: GenParams,
    samples: list[Sample],
    reservations: list[Reservation],
) -> Response:
    """Queue the request's samples in their reserved places, then answer with the whole
    completion or an SSE stream (which then owns the samples)."""
    with submitted(request, engine, samples, reservations) as held:
        first = await next_event(engine, samples[0])  # Start, or Failed while queued or at start
        if isinstance(first, Failed):
            raise first.error
        choices = [
            Choice(i, ToolParser(params.tools) if params.tools is not None else None)
            for i in range(len(samples))
        ]
        if reply.req.streaming:
            events = _sse_events(engine, samples, reply, choices)
            return held.stream(events, headers={"Cache-Control": "no-cache"})
        async for i, ev in sample_events(engine, samples):
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Delta):
                choices[i].take(ev)
            elif isinstance(ev, Done):
                choices[i].end(ev)
        # the whole answer is built and serialized off the event loop: n samples of long
        # answers with top_logprobs are hundreds of MB of objects, seconds of work
        return await asyncio.to_thread(lambda: JSONResponse(reply.completion(choices)))


async def _sse_events(
    engine: Engine, samples: list[Sample], reply: Reply, choices: list[Choice]
) -> AsyncIterator[str]:
    n = len(choices)
    offsets = [len(reply.echo)] * n  # completions' text_offset
    if reply.chat:
        for c in choices:
            yield _sse(reply.first_chunk(c.index))
    elif reply.echo:
        for c in choices:
            yield _sse(reply.chunk(c.index, reply.echo))
    async for i, ev in sample_events(engine, samples):
        c = choices[i]
        if isinstance(ev, Delta):
            text, calls = c.take(ev)
            deltas = [d for call in calls for d in call.deltas()]
            wanted = ev.origins is not None or (reply.req.return_token_ids and ev.token_ids)
            if text or deltas or wanted or (ev.logprobs and reply.logprobs):
                # the round's ids, origins and logprobs ride on its first chunk: its content,
                # else its first tool-call delta; the other deltas follow, one a chunk
                lead = [] if text or not deltas else deltas[:1]
                yield _sse(
                    reply.chunk(
                        i, text, ev.token_ids, None, ev.origins, ev.logprobs, lead, offsets[i]
                    )
                )
                for d in deltas[len(lead) :]:
                    yield _sse(reply.chunk(i, None, tool_deltas=[d]))
            offsets[i] += sum(len(e.text) for e in ev.logprobs)
        elif isinstance(ev, Failed):
            yield _sse(ev.error.body())
            return
        elif isinstance(ev, Done):
            rest = c.end(ev)
            if rest:
                yield _sse(reply.chunk(i, rest))
            yield _sse(reply.last_chunk(c, n))
    if reply.req.include_usage:
        yield _sse(reply.usage_chunk(choices))
    yield "data: [DONE]\n\n"


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
