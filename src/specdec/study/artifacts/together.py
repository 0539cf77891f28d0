"""specdec.together/1: the concurrency bench, C requests at once against servers (study/run/
together.py: the protocol, and how each number is made).

Fields `added_later()` are missing from the artifacts committed before the producer wrote them;
those read and write back without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from specdec.study.artifacts.base import Artifact, Record, added_later, schema_field


class TogetherReply(Record):
    """One request answered, timed by the client from the group's first send."""

    prompt_id: str
    start_s: float
    end_s: float
    wall_s: float  # sent -> [DONE], the queue wait included
    ttft_s: float | None
    tokens: int | None  # the completion tokens its server reported
    text: str
    drafted: int | None = added_later()  # its server's counts; None where it reports none
    accepted: int | None = added_later()
    rounds: int | None = added_later()  # specdec serve's


class TogetherFailure(Record):
    """One request that failed."""

    prompt_id: str
    error: str  # "KIND: message" (study.engines.endpoint.EndpointError)


class TogetherRow(Record):
    """One method, one group of C requests sent at once."""

    method: str
    repeat: int
    group: int
    errors: int
    tokens: int  # completion tokens of the group's answers
    span_s: float  # first send -> last answer's end
    tokens_per_s: float  # tokens / span_s: the aggregate a client fleet sees
    slowest_s: float  # the longest request
    requests: tuple[TogetherReply | TogetherFailure, ...]


class TogetherMethod(Record):
    """One method over its rows."""

    tokens_per_s: float  # geometric mean over the rows
    slowest_s: float  # the same
    errors: int
    answers: int
    same_answers: int  # answers equal to the first method's to the same prompt (same repeat)
    latency_p50_s: float | None = added_later()  # nearest rank over the answered requests
    latency_p95_s: float | None = added_later()
    ttft_p50_s: float | None = added_later()
    ttft_p95_s: float | None = added_later()
    acceptance_rate: float | None = added_later()  # pooled over requests that reported drafts
    tokens_per_round: float | None = added_later()  # pooled over requests that reported rounds


class TogetherArtifact(Artifact):
    """specdec.together/1: one concurrency run."""

    SCHEMA: ClassVar[str] = "specdec.together/1"
    schema_id: Literal["specdec.together/1"] = schema_field("specdec.together/1")
    # the bench config (run.bench_settings.BenchConfig.to_json()) + {concurrency, repeats}
    config: Mapping[str, Any]
    engines: Mapping[str, Mapping[str, Any]]  # method -> its server's description
    rows: tuple[TogetherRow, ...]
    methods: Mapping[str, TogetherMethod]  # in plan order
