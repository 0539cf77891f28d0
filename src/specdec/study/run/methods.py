"""The methods a bench run times, and what each receives (study.run.bench runs the protocol).

A method is a `Runner`: one `Task` (a prompt as every method receives it) in, one RUN record out
(core.metrics.GenerationStats.to_dict() plus tokens, or an endpoint's record, engines.endpoint.
run_record). The methods: target-only ("baseline") and speculative decoding in process, the
same two as `specdec serve` processes (--serve), an OpenAI-compatible endpoint, llama.cpp's
servers and tools (engines.anchors), transformers' assisted generation, and the variants
("DRAFTER:K").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.backends import chat as prompting
from specdec.backends import load_model
from specdec.backends.costs import CurveFiles
from specdec.core.config import FREE_DRAFTERS, MODEL_DRAFTERS, runs_as
from specdec.core.generate import generate
from specdec.core.metrics import Round
from specdec.core.model import SpecModel
from specdec.core.policy import AutoPolicies
from specdec.core.prediction import PredictionDrafter, PredictionIndex
from specdec.study.artifacts.runs import round_log
from specdec.study.engines import anchors, endpoint
from specdec.study.engines import hf_assisted as hf
from specdec.study.run.bench_settings import (
    WRONG_PREDICTION,
    BenchConfig,
    core_drafter,
    parse_variant,
)


def variant_name(drafter: str, k: int | str) -> str:
    return f"{drafter}-k{k}"


@dataclass(frozen=True)
class Task:
    """One prompt as every method receives it."""

    ids: list[int]  # the chat-templated prompt
    seed: int
    prediction: list[int] | None  # the prompt's own prediction, tokenized (None: it has none)
    other_prediction: list[int] | None  # another task's, for the wrong-prediction leg
    text: str = ""  # the prompt as an endpoint receives it (the user turn)
    prediction_text: str | None = None  # the prediction as text, for endpoints
    # the conversation before the user turn (a session's later turns; `ids` include it)
    history: tuple[Mapping[str, str], ...] = ()


Runner = Callable[[Task], Mapping[str, Any]]  # -> RUN record


def _needs(cfg: BenchConfig) -> tuple[bool, bool]:
    """(draft, target): which models the in-process methods run on."""
    peers = cfg.peers
    local = [(cfg.spec.drafter, cfg.spec.k)] if peers.endpoint is None and not peers.served else []
    local += [parse_variant(v) for v in cfg.variants]
    draft = peers.compare == "hf-assisted" or any(d in MODEL_DRAFTERS for d, _ in local)
    baseline_local = peers.endpoint_baseline is None and not peers.served
    target = bool(local) or baseline_local or peers.compare == "hf-assisted"
    return draft, target


@dataclass
class Engines:
    """The out-of-process methods of a run: method name -> endpoint client, or -> a llama.cpp
    tool run once per prompt (anchors.LlamaLookup)."""

    clients: dict[str, endpoint.Client]
    settings: dict[str, Any]  # what the artifact records of them
    tools: dict[str, anchors.LlamaLookup] = field(default_factory=dict)


@contextmanager
def engines(cfg: BenchConfig, progress: bool) -> Iterator[Engines]:
    """Endpoint clients for cfg.peers.endpoint / endpoint_baseline and the llama-server anchors
    (started one at a time before the first prompt, stopped after the last)."""
    peers = cfg.peers
    eps = given_endpoints(cfg)
    settings: dict[str, Any] = {m: ep.describe() for m, ep in eps.items()}
    tools: dict[str, anchors.LlamaLookup] = {}
    with ExitStack() as stack:
        for method, srv in specdec_servers(cfg).items():
            if progress:
                print(f"starting specdec serve ({method}): {srv.args}", file=sys.stderr)
            stack.enter_context(srv)
            eps[method] = srv.endpoint()
            settings[method] = srv.describe()
        for srv in anchors.servers_for(peers.llama_server, cfg.target, cfg.draft, tools=True):
            name = anchors.method_name(srv.mode)
            if isinstance(srv, anchors.LlamaLookup):
                tools[name] = stack.enter_context(srv)
                settings[name] = srv.describe()
                continue
            if progress:
                print(f"starting {name}: {srv.args}", file=sys.stderr)
            stack.enter_context(srv)
            ep = srv.endpoint()
            if cfg.sessions:  # its prompt cache on, as an editor's server has it
                ep = replace(ep, extra={**ep.extra, "cache_prompt": True})
            eps[ep.name] = ep
            settings[ep.name] = {**ep.describe(), **srv.describe()}
        clients = {m: stack.enter_context(endpoint.Client(ep)) for m, ep in eps.items()}
        yield Engines(clients, settings, tools)


def given_endpoints(cfg: BenchConfig) -> dict[str, endpoint.Endpoint]:
    """The running servers of cfg.peers: --endpoint as "speculative", --endpoint-baseline as
    "baseline", each labelled by its URL, with the key from the environment."""
    peers, key = cfg.peers, endpoint.api_key_from_env()
    given = {"speculative": peers.endpoint, "baseline": peers.endpoint_baseline}
    return {
        m: endpoint.Endpoint(url, peers.endpoint_model, peers.endpoint_api, key, label=url)
        for m, url in given.items()
        if url is not None
    }


def specdec_servers(cfg: BenchConfig) -> dict[str, anchors.SpecdecServer]:
    """With cfg.peers.served: "baseline" (target-only) and "speculative" (the run's drafter and
    K) as `specdec serve` processes; a prediction comes with each request, drafted first, then
    prompt lookup (what the in-process prediction drafter does)."""
    if not cfg.peers.served:
        return {}
    spec = cfg.spec
    # the server's drafter as it runs without a prediction: each request brings its own
    drafter = str(runs_as(spec.drafter, has_prediction=False))
    args = ["--drafter", drafter, "-k", str(spec.k)]
    if drafter in MODEL_DRAFTERS:
        args = ["--draft", cfg.draft, *args]
    if spec.k_max is not None:
        args += ["--k-max", str(spec.k_max)]
    if spec.p_min is not None:
        args += ["--p-min", str(spec.p_min)]
    if cfg.deterministic:
        args += ["--deterministic"]
    base = ["--deterministic"] if cfg.deterministic else []
    server = anchors.PromptCachingServer if cfg.sessions else anchors.SpecdecServer
    name = f"served-{spec.drafter}"
    return {
        "baseline": server(Path(), tuple(base), target=cfg.target, name="served"),
        "speculative": server(Path(), tuple(args), target=cfg.target, name=name),
    }


@contextmanager
def loaded_pair(cfg: BenchConfig) -> Iterator[tuple[SpecModel | None, SpecModel | None]]:
    """(draft, target) loaded from `cfg`, closed on exit; None for a model no in-process
    method of the run needs (lookup alone needs no draft; two endpoints need neither)."""
    if cfg.device is not None:
        from specdec.core.device import get_device

        get_device(cfg.device)  # an unavailable device fails before minutes of loading
    kw = {"device": cfg.device, "deterministic": cfg.deterministic}
    need_draft, need_target = _needs(cfg)
    draft = load_model(cfg.draft, **kw) if need_draft else None
    try:
        target = load_model(cfg.target, **kw) if need_target else None
        try:
            yield draft, target
        finally:
            if target is not None:
                target.close()
    finally:
        if draft is not None:
            draft.close()


def runners(
    cfg: BenchConfig,
    draft: SpecModel | None,
    target: SpecModel | None,
    stops: list[int],
    engines: Engines,
    tokenizer: Any,
) -> dict[str, Runner]:
    """Every method of the run, in run order: baseline, speculative, then hf_assisted or the
    llama-server methods (one --compare at a time), then the variants. An endpoint's client
    replaces the in-process baseline or speculative method it stands for. k="auto" methods keep
    their policies across the run's prompts, as a server does across requests."""
    sampling = dict(max_new_tokens=cfg.max_new_tokens, warp=cfg.warp, stop_ids=stops)
    policies = AutoPolicies(CurveFiles())

    def speculative(drafter: str, k: int | str) -> Runner:
        free = drafter == WRONG_PREDICTION or drafter in FREE_DRAFTERS
        d = None if free else draft  # model-free drafters need no draft model

        def run(t: Task) -> Mapping[str, Any]:
            pred = t.other_prediction if drafter == WRONG_PREDICTION else t.prediction
            name = runs_as(core_drafter(drafter), has_prediction=pred is not None)
            spec = replace(cfg.spec, drafter=name, k=k)  # the run's k_max and p_min
            kw = (
                {"prediction": _with_hints(tokenizer, pred, t.text)} if name == "prediction" else {}
            )
            rounds: list[Round] = []
            result = generate(
                target,
                t.ids,
                draft=d,
                spec=spec,
                seed=t.seed,
                on_round=rounds.append,
                policies=policies,
                **sampling,
                **kw,
            )
            return {**record(result), "round_log": round_log(rounds)}

        return run

    runners: dict[str, Runner] = {
        "baseline": lambda t: record(generate(target, t.ids, seed=t.seed, **sampling)),
        "speculative": speculative(str(cfg.spec.drafter), cfg.spec.k),
    }
    for name, client in engines.clients.items():
        # OpenAI's `prediction` field goes to --endpoint only, and only for --drafter prediction
        # (llama-server, like most engines, has no such field)
        pred = name == "speculative" and cfg.spec.drafter == "prediction"
        runners[name] = endpoint_runner(cfg, client, tokenizer, with_prediction=pred)
    for name, tool in engines.tools.items():
        runners[name] = tool_runner(cfg, name, tool, tokenizer)
    if cfg.peers.compare == "hf-assisted":
        runners["hf_assisted"] = lambda t: hf.run(
            draft,
            target,
            t.ids,
            k=cfg.spec.k,
            max_new_tokens=cfg.max_new_tokens,
            warp=cfg.warp,
            seed=t.seed,
            stops=stops,
        )
    for v in cfg.variants:
        runners[variant_name(*parse_variant(v))] = speculative(*parse_variant(v))
    return runners


def _with_hints(tokenizer: Any, pred: list[int], text: str) -> list[int] | PredictionIndex:
    """The prediction with the rewrites its instruction names (core.edits.named_rewrites: a
    "rename `X` to `Y`" is drafted as Y from the first occurrence on)."""
    hints = prompting.prediction_hints(tokenizer, text)
    return PredictionIndex(pred, PredictionDrafter.N_MAX, hints) if hints else pred


def endpoint_runner(
    cfg: BenchConfig, client: endpoint.Client, tokenizer: Any, with_prediction: bool
) -> Runner:
    """A method sent to an endpoint; `with_prediction`: the prompt's prediction goes in the
    request as OpenAI's `prediction` field."""

    def run(t: Task) -> Mapping[str, Any]:
        req = endpoint.Request(
            t.text,
            cfg.max_new_tokens,
            cfg.warp,
            t.seed,
            prediction=t.prediction_text if with_prediction else None,
            history=t.history,
        )
        reply = client.stream(req)
        return {**endpoint.run_record(reply, client.endpoint, tokenizer), **_usage_details(reply)}

    return run


def _usage_details(reply: endpoint.Reply) -> dict[str, Any]:
    """What OpenAI's usage details say, when the server sends them: prompt tokens served from
    its prompt cache (`cached_prompt_tokens`) and the prediction's accepted / rejected tokens
    (specdec serve; llama-server reports its cache in `server_timings.cache_n`)."""
    usage = reply.usage or {}
    out = {}
    fields = (
        ("prompt_tokens_details", "cached_tokens", "cached_prompt_tokens"),
        ("completion_tokens_details", "accepted_prediction_tokens", "accepted_prediction_tokens"),
        ("completion_tokens_details", "rejected_prediction_tokens", "rejected_prediction_tokens"),
    )
    for block, key, name in fields:
        details = usage.get(block)
        n = endpoint.count(details.get(key)) if isinstance(details, dict) else None
        if n is not None:
            out[name] = n
    return out


def tool_runner(cfg: BenchConfig, name: str, tool: anchors.LlamaLookup, tokenizer: Any) -> Runner:
    """A llama.cpp tool run once per prompt on the task's chat-templated prompt (as text, the
    special tokens spelled out: the tool tokenizes them back); the RUN record has the keys of an
    endpoint's (endpoint.run_record), times from the tool's own report (no model load)."""

    def run(t: Task) -> Mapping[str, Any]:
        prompt = tokenizer.decode(t.ids, skip_special_tokens=False)
        try:
            r = tool.run(prompt, cfg.max_new_tokens, cfg.warp.temperature, t.seed)
        except anchors.AnchorError as e:  # one prompt's failure, recorded like an endpoint's
            raise endpoint.EndpointError("tool", str(e)) from e
        if r["prompt_tokens"] != len(t.ids):  # it would be timing another prompt
            raise endpoint.EndpointError(
                "tool",
                f"{name} read {r['prompt_tokens']} prompt tokens where the bench has "
                f"{len(t.ids)}: the prompt did not survive the text round trip",
            )
        wall = r["prefill_s"] + r["decode_s"]
        return {
            "endpoint": name,
            "generated": r["generated"],
            "usage_source": "tool report",
            "wall_s": wall,
            "ttft_s": r["prefill_s"],
            "prefill_s": r["prefill_s"],
            "tokens_per_s": r["generated"] / wall if wall > 0 else 0.0,
            "prompt_tokens": r["prompt_tokens"],
            "stop_reason": None,
            "drafted": r["drafted"],
            "accepted": r["accepted"],
            "process_s": r["process_s"],
            "text": r["text"],
            "tokens": endpoint.tokenize(tokenizer, r["text"]),
        }

    return run


def record(result: Any) -> dict[str, Any]:
    """RUN = GenerationStats.to_dict() + tokens + stop_reason (core.metrics defines each field)."""
    return {**result.stats.to_dict(), "tokens": result.tokens, "stop_reason": result.stop_reason}
