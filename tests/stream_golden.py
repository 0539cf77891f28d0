"""The default SSE stream as bytes, for the byte-for-byte check of issue 24.

A few streamed requests against a mock server (greedy and sampled, chat and completions, a stop
string, include_usage, return_token_ids), each response body as the client received it, with
what differs between runs masked: ids, timestamps and the two timings of the `spec` object.
tests/fixtures/default_stream.golden holds what the server sent before the speculation extensions
existed; it was recorded from commit 6743831 (`git archive 6743831 src tests`, then
`PYTHONPATH=src python tests/stream_golden.py > tests/fixtures/default_stream.golden` in that
tree). tests/serve/test_speculation.py compares today's server with it. A change to the core that
changes the mock's tokens (sampling, drafting, a K policy) changes the recording without
changing the stream's shape: re-record it then, from today's tree, after reading the diff.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
from typing import Any

from serverkit import MOCK_SPEC, FakeTokenizer, Server, SlowMock, V

from specdec.serve.config import ServeConfig
from specdec.serve.engine import Engine


class TemplateTokenizer(FakeTokenizer):
    """FakeTokenizer with a chat template, so that a mock model serves /v1/chat/completions."""

    chat_template = "mock"  # any non-empty template: apply_chat_template below renders it
    delay = 0.0

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **_: Any
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def golden_server(**cfg_kw: Any) -> Server:
    """A mock target + draft with a chat template, fixed K = 4 (what the golden was made with)."""
    target = SlowMock(V, seed=0, name=MOCK_SPEC)
    target.tokenizer = TemplateTokenizer()
    draft = SlowMock.near(target, noise=0.7, seed=1)
    draft.tokenizer = target.tokenizer  # one tokenizer: core.pair compares nothing more
    engine = Engine(target, draft, ServeConfig(target=MOCK_SPEC, k=4, draft_pool="off"))
    engine.warm_up()
    return Server(engine, ServeConfig(target=MOCK_SPEC, **cfg_kw))


_CHAT = {"model": MOCK_SPEC, "messages": [{"role": "user", "content": "hello, mock"}]}
_COMPLETION = {"model": MOCK_SPEC, "prompt": [1, 2, 3, 4, 1, 2]}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {**_COMPLETION, "max_tokens": 12, "temperature": 0}),
    (
        "/v1/completions",
        {
            **_COMPLETION,
            "max_tokens": 9,
            "temperature": 0.8,
            "seed": 3,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        },
    ),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 10, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            **_CHAT,
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": 11,
            "stop": ["5", "Z"],
            "stream_options": {"include_usage": True},
        },
    ),
]

_MASKS = (
    (re.compile(rb'"id":"[^"]*"'), b'"id":"-"'),
    (re.compile(rb'"created":\d+'), b'"created":0'),
    (re.compile(rb'"(ttft_s|wall_s)":[-+0-9.eE]+'), rb'"\1":0'),
)


def masked(body: bytes) -> bytes:
    for pattern, repl in _MASKS:
        body = pattern.sub(repl, body)
    return body


def stream_bytes(srv: Server, path: str, body: dict[str, Any]) -> bytes:
    """The raw SSE body of one streamed request, masked."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    data = json.dumps({**body, "stream": True})
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    assert resp.status == 200, raw[:500]
    return masked(raw)


def capture(srv: Server) -> bytes:
    """Every request of REQUESTS, each after a header line naming it."""
    out = b""
    for path, body in REQUESTS:
        out += f"### POST {path} {json.dumps(body, sort_keys=True)}\n".encode()
        out += stream_bytes(srv, path, body)
    return out


if __name__ == "__main__":
    server = golden_server()
    try:
        sys.stdout.buffer.write(capture(server))
    finally:
        server.close()
