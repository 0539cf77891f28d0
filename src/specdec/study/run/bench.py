"""The throughput benchmark (paper, sections 5 and 6.2): target-only vs speculative decoding on the
same prompts.

Names as in the paper: p is the target, q the draft, K the speculation length.

Protocol (`run_bench`):
    * the first `n_prompts` vendored prompts (of `categories` only, when given: `--category`),
      chat-templated with the target's tokenizer;
    * per prompt i: seed = i, and every method runs on it back to back. The order alternates
      (even i: baseline first; odd i: the reverse), so a slow drift of the machine (thermal,
      another process) charges every method alike instead of favouring whichever runs second;
    * the first `warmup` prompts run every method but are not recorded (allocator, kernel and
      cache warm-up);
    * clocks are read after a device synchronize (`decode._Clock`); prompt tokens never count as
      generated tokens.

Statistics (artifacts/runs.py): `aggregate_runs` pools one method's rows into an
`artifacts.schema.Agg`, whose field comments define each one (means of per-prompt rates, pooled
sums and ratios, the latency split); `aggregate` adds the speedups, the variants and the
per-category means (`Aggregates`).

`--compare hf-assisted` adds transformers' own assisted generation (hf_assisted.py) as a third
method on the same prompts: the outside anchor for our implementation's speed. `sweep.py` runs
this protocol at several K.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.backends import chat as prompting
from specdec.backends import load_model, parse_spec
from specdec.backends.configs import CONFIGS as PAIRS
from specdec.backends.costs import CurveFiles
from specdec.core.config import DRAFTERS, SpecConfig, Warp, check_k
from specdec.core.config import check_int as _check_int
from specdec.core.decode import generate
from specdec.core.drafters import PredictionDrafter, PredictionIndex
from specdec.core.metrics import Round
from specdec.core.model import SpecModel
from specdec.core.policy import AutoPolicies
from specdec.study.artifacts.provenance import (
    meta_block,
    model_block,
    reset_peak_vram,
)
from specdec.study.artifacts.runs import aggregate, round_log
from specdec.study.artifacts.schema import (
    MAIN_METHODS,
    Aggregates,
    BenchArtifact,
    BenchRow,
    write_json,
)
from specdec.study.engines import anchors, endpoint
from specdec.study.engines import hf_assisted as hf
from specdec.study.present import fmt
from specdec.study.present.sessions import format_sessions
from specdec.study.run import prompts as prompt_set

#: Named (draft, target) pairs, as in the paper's Table 2 but on the models we have; configs.py
#: is the one definition (gate and microbench read it too).
CONFIGS: dict[str, tuple[str, str]] = {n: (c.draft, c.target) for n, c in PAIRS.items()}
CUSTOM = "custom"  # the config name of a --draft/--target pair
#: --compare: transformers' assisted generation, or llama.cpp's own server (engines/anchors.py)
COMPARES = ("hf-assisted", "llama-server")
#: The drafters a bench method may use: the core's, plus "wrong-prediction", the prediction
#: drafter given another task's file (the leg that shows a wrong prediction costs nothing).
WRONG_PREDICTION = "wrong-prediction"
BENCH_DRAFTERS = (*DRAFTERS, WRONG_PREDICTION)
METHODS = MAIN_METHODS  # in run order; variants follow
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # goes into file names


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; every field is a `specdec bench` flag. Validated on construction."""

    name: str
    draft: str  # model spec, BACKEND:NAME_OR_PATH
    target: str
    k: int | str = 4  # an int >= 1, "auto" or "schedule" (decode.generate)
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    n_prompts: int = 30
    warmup: int = 2
    max_new_tokens: int = 128
    compare: str | None = None  # None or "hf-assisted"
    device: str | None = None  # None: best available (specdec.core.device.get_device)
    drafter: str = "model"  # one of BENCH_DRAFTERS
    k_max: int | None = None  # the largest K for k="auto" / "schedule" (None: SpecConfig's)
    p_min: float | None = None  # draft confidence cutoff
    deterministic: bool = False  # batch-invariant llama.cpp numerics (backends.load_model)
    # Extra speculative methods run on the same prompts, "DRAFTER:K" each (e.g. "lookup:auto"):
    # one run holds every method of a comparison table, so their ratios are valid.
    variants: tuple[str, ...] = ()
    # Prompt categories to run (prompts.jsonl's "category"); () = every prompt. Applied before
    # n_prompts: the run takes the first n_prompts prompts of these categories, in file order.
    categories: tuple[str, ...] = ()
    # OpenAI-compatible servers (engines/endpoint.py) that stand in for the in-process methods:
    # `endpoint` runs "speculative", `endpoint_baseline` runs "baseline". With both, no model
    # is loaded (the target's tokenizer only, to count tokens where `usage` is missing).
    endpoint: str | None = None
    endpoint_baseline: str | None = None
    endpoint_model: str | None = None  # the requests' "model" (None: the server's first)
    endpoint_api: str = "chat"  # chat or completions (endpoint.APIS)
    # --compare llama-server: the llama-server methods run beside ours (anchors.SERVER_MODES)
    llama_server: tuple[str, ...] = ()
    # --serve: baseline and speculative run through `specdec serve` processes the bench starts
    # (anchors.SpecdecServer): the served comparison against llama-server, both warm
    served: bool = False

    @property
    def sessions(self) -> bool:
        """A run of multi-turn edit sessions (the "session" category): servers keep their
        prompt cache on (specdec serve --prompt-cache, llama-server cache_prompt), as an
        editor's server does between the turns of a conversation."""
        return SESSION in self.categories

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(_core_drafter(self.drafter), self.k, self.k_max, self.p_min)

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SAFE_NAME.match(self.name):
            raise ValueError(f"config name {self.name!r} must be letters, digits, '_', '.', '-'")
        backends = (parse_spec(self.draft)[0], parse_spec(self.target)[0])
        if self.drafter is None:
            raise ValueError(f"a bench needs a drafter; choose from {', '.join(DRAFTERS)}")
        self.spec  # noqa: B018 - SpecConfig and Warp check their fields (one rule each)
        self.warp  # noqa: B018
        for v in self.variants:
            parse_variant(v)
        if isinstance(self.categories, str) or not all(isinstance(c, str) for c in self.categories):
            raise ValueError(f"categories must be a tuple of names, got {self.categories!r}")
        n_available = len(select_prompts(self.categories))  # checks the category names
        what = "prompts"
        if self.categories:
            what = f"prompts (of categories {', '.join(self.categories)})"
        _check_int(what, self.n_prompts, 1, n_available)
        _check_int("warmup", self.warmup, 0)
        if self.warmup >= self.n_prompts:
            raise ValueError(
                f"warmup ({self.warmup}) must be < prompts ({self.n_prompts}): at least one "
                "prompt has to be recorded"
            )
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        for url in (self.endpoint, self.endpoint_baseline):
            if url is not None:
                endpoint.Endpoint(url, api=self.endpoint_api)  # checks the URL and the api
        if self.served and (self.endpoint or self.endpoint_baseline):
            raise ValueError(
                "--serve starts specdec's own servers for the baseline and the speculative "
                "method; drop --endpoint/--endpoint-baseline, or drop --serve"
            )
        if self.llama_server:
            anchors.check_modes(self.llama_server, self.target, self.draft, tools=True)
        if self.sessions and (self.endpoint_api != "chat" or self.compare == "hf-assisted"):
            raise ValueError(
                f"the {SESSION!r} category is a chat conversation: it needs --endpoint-api chat "
                "and no --compare hf-assisted"
            )
        if self.compare is not None:
            if self.compare not in COMPARES:
                raise ValueError(f"unknown --compare {self.compare!r}; choose from {COMPARES}")
            if self.compare == "llama-server" and not self.llama_server:
                raise ValueError("--compare llama-server needs at least one llama-server mode")
            if self.compare == "hf-assisted" and backends != ("hf", "hf"):
                raise ValueError(
                    "--compare hf-assisted runs transformers' generate(assistant_model=...), so "
                    f"both models must use the hf backend; config {self.name!r} pairs draft "
                    f"{self.draft} with target {self.target} (use --config all_hf, or "
                    "--draft hf:... --target hf:...)"
                )


def prompt_categories() -> tuple[str, ...]:
    """The categories of the vendored prompt set, in order of first appearance."""
    return tuple(dict.fromkeys(p.category for p in prompt_set.load_prompts()))


#: The categories --category accepts: the prompt set's, and "session" (multi-turn edit sessions:
#: study/run/data/sessions.jsonl, run by the session protocol below; alone, not with others)
SESSION = prompt_set.SESSION
CATEGORIES = (*prompt_categories(), SESSION)


def parse_categories(text: str | None) -> tuple[str, ...]:
    """'coding,reasoning' -> ('coding', 'reasoning'); None or '' -> () (every prompt)."""
    if text is None:
        return ()
    return tuple(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))


def select_prompts(
    categories: Sequence[str] = (), limit: int | None = None
) -> list[prompt_set.Prompt]:
    """The first `limit` vendored prompts of `categories` (all when empty), in file order.
    ValueError naming the valid categories for an unknown one. "session" selects the edit
    sessions, each by its opening turn (Session.opening), and runs alone."""
    if SESSION in categories:
        if len(categories) > 1:
            raise ValueError(
                f"the {SESSION!r} category runs alone (a session is several requests, with its "
                "own protocol); bench it in a run of its own"
            )
        openings = [s.opening() for s in prompt_set.load_sessions()]
        return openings[:limit] if limit is not None else openings
    prompts = prompt_set.load_prompts()
    valid = (*dict.fromkeys(p.category for p in prompts), SESSION)
    unknown = [c for c in categories if c not in valid]
    if unknown:
        raise ValueError(
            f"unknown prompt categor{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(map(repr, unknown))}; choose from {', '.join(valid)}"
        )
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    return prompts[:limit] if limit is not None else prompts


def _core_drafter(drafter: str) -> str:
    return "prediction" if drafter == WRONG_PREDICTION else drafter


def parse_variant(text: str) -> tuple[str, int | str]:
    """'DRAFTER:K' -> (drafter, K), e.g. 'lookup:auto' -> ('lookup', 'auto')."""
    drafter, sep, k = text.partition(":")
    if not sep or drafter not in BENCH_DRAFTERS:
        raise ValueError(
            f"variant {text!r} must be DRAFTER:K with DRAFTER one of {', '.join(BENCH_DRAFTERS)} "
            "and K an int >= 1, 'auto' or 'schedule' (e.g. lookup:auto)"
        )
    kk: int | str = int(k) if k.isdigit() else k
    check_k(kk)
    return drafter, kk


def variant_name(drafter: str, k: int | str) -> str:
    return f"{drafter}-k{k}"


def bench_config(
    name: str | None, draft: str | None = None, target: str | None = None, **settings: Any
) -> BenchConfig:
    """A named pair (`CONFIGS`), or a custom one from `draft` + `target`; `settings` are the
    remaining BenchConfig fields. (backends.configs.resolve_config looks up a named pair only.)"""
    if (draft is None) != (target is None):
        raise ValueError("give both --draft and --target (or neither, with --config NAME)")
    if draft is not None:
        if name not in (None, CUSTOM):
            raise ValueError(
                f"--config {name} already fixes the pair; drop --draft/--target, or pass them "
                f"alone (the config is then named {CUSTOM!r})"
            )
        return BenchConfig(CUSTOM, draft, target, **settings)
    if name is None:
        raise ValueError(f"give --config NAME ({', '.join(CONFIGS)}) or --draft and --target")
    if name not in CONFIGS:
        hint = " with --draft SPEC --target SPEC" if name == CUSTOM else ""
        raise ValueError(f"unknown config {name!r}{hint}; choose from {', '.join(CONFIGS)}")
    return BenchConfig(name, *CONFIGS[name], **settings)


def artifact_name(cfg: BenchConfig, tag: str | None = None) -> str:
    """bench_<config>_k<K>_t<T>[_<tag>].json: deterministic, so a rerun replaces its artifact."""
    drafter = "" if cfg.drafter == "model" else f"_{cfg.drafter}"
    cats = categories_part(cfg)
    return f"bench_{cfg.name}{drafter}_k{cfg.k}_t{cfg.temperature:g}{cats}{tag_suffix(tag)}.json"


def categories_part(cfg: BenchConfig) -> str:
    """'_cat-coding-reasoning' for a category-filtered run (so it never replaces the run on the
    whole set); '' otherwise."""
    return "".join(["_cat", *(f"-{c}" for c in cfg.categories)]) if cfg.categories else ""


def tag_suffix(tag: str | None) -> str:
    """'_<tag>' for a file name ('' for None); ValueError for a tag unsafe in file names."""
    if tag is None:
        return ""
    if not _SAFE_NAME.match(tag):
        raise ValueError(f"--tag {tag!r} must be letters, digits, '_', '.', '-'")
    return f"_{tag}"


# ------------------------------------------------------------------------------------ running
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


def run_bench(
    cfg: BenchConfig,
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    models: tuple[SpecModel, SpecModel] | None = None,
    tag: str | None = None,
) -> BenchArtifact:
    """Run the protocol above; write and return the specdec.bench/1 artifact (its `path` set).

    `models` = (draft, target) already loaded (the sweep and tests reuse them; they stay open),
    else both are loaded from `cfg` and closed afterwards. The artifact is rewritten atomically
    after every prompt with `complete: false`; on KeyboardInterrupt the finished rows are kept
    and the interrupt re-raised.
    """
    path = Path(out_dir) / artifact_name(cfg, tag)
    if models is None:
        with loaded_pair(cfg) as (draft, target), _engines(cfg, progress) as engines:
            return _run(cfg, draft, target, path, progress, engines)
    draft, target = models
    if cfg.compare == "hf-assisted" and not all(hf.is_hf(m) for m in models):
        raise ValueError(
            "--compare hf-assisted needs transformers models (hf backend) on both sides"
        )
    with _engines(cfg, progress) as engines:
        return _run(cfg, draft, target, path, progress, engines)


def _needs(cfg: BenchConfig) -> tuple[bool, bool]:
    """(draft, target): which models the in-process methods run on."""
    local = [(cfg.drafter, cfg.k)] if cfg.endpoint is None and not cfg.served else []
    local += [parse_variant(v) for v in cfg.variants]
    draft = cfg.compare == "hf-assisted" or any(d in ("model", "composite") for d, _ in local)
    baseline_local = cfg.endpoint_baseline is None and not cfg.served
    target = bool(local) or baseline_local or cfg.compare == "hf-assisted"
    return draft, target


@dataclass
class Engines:
    """The out-of-process methods of a run: method name -> endpoint client, or -> a llama.cpp
    tool run once per prompt (anchors.LlamaLookup)."""

    clients: dict[str, endpoint.Client]
    settings: dict[str, Any]  # what the artifact records of them
    tools: dict[str, anchors.LlamaLookup] = field(default_factory=dict)


@contextmanager
def _engines(cfg: BenchConfig, progress: bool) -> Iterator[Engines]:
    """Endpoint clients for cfg.endpoint / endpoint_baseline and the llama-server anchors
    (started one at a time before the first prompt, stopped after the last)."""
    from contextlib import ExitStack

    key = endpoint.api_key_from_env()
    given = {"speculative": cfg.endpoint, "baseline": cfg.endpoint_baseline}
    eps = {
        m: endpoint.Endpoint(url, cfg.endpoint_model, cfg.endpoint_api, key, label=url)
        for m, url in given.items()
        if url is not None
    }
    settings: dict[str, Any] = {m: ep.describe() for m, ep in eps.items()}
    tools: dict[str, anchors.LlamaLookup] = {}
    with ExitStack() as stack:
        for method, srv in _specdec_servers(cfg).items():
            if progress:
                print(f"starting specdec serve ({method}): {srv.args}", file=sys.stderr)
            stack.enter_context(srv)
            eps[method] = srv.endpoint()
            settings[method] = srv.describe()
        for srv in anchors.servers_for(cfg.llama_server, cfg.target, cfg.draft, tools=True):
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


def _specdec_servers(cfg: BenchConfig) -> dict[str, anchors.SpecdecServer]:
    """With cfg.served: "baseline" (target-only) and "speculative" (the run's drafter and K) as
    `specdec serve` processes; a prediction comes with each request, drafted first, then prompt
    lookup (what the in-process prediction drafter does)."""
    if not cfg.served:
        return {}
    drafter = "lookup" if cfg.drafter == "prediction" else _core_drafter(cfg.drafter)
    args = ["--drafter", drafter, "-k", str(cfg.k)]
    if drafter in ("model", "composite"):
        args = ["--draft", cfg.draft, *args]
    if cfg.k_max is not None:
        args += ["--k-max", str(cfg.k_max)]
    if cfg.p_min is not None:
        args += ["--p-min", str(cfg.p_min)]
    if cfg.deterministic:
        args += ["--deterministic"]
    base = ["--deterministic"] if cfg.deterministic else []
    server = anchors.PromptCachingServer if cfg.sessions else anchors.SpecdecServer
    return {
        "baseline": server(Path(), tuple(base), target=cfg.target, name="served"),
        "speculative": server(Path(), tuple(args), target=cfg.target, name=f"served-{cfg.drafter}"),
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


def _runners(
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
        free = drafter in ("lookup", "prediction", WRONG_PREDICTION)
        d = None if free else draft  # model-free drafters need no draft model

        def run(t: Task) -> Mapping[str, Any]:
            pred = t.other_prediction if drafter == WRONG_PREDICTION else t.prediction
            name = _core_drafter(drafter)
            if name == "prediction" and pred is None:
                name = "lookup"  # a prompt without a prediction: what the drafter falls back to
            spec = SpecConfig(name, k, cfg.k_max, cfg.p_min)
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
            return {**_record(result), "round_log": round_log(rounds)}

        return run

    runners: dict[str, Runner] = {
        "baseline": lambda t: _record(generate(target, t.ids, seed=t.seed, **sampling)),
        "speculative": speculative(cfg.drafter, cfg.k),
    }
    for name, client in engines.clients.items():
        # OpenAI's `prediction` field goes to --endpoint only, and only for --drafter prediction
        # (llama-server, like most engines, has no such field)
        pred = name == "speculative" and cfg.drafter == "prediction"
        runners[name] = _endpoint_runner(cfg, client, tokenizer, with_prediction=pred)
    for name, tool in engines.tools.items():
        runners[name] = _tool_runner(cfg, name, tool, tokenizer)
    if cfg.compare == "hf-assisted":
        runners["hf_assisted"] = lambda t: hf.run(
            draft,
            target,
            t.ids,
            k=cfg.k,
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


def _endpoint_runner(
    cfg: BenchConfig, client: endpoint.Client, tokenizer: Any, with_prediction: bool
) -> Runner:
    """A method sent to an endpoint; `with_prediction`: the prompt's prediction goes in the
    request as OpenAI's `prediction` field."""

    def run(t: Task) -> Mapping[str, Any]:
        req = endpoint.Request(
            t.text,
            cfg.max_new_tokens,
            cfg.temperature,
            t.seed,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
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


def _tool_runner(cfg: BenchConfig, name: str, tool: anchors.LlamaLookup, tokenizer: Any) -> Runner:
    """A llama.cpp tool run once per prompt on the task's chat-templated prompt (as text, the
    special tokens spelled out: the tool tokenizes them back); the RUN record has the keys of an
    endpoint's (endpoint.run_record), times from the tool's own report (no model load)."""

    def run(t: Task) -> Mapping[str, Any]:
        prompt = tokenizer.decode(t.ids, skip_special_tokens=False)
        try:
            r = tool.run(prompt, cfg.max_new_tokens, cfg.temperature, t.seed)
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


def _run(
    cfg: BenchConfig,
    draft: SpecModel | None,
    target: SpecModel | None,
    path: Path,
    progress: bool,
    engines: Engines,
) -> BenchArtifact:
    from tqdm import tqdm

    tokenizer = _tokenizer(cfg, draft, target)
    vocab = target.vocab_size if target is not None else len(tokenizer)
    stops = prompting.stop_ids(tokenizer)
    runners = _runners(cfg, draft, target, stops, engines, tokenizer)
    methods = list(runners)
    variants = tuple(m for m in methods if m not in METHODS)
    reset_peak_vram()
    blocks = {"draft": (cfg.draft, draft), "target": (cfg.target, target)}
    art = BenchArtifact(
        meta=meta_block(),
        config={**asdict(cfg), "engines": engines.settings},
        models={r: model_block(s, m) if m is not None else None for r, (s, m) in blocks.items()},
        rows=(),
        aggregates=aggregate([], methods),
        variants=variants,
        complete=False,
        path=path,
    )
    rows: list[BenchRow] = []
    failed: list[dict[str, Any]] = []
    prompts = select_prompts(cfg.categories, cfg.n_prompts)
    predictions = [_prediction_ids(tokenizer, p.prediction) for p in prompts]
    bar = tqdm(
        prompts,
        desc=f"bench {cfg.name} K={cfg.k}",
        unit="prompt",
        disable=not progress,
    )

    def snapshot(**kw: Any) -> BenchArtifact:
        update = {"rows": tuple(rows), "aggregates": aggregate(rows, methods)}
        return art.model_copy(update={**update, "failed": tuple(failed) or None, **kw})

    plan = _Plan(runners, methods, variants, predictions, tokenizer, vocab, failed)
    try:
        for i, prompt in enumerate(bar):
            for row in _prompt_rows(plan, i, prompt):
                if row is not None and i >= cfg.warmup:
                    rows.append(row)
                art = snapshot()
                write_json(path, art)
            bar.set_postfix_str(_postfix(art.aggregates) if rows else "warm-up")
    except KeyboardInterrupt:
        art = snapshot()
        write_json(path, art)
        print(f"\ninterrupted: {len(rows)} finished rows kept in {path}", file=sys.stderr)
        raise
    finally:
        bar.close()
    art = snapshot(complete=True)
    write_json(path, art)
    return art


@dataclass(frozen=True)
class _Plan:
    """What every prompt of a run is run with (`_run`'s loop)."""

    runners: dict[str, Runner]
    methods: list[str]
    variants: tuple[str, ...]
    predictions: list[list[int] | None]  # each selected prompt's, tokenized
    tokenizer: Any
    vocab: int
    failed: list[dict[str, Any]]  # endpoint failures, appended as they happen


def _prompt_rows(plan: _Plan, i: int, prompt: prompt_set.Prompt) -> Iterator[BenchRow | None]:
    """Prompt i's row (None when an endpoint failed on it); a session's rows, turn by turn."""
    if prompt.category == SESSION:
        yield from _session_rows(plan, i, prompt)
        return
    ids = _prompt_ids(plan.tokenizer, prompt.text, plan.vocab)
    other = another_prediction(plan.predictions, i)
    task = Task(ids, i, plan.predictions[i], other, prompt.text, prompt.prediction)
    sequence = plan.methods if i % 2 == 0 else plan.methods[::-1]
    runs = _run_methods(plan.runners, sequence, task, i, prompt.id, plan.failed)
    yield None if runs is None else _row(i, prompt, ids, sequence, runs, plan.variants)


def _session_rows(plan: _Plan, i: int, opening: prompt_set.Prompt) -> Iterator[BenchRow | None]:
    """The session protocol: its turns in order, every method on the same turn, back to back
    (the order alternating turn by turn). A turn is the conversation so far, its assistant
    turns the reference answers (target-only's: "baseline"), so every method gets the same
    request; the prediction is the file as the last answer left it (its first code block), as
    an editor applies the answer and sends the file. Rows: "<session>/t<n>", category
    session-t1 for the opening turn and session-t2+ for the later ones (by_category then
    compares the turns a prompt cache serves). A failed turn ends its session."""
    session = next(s for s in prompt_set.load_sessions() if s.id == opening.id)
    history: list[dict[str, str]] = []
    file = session.file
    other = another_prediction(plan.predictions, i)
    for n in range(len(session.turns)):
        user = session.user_turn(n)
        messages = [*history, {"role": "user", "content": user}]
        ids = _conversation_ids(plan.tokenizer, messages, plan.vocab)
        pred = _prediction_ids(plan.tokenizer, file)
        task = Task(ids, i, pred, other, user, file, tuple(history))
        category = "session-t1" if n == 0 else "session-t2+"
        turn = prompt_set.Prompt(f"{session.id}/t{n + 1}", category, user, file)
        sequence = plan.methods if (i + n) % 2 == 0 else plan.methods[::-1]
        runs = _run_methods(plan.runners, sequence, task, i, turn.id, plan.failed)
        if runs is None:
            yield None
            return
        answer = _answer_text(runs["baseline"], plan.tokenizer)
        runs = {
            m: {**r, "agrees_with_reference": _agrees(r, answer, plan)} for m, r in runs.items()
        }
        yield _row(i, turn, ids, sequence, runs, plan.variants)
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        file = prompt_set.edited_file(answer)


def _conversation_ids(tokenizer: Any, messages: list[dict[str, str]], vocab_size: int) -> list[int]:
    """A conversation's ids, as the target's chat template renders it (a tokenizer-less mock
    pair: its texts folded into the vocabulary, as _prompt_ids does)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return prompting.encode_messages(tokenizer, messages)
    return _prompt_ids(tokenizer, "\n".join(m["content"] for m in messages), vocab_size)


def _agrees(run: Mapping[str, Any], reference: str, plan: _Plan) -> bool:
    """Does a method's answer to a turn agree with the reference's as far as both go (one a
    prefix of the other: llama-lookup stops at another length)?"""
    text = _answer_text(run, plan.tokenizer)
    return text.startswith(reference) or reference.startswith(text)


def _answer_text(run: Mapping[str, Any], tokenizer: Any) -> str:
    """The text of a RUN's answer: an endpoint's own, else its tokens decoded."""
    text = run.get("text")
    return text if isinstance(text, str) else prompting.decode(tokenizer, list(run["tokens"]))


def _run_methods(
    runners: Mapping[str, Runner],
    sequence: Sequence[str],
    task: Task,
    i: int,
    prompt_id: str,
    failed: list[dict[str, Any]],
) -> dict[str, Mapping[str, Any]] | None:
    """Every method on one task; None when an endpoint failed (the failure goes to `failed`
    and stderr, and the prompt's other runs are dropped: every row holds every method)."""
    runs = {}
    for m in sequence:
        try:
            runs[m] = runners[m](task)
        except endpoint.EndpointError as e:
            failed.append(
                {"index": i, "prompt_id": prompt_id, "method": m, "kind": e.kind, "error": str(e)}
            )
            print(f"\nprompt {prompt_id}: {m} failed ({e.kind}): {e}", file=sys.stderr)
            return None
    return runs


def _tokenizer(cfg: BenchConfig, draft: SpecModel | None, target: SpecModel | None) -> Any:
    """The target's tokenizer: the loaded model's, else (two endpoints) loaded on its own."""
    for m in (target, draft):
        if m is not None and m.tokenizer is not None:
            return m.tokenizer
    if target is None and draft is None:
        from specdec.backends import load_tokenizer_of

        tokenizer = load_tokenizer_of(cfg.target)
        if tokenizer is None:  # nothing would turn prompts into ids or count tokens
            raise ValueError(
                f"two endpoints need a target with a tokenizer to read their answers with; "
                f"{cfg.target} has none (give a llamacpp: or hf: --target)"
            )
        return tokenizer
    return None


def _row(
    i: int,
    prompt: prompt_set.Prompt,
    ids: list[int],
    sequence: list[str],
    runs: dict[str, Mapping[str, Any]],
    variants: Sequence[str],
) -> BenchRow:
    base_first = sequence.index("baseline") < sequence.index("speculative")
    return BenchRow(
        index=i,
        prompt_id=prompt.id,
        category=prompt.category,
        prompt_tokens=len(ids),
        seed=i,
        order="base-first" if base_first else "spec-first",
        sequence=tuple(sequence),
        baseline=runs["baseline"],
        speculative=runs["speculative"],
        hf_assisted=runs.get("hf_assisted"),
        variants={v: runs[v] for v in variants},
    )


def task_ids(
    tokenizer: Any, prompt: prompt_set.Prompt, vocab_size: int
) -> tuple[list[int], list[int] | None]:
    """(prompt ids, prediction ids or None) of a vendored prompt as every method receives them;
    a replay of a bench artifact rebuilds its tasks with this (study.run.replay)."""
    return _prompt_ids(tokenizer, prompt.text, vocab_size), _prediction_ids(
        tokenizer, prompt.prediction
    )


def _prompt_ids(tokenizer: Any, text: str, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        return prompting.encode(tokenizer, text)
    # Tokenizer-less (mock) pairs: the prompt's UTF-8 bytes folded into the vocabulary. Not a
    # tokenization of anything; just deterministic, prompt-dependent ids for the harness tests.
    return [b % vocab_size for b in text.encode("utf-8")]


def _prediction_ids(tokenizer: Any, text: str | None) -> list[int] | None:
    if text is None or tokenizer is None:
        return None
    return prompting.encode_prediction(tokenizer, text)


def another_prediction(predictions: Sequence[list[int] | None], i: int) -> list[int] | None:
    """The next task's prediction after task i (cyclically), for the wrong-prediction leg (a
    replay rebuilds the leg with it: study.run.replay)."""
    n = len(predictions)
    for j in range(1, n):
        other = predictions[(i + j) % n]
        if other is not None:
            return other
    return None


def _record(result: Any) -> dict[str, Any]:
    """RUN = GenerationStats.to_dict() + tokens + stop_reason (core.metrics defines each field)."""
    return {**result.stats.to_dict(), "tokens": result.tokens, "stop_reason": result.stop_reason}


# ------------------------------------------------------------------------------------- tables
def _bench(art: BenchArtifact | Mapping[str, Any]) -> BenchArtifact:
    return art if isinstance(art, BenchArtifact) else BenchArtifact.from_json(dict(art))


def format_table(artifacts: BenchArtifact | Mapping[str, Any] | Sequence[Any]) -> str:
    """Bench artifacts (read or as run) as a table in the shape of the paper's Table 3 (one line
    per artifact), then each run's extra methods and per-category speedups."""
    many = isinstance(artifacts, Sequence) and not isinstance(artifacts, Mapping)
    arts = [_bench(a) for a in (artifacts if many else [artifacts])]
    header = ["config", "K", "base tok/s", "spec tok/s", "speedup", "accept."]
    header += ["TTFT_b (s)", "TTFT_s (s)", "peak RSS (GB)"]
    rows, notes = [], []
    for a in arts:
        agg = a.aggregates
        b, s = agg.baseline, agg.speculative
        rss = agg.peak_rss_mb
        rows.append(
            [
                a.name + ("" if a.complete else " (partial)"),
                str(a.config["k"]),
                fmt.pm(b.tok_s_mean, b.tok_s_std, plain=True),
                fmt.pm(s.tok_s_mean, s.tok_s_std, plain=True),
                fmt.x(agg.speedup, plain=True),
                fmt.pct(s.acceptance_rate, plain=True),
                fmt.num(b.ttft_s_mean, ".3f", plain=True),
                fmt.num(s.ttft_s_mean, ".3f", plain=True),
                fmt.num(rss / 1024 if rss is not None else None, ".2f", plain=True),
            ]
        )
        notes += _notes(a)
    n = {a.aggregates.baseline.n for a in arts}
    foot = f"mean ± sample std over {'/'.join(map(str, sorted(n)))} recorded prompts; peak RSS is"
    foot += " a process-wide high-water mark (an upper bound)"
    return "\n".join([fmt.text_table(header, rows), *notes, foot])


def _notes(a: BenchArtifact) -> list[str]:
    """format_table's lines under the table for one run: HF-assisted, variants, categories."""
    agg, notes = a.aggregates, []
    h = agg.hf_assisted
    if h is not None:
        notes.append(
            f"{a.name} K={a.config['k']}: transformers assisted generation "
            f"{fmt.pm(h.tok_s_mean, h.tok_s_std, plain=True)} tok/s, "
            f"{fmt.x(agg.speedup_hf_assisted, plain=True)} of baseline, "
            f"acceptance {fmt.pct(h.acceptance_rate, plain=True)}"
        )
    for vname, v in agg.variants.items():
        mal = v.mean_acceptance_length
        notes.append(
            f"{a.name} {vname}: {fmt.pm(v.tok_s_mean, v.tok_s_std, plain=True)} tok/s, "
            f"{fmt.x(v.speedup, plain=True)} of baseline, acceptance "
            f"{fmt.pct(v.acceptance_rate, plain=True)}, "
            f"{fmt.num(v.tokens_per_round, '.2f', plain=True)} tokens/round"
            + ("" if mal is None else f", mean acceptance length {mal:.2f}")
        )
    sessions = format_sessions(a)
    if sessions is not None:
        notes.append(sessions)
    cats = agg.by_category
    if cats:
        methods = list(next(iter(cats.values())))
        crow = [[c, *(fmt.x(cats[c][m].speedup, plain=True) for m in methods)] for c in cats]
        notes.append("speedup by prompt category (vs the same prompts' baseline):")
        notes.append(fmt.text_table(["category", *methods], crow))
    return notes


def _postfix(agg: Aggregates) -> str:
    parts = [f"base {agg.baseline.tok_s_mean:.1f}", f"spec {agg.speculative.tok_s_mean:.1f}"]
    if agg.hf_assisted is not None:
        parts.append(f"hf {agg.hf_assisted.tok_s_mean:.1f}")
    return " | ".join(parts) + f" tok/s ({fmt.x(agg.speedup, plain=True)})"
