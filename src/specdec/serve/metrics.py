"""The server's counters and histograms, rendered in the Prometheus text format.

Every metric is defined in its HELP line (after vLLM's spec-decode metrics). Label values come
from fixed sets only (route templates, status codes, outcomes, drafter names, draft positions up
to the largest K a request may ask for), so no request can add series: a path that is not a
route is counted as endpoint="other".
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from specdec.core.metrics import GenerationStats

#: The routes counted by specdec_requests_total, by template; any other /v1 path is "other".
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def endpoint_label(path: str) -> str | None:
    """The `endpoint` label for a request to `path`; None for paths outside /v1 (not counted)."""
    if path in ENDPOINTS:
        return path
    return "other" if path.startswith("/v1/") else None


@dataclass(frozen=True)
class RoundMark:
    """One round as the worker saw it: when its tokens were committed, how many, how many
    draft tokens it sent to verification (0: a plain target step)."""

    t: float  # time.perf_counter()
    tokens: int
    drafted: int


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # cumulative, Prometheus-style
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)

# name -> (type, HELP). The HELP lines are the definitions.
_METRICS: dict[str, tuple[str, str]] = {
    "specdec_requests_total": (
        "counter",
        "HTTP requests to /v1 endpoints answered, by route (other: not a route) and status "
        "code (429 rejections and errors included)",
    ),
    "specdec_generations_total": (
        "counter",
        "Requests that reached the engine, by outcome: finished (stop or length), "
        "cancelled (client went away), timeout, error, shutdown",
    ),
    "specdec_queue_depth": (
        "gauge",
        "Requests waiting for the engine (not counting the one being generated)",
    ),
    "specdec_queue_capacity": ("gauge", "--max-queue: waiting requests beyond it get HTTP 429"),
    "specdec_busy": ("gauge", "1 while the engine is generating, else 0"),
    "specdec_running": ("gauge", "Requests being generated, one per busy slot"),
    "specdec_slots": ("gauge", "--parallel: requests the engine generates at once"),
    # The three gauges a router scrapes (the model-server protocol of the Gateway API inference
    # extension, llm-d's scheduler): named as vLLM's, which its flags map one to one.
    "specdec:num_requests_waiting": (
        "gauge",
        "Requests waiting for a slot (TotalQueuedRequests; equals specdec_queue_depth)",
    ),
    "specdec:num_requests_running": (
        "gauge",
        "Requests being generated (TotalRunningRequests; equals specdec_running)",
    ),
    "specdec:kv_cache_usage_perc": (
        "gauge",
        "The target's KV cells holding tokens over all of its slots' cells, 0 to 1 "
        "(KVCacheUtilization; a slot keeps its prompt's KV for the prompt cache after the "
        "request, so an idle server may report above 0)",
    ),
    "specdec_pass_pace": (
        "gauge",
        "llama.cpp passes' recent time over the fastest this process ran at the same size, "
        "a moving average of ~10 passes: 1 on an idle machine, several beside other work",
    ),
    "specdec_threads": ("gauge", "Threads of the latest llama.cpp pass (backends.cores)"),
    "specdec_other_cores": (
        "gauge",
        "Cores' worth of other processes' work on this process's cores in the latest "
        "half-second window (/proc/stat); -1 where it cannot be read",
    ),
    "specdec_thread_wait": (
        "gauge",
        "Seconds per second this process's threads waited on a run queue in the latest "
        "half-second window: ~0 alone or beside niced work, 0.25 and more when others compete "
        "for its cores (the pool then gives up a thread); -1 where it cannot be read",
    ),
    "specdec_generations_by_drafter_total": (
        "counter",
        "Generations run, by the drafter they ran with: the request's speculation.drafter, "
        "else the server's default (none: the target alone)",
    ),
    "specdec_prompt_tokens_total": ("counter", "Prompt tokens of generations started"),
    "specdec_cached_prompt_tokens_total": (
        "counter",
        "Prompt tokens whose KV was kept from the previous request (not prefilled again)",
    ),
    "specdec_prompt_store_restored_total": (
        "counter",
        "Slots' caches restored from RAM for a request of their scope (serve --cache-ram)",
    ),
    "specdec_prompt_store_bytes": (
        "gauge",
        "Bytes of slots' caches kept in RAM now (at most serve --cache-ram MiB)",
    ),
    "specdec_prompt_store_entries": ("gauge", "Slots' caches kept in RAM now"),
    "specdec_generated_tokens_total": (
        "counter",
        "Tokens committed (accepted + one recovered or bonus token per round)",
    ),
    "specdec_rounds_total": (
        "counter",
        "Target forward passes after the prefill (one per round; a plain target "
        "step is a round with no draft)",
    ),
    "specdec_drafts_total": (
        "counter",
        "Drafting rounds: rounds that drafted at least one token",
    ),
    "specdec_draft_tokens_total": ("counter", "Draft tokens proposed and sent to verification"),
    "specdec_accepted_tokens_total": ("counter", "Draft tokens kept by the accept rule"),
    "specdec_prediction_tokens_total": (
        "counter",
        "Draft tokens taken from requests' predictions, by outcome (accepted: in the output; "
        "rejected: verified and not kept, as OpenAI's usage fields)",
    ),
    "specdec_drafted_per_position_total": (
        "counter",
        "Rounds that drafted a token at this position (1 = first draft token)",
    ),
    "specdec_accepted_per_position_total": (
        "counter",
        "Rounds whose draft token at this position was accepted; divided by "
        "specdec_drafted_per_position_total it is the acceptance rate by position",
    ),
    # The cross-request draft pools (serve.draft_pools, core.pool.PoolStats)
    "specdec_draft_pool_scopes": (
        "gauge",
        "Draft pools held now: one per scope that has sent a request (--draft-pool key: an "
        "API key, or the one anonymous scope of a server without keys; shared: one), at most "
        "--draft-pool-scopes (the least recently used goes first)",
    ),
    "specdec_draft_pool_tokens": (
        "gauge",
        "Tokens of earlier requests' prompts and outputs held by the draft pools now (each "
        "pool at most specdec_draft_pool_capacity_tokens; the oldest are evicted first)",
    ),
    "specdec_draft_pool_capacity_tokens": (
        "gauge",
        "--draft-pool-tokens: the tokens each scope's pool holds at most (0: pools off)",
    ),
    "specdec_draft_pool_memory_bytes": (
        "gauge",
        "Bytes the draft pools hold now (a pool allocates all of its memory when its scope "
        "sends its first request, and never more)",
    ),
    "specdec_draft_pool_memory_limit_bytes": (
        "gauge",
        "The most specdec_draft_pool_memory_bytes can reach: the pools that may be held at "
        "once, each of its fixed size",
    ),
    "specdec_draft_pool_documents_total": (
        "counter",
        "Documents added to the draft pools: one per request that reached the engine (its "
        "prompt and the tokens it committed, also when it was cut off)",
    ),
    "specdec_draft_pool_evicted_tokens_total": (
        "counter",
        "Tokens overwritten in the draft pools to make room for newer ones",
    ),
    "specdec_draft_pool_lookups_total": (
        "counter",
        "Searches of a draft pool for the context's last tokens (prompt lookup may search "
        "more than once a round: to pick the round's draft source, then to draft)",
    ),
    "specdec_draft_pool_hits_total": (
        "counter",
        "Draft-pool searches that found an earlier occurrence of the context's last tokens; "
        "divided by specdec_draft_pool_lookups_total it is the hit rate",
    ),
    "specdec_draft_pool_drafted_tokens_total": (
        "counter",
        "Draft tokens taken from a draft pool and sent to verification (draft sources pool4+, "
        "pool8+, pool16+; also counted in specdec_draft_tokens_total)",
    ),
    "specdec_draft_pool_accepted_tokens_total": (
        "counter",
        "Of those, tokens the accept rule kept (also counted in specdec_accepted_tokens_total)",
    ),
    "specdec_acceptance_length": (
        "histogram",
        "Tokens committed by one drafting round: accepted drafts plus the recovered or bonus "
        "token (so >= 1). Its mean is vLLM's mean acceptance length, 1 + accepted / drafting "
        "rounds; rounds that drafted nothing are not observed; a round cut short by a stop "
        "token or the max_tokens budget counts what it committed",
    ),
    "specdec_tokens_per_round": (
        "histogram",
        "Tokens committed by one round, rounds that drafted nothing included (each commits "
        "1). Its mean is tokens per target pass: generated tokens / rounds",
    ),
    "specdec_time_to_first_token_seconds": (
        "histogram",
        "Arrival of the request to its first committed token: queue wait, prefill "
        "and the first draft + verify round",
    ),
    "specdec_inter_token_latency_seconds": (
        "histogram",
        "Time between consecutive rounds' committed tokens of one request; a round "
        "that commits several tokens is observed once",
    ),
    "specdec_queue_wait_seconds": ("histogram", "Arrival of the request to the engine starting it"),
    "specdec_request_latency_seconds": (
        "histogram",
        "Arrival of the request to its last committed token (finished ones)",
    ),
}


class Metrics:
    """Counters and histograms of the server; updated from the worker and the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._hists = {
            "specdec_acceptance_length": _Histogram(_LENGTH_BUCKETS),
            "specdec_tokens_per_round": _Histogram(_LENGTH_BUCKETS),
            "specdec_time_to_first_token_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_inter_token_latency_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_queue_wait_seconds": _Histogram(_LATENCY_BUCKETS),
            "specdec_request_latency_seconds": _Histogram(_LATENCY_BUCKETS),
        }

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        with self._lock:
            series = self._counters.setdefault(name, {})
            key = tuple(sorted(labels.items()))
            series[key] = series.get(key, 0) + value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._hists[name].observe(value)

    def count_request(self, path: str, status: int) -> None:
        """One answered HTTP request, labelled by route template (never by the raw path)."""
        endpoint = endpoint_label(path)
        if endpoint is not None:
            self.inc("specdec_requests_total", endpoint=endpoint, code=str(status))

    def record_generation(
        self,
        stats: GenerationStats,
        outcome: str,
        arrived: float,
        started: float,
        rounds: list[RoundMark],
    ) -> None:
        self.inc("specdec_generations_total", outcome=outcome)
        self.inc("specdec_prompt_tokens_total", stats.prompt_tokens)
        self.inc("specdec_cached_prompt_tokens_total", stats.cached_prompt_tokens)
        self.inc("specdec_generated_tokens_total", stats.generated)
        self.inc("specdec_rounds_total", stats.rounds)
        self.inc("specdec_drafts_total", stats.drafting_rounds)
        self.inc("specdec_draft_tokens_total", stats.drafted)
        self.inc("specdec_accepted_tokens_total", stats.accepted)
        self.inc(
            "specdec_prediction_tokens_total", stats.accepted_prediction_tokens, outcome="accepted"
        )
        self.inc(
            "specdec_prediction_tokens_total", stats.rejected_prediction_tokens, outcome="rejected"
        )
        for i, (d, a) in enumerate(zip(stats.drafted_per_pos, stats.accepted_per_pos, strict=True)):
            self.inc("specdec_drafted_per_position_total", d, position=str(i + 1))
            self.inc("specdec_accepted_per_position_total", a, position=str(i + 1))
        self.observe("specdec_queue_wait_seconds", started - arrived)
        for r in rounds:
            self.observe("specdec_tokens_per_round", r.tokens)
            if r.drafted:
                self.observe("specdec_acceptance_length", r.tokens)
        if rounds:
            self.observe("specdec_time_to_first_token_seconds", rounds[0].t - arrived)
            if outcome == "finished":
                self.observe("specdec_request_latency_seconds", rounds[-1].t - arrived)
        for a, b in itertools.pairwise(rounds):
            self.observe("specdec_inter_token_latency_seconds", b.t - a.t)

    def render(self, gauges: dict[str, float]) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_) in _METRICS.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
                if kind == "gauge":
                    lines.append(f"{name} {_num(gauges.get(name, 0))}")
                elif kind == "counter":
                    series = self._counters.get(name) or ({(): 0} if "_per_" not in name else {})
                    for key, v in sorted(series.items()):
                        lines.append(f"{name}{_labels(key)} {_num(v)}")
                else:
                    h = self._hists[name]
                    for b, c in zip(h.buckets, h.counts, strict=True):
                        lines.append(f'{name}_bucket{{le="{b}"}} {c}')
                    lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                    lines += [f"{name}_sum {_num(h.sum)}", f"{name}_count {h.count}"]
        return "\n".join(lines) + "\n"


def _labels(key: tuple[tuple[str, str], ...]) -> str:
    if not key:
        return ""
    esc = (v.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n") for _, v in key)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(key, esc, strict=True)) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
