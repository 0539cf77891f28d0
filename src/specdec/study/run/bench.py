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
    * clocks are read after a device synchronize (`decode.Clock`); prompt tokens never count as
      generated tokens.

Statistics (artifacts/runs.py): `aggregate_runs` pools one method's rows into an
`artifacts.schema.Agg`, whose field comments define each one (means of per-prompt rates, pooled
sums and ratios, the latency split); `aggregate` adds the speedups, the variants and the
per-category means (`Aggregates`).

The methods themselves (in process, served, endpoints, llama.cpp's tools) are built in
methods.py; the terminal table is present/tables.py.

`--compare hf-assisted` adds transformers' own assisted generation (hf_assisted.py) as a third
method on the same prompts: the outside anchor for our implementation's speed. `sweep.py` runs
this protocol at several K.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specdec.backends import chat as prompting
from specdec.backends import parse_spec
from specdec.backends.configs import CONFIGS as PAIRS
from specdec.core.config import DRAFTERS, SpecConfig, Warp, check_int, is_policy
from specdec.core.model import SpecModel
from specdec.study.artifacts.provenance import (
    meta_block,
    model_block,
    reset_peak_vram,
)
from specdec.study.artifacts.runs import aggregate
from specdec.study.artifacts.schema import (
    MAIN_METHODS,
    BenchArtifact,
    BenchRow,
    write_json,
)
from specdec.study.engines import anchors, endpoint
from specdec.study.engines import hf_assisted as hf
from specdec.study.present import tables
from specdec.study.run import methods
from specdec.study.run import prompts as prompt_set

#: Named (draft, target) pairs, as in the paper's Table 2 but on the models we have; configs.py
#: is the one definition (gate and microbench read it too).
CONFIGS: dict[str, tuple[str, str]] = {n: (c.draft, c.target) for n, c in PAIRS.items()}
CUSTOM = "custom"  # the config name of a --draft/--target pair
#: --compare: transformers' assisted generation, or llama.cpp's own server (engines/anchors.py)
COMPARES = ("hf-assisted", "llama-server")
METHODS = MAIN_METHODS  # in run order; variants follow
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # goes into file names


@dataclass(frozen=True)
class Peers:
    """What runs beside or instead of the in-process methods: a --compare anchor, OpenAI-compatible
    endpoints, llama.cpp's servers, specdec's own servers (--serve). Checks its fields on
    construction; BenchConfig checks them against the models and the prompts."""

    compare: str | None = None  # None, "hf-assisted" or "llama-server" (COMPARES)
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

    def __post_init__(self) -> None:
        for url in (self.endpoint, self.endpoint_baseline):
            if url is not None:
                endpoint.Endpoint(url, api=self.endpoint_api)  # checks the URL and the api
        if self.served and (self.endpoint or self.endpoint_baseline):
            raise ValueError(
                "--serve starts specdec's own servers for the baseline and the speculative "
                "method; drop --endpoint/--endpoint-baseline, or drop --serve"
            )
        if self.compare is not None and self.compare not in COMPARES:
            raise ValueError(f"unknown --compare {self.compare!r}; choose from {COMPARES}")
        if self.compare == "llama-server" and not self.llama_server:
            raise ValueError("--compare llama-server needs at least one llama-server mode")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; every field is a `specdec bench` flag, those of one component grouped
    in its own record: `spec` (the speculative method), `warp` (every method's sampling), `peers`
    (what runs out of process). Each record checks its own fields; this checks them together,
    on construction. `to_json` writes the artifact's flat `config` block, `from_json` reads it."""

    name: str
    draft: str  # model spec, BACKEND:NAME_OR_PATH
    target: str
    # The speculative method: a named drafter (core.config.DRAFTERS) and K (an int >= 1, "auto"
    # or "schedule"), k_max, p_min; the variants reuse its k_max and p_min.
    spec: SpecConfig = field(default_factory=lambda: SpecConfig("model", 4))
    warp: Warp = field(default_factory=Warp)  # temperature, top_k, top_p: every method's
    n_prompts: int = 30
    warmup: int = 2
    max_new_tokens: int = 128
    device: str | None = None  # None: best available (specdec.core.device.get_device)
    deterministic: bool = False  # batch-invariant llama.cpp numerics (backends.load_model)
    # Extra speculative methods run on the same prompts, "DRAFTER:K" each (e.g. "lookup:auto"):
    # one run holds every method of a comparison table, so their ratios are valid.
    variants: tuple[str, ...] = ()
    # Prompt categories to run (prompts.jsonl's "category"); () = every prompt. Applied before
    # n_prompts: the run takes the first n_prompts prompts of these categories, in file order.
    categories: tuple[str, ...] = ()
    peers: Peers = field(default_factory=Peers)

    @property
    def sessions(self) -> bool:
        """A run of multi-turn edit sessions (the "session" category): servers keep their
        prompt cache on (specdec serve --prompt-cache, llama-server cache_prompt), as an
        editor's server does between the turns of a conversation."""
        return SESSION in self.categories

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SAFE_NAME.match(self.name):
            raise ValueError(f"config name {self.name!r} must be letters, digits, '_', '.', '-'")
        backends = (parse_spec(self.draft)[0], parse_spec(self.target)[0])
        if not isinstance(self.spec.drafter, str) or is_policy(self.spec.k):
            raise ValueError(
                f"a bench names its drafter ({', '.join(DRAFTERS)}) and its K (an int, 'auto' "
                f"or 'schedule'), which its artifact records; got {self.spec}"
            )
        for v in self.variants:
            methods.parse_variant(v)
        self._check_prompts()
        peers = self.peers
        if peers.llama_server:
            anchors.check_modes(peers.llama_server, self.target, self.draft, tools=True)
        if self.sessions and (peers.endpoint_api != "chat" or peers.compare == "hf-assisted"):
            raise ValueError(
                f"the {SESSION!r} category is a chat conversation: it needs --endpoint-api chat "
                "and no --compare hf-assisted"
            )
        if peers.compare == "hf-assisted" and backends != ("hf", "hf"):
            raise ValueError(
                "--compare hf-assisted runs transformers' generate(assistant_model=...), so "
                f"both models must use the hf backend; config {self.name!r} pairs draft "
                f"{self.draft} with target {self.target} (use --config all_hf, or "
                "--draft hf:... --target hf:...)"
            )

    def _check_prompts(self) -> None:
        """categories, n_prompts, warmup and max_new_tokens against the prompt set."""
        if isinstance(self.categories, str) or not all(isinstance(c, str) for c in self.categories):
            raise ValueError(f"categories must be a tuple of names, got {self.categories!r}")
        n_available = len(select_prompts(self.categories))  # checks the category names
        what = "prompts"
        if self.categories:
            what = f"prompts (of categories {', '.join(self.categories)})"
        check_int(what, self.n_prompts, 1, n_available)
        check_int("warmup", self.warmup, 0)
        if self.warmup >= self.n_prompts:
            raise ValueError(
                f"warmup ({self.warmup}) must be < prompts ({self.n_prompts}): at least one "
                "prompt has to be recorded"
            )
        check_int("max_new_tokens", self.max_new_tokens, 1)

    def to_json(self) -> dict[str, Any]:
        """The artifact's `config` block: every setting under its flag's name, flat, in
        CONFIG_KEYS' order (tuples stay tuples; write_json makes them lists)."""
        records = {"": self, "spec": self.spec, "warp": self.warp, "peers": self.peers}
        return {key: getattr(records[part], key) for key, part in CONFIG_KEYS}

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> BenchConfig:
        """The BenchConfig a `config` block records, checked as on construction: `to_json`'s
        inverse. A key the block lacks takes its default; "engines" (what the run started, not
        a setting) is passed over; JSON's lists are read back as the tuples they were."""
        home = dict(CONFIG_KEYS)
        unknown = [key for key in config if key not in home and key != "engines"]
        if unknown:
            raise ValueError(f"not a bench setting: {', '.join(unknown)}")
        kw: dict[str, dict[str, Any]] = {part: {} for part in set(home.values())}
        for key, value in config.items():
            if key in home:
                kw[home[key]][key] = tuple(value) if isinstance(value, list) else value
        defaults = _defaults()
        parts = {part: replace(defaults[part], **given) for part, given in kw.items() if part}
        return cls(**kw[""], **parts)


#: The artifact's `config` keys (BenchConfig.to_json) in the order its files have always had,
#: each with the record of a BenchConfig that holds it ("": the config itself). The report
#: (study/present) and the committed results read these names: keep them.
CONFIG_KEYS: tuple[tuple[str, str], ...] = (
    ("name", ""),
    ("draft", ""),
    ("target", ""),
    ("k", "spec"),
    ("temperature", "warp"),
    ("top_k", "warp"),
    ("top_p", "warp"),
    ("n_prompts", ""),
    ("warmup", ""),
    ("max_new_tokens", ""),
    ("compare", "peers"),
    ("device", ""),
    ("drafter", "spec"),
    ("k_max", "spec"),
    ("p_min", "spec"),
    ("deterministic", ""),
    ("variants", ""),
    ("categories", ""),
    ("endpoint", "peers"),
    ("endpoint_baseline", "peers"),
    ("endpoint_model", "peers"),
    ("endpoint_api", "peers"),
    ("llama_server", "peers"),
    ("served", "peers"),
)


def config_defaults() -> dict[str, Any]:
    """The `config` keys that have a default, with it, in CONFIG_KEYS' order: what a run from
    before a flag existed ran with (scripts/migrate_artifacts.py fills them in)."""
    own = _defaults()
    out = {}
    for key, part in CONFIG_KEYS:
        value = getattr(own[part], key) if part else own[key]
        if value is not MISSING:
            out[key] = value
    return out


def _defaults() -> dict[str, Any]:
    """BenchConfig's fields' defaults, its records built; MISSING for name, draft and target."""
    return {
        f.name: f.default if f.default_factory is MISSING else f.default_factory()
        for f in fields(BenchConfig)
    }


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
    drafter = "" if cfg.spec.drafter == "model" else f"_{cfg.spec.drafter}"
    cats = categories_part(cfg)
    k, t = cfg.spec.k, cfg.warp.temperature
    return f"bench_{cfg.name}{drafter}_k{k}_t{t:g}{cats}{tag_suffix(tag)}.json"


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
        with methods.loaded_pair(cfg) as (draft, target), methods.engines(cfg, progress) as engines:
            return _run(cfg, draft, target, path, progress, engines)
    draft, target = models
    if cfg.peers.compare == "hf-assisted" and not all(hf.is_hf(m) for m in models):
        raise ValueError(
            "--compare hf-assisted needs transformers models (hf backend) on both sides"
        )
    with methods.engines(cfg, progress) as engines:
        return _run(cfg, draft, target, path, progress, engines)


def _run(
    cfg: BenchConfig,
    draft: SpecModel | None,
    target: SpecModel | None,
    path: Path,
    progress: bool,
    engines: methods.Engines,
) -> BenchArtifact:
    from tqdm import tqdm

    tokenizer = _tokenizer(cfg, draft, target)
    vocab = target.vocab_size if target is not None else len(tokenizer)
    stops = prompting.stop_ids(tokenizer)
    runners = methods.runners(cfg, draft, target, stops, engines, tokenizer)
    names = list(runners)
    variants = tuple(m for m in names if m not in METHODS)
    reset_peak_vram()
    blocks = {"draft": (cfg.draft, draft), "target": (cfg.target, target)}
    art = BenchArtifact(
        meta=meta_block(),
        config={**cfg.to_json(), "engines": engines.settings},
        models={r: model_block(s, m) if m is not None else None for r, (s, m) in blocks.items()},
        rows=(),
        aggregates=aggregate([], names),
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
        desc=f"bench {cfg.name} K={cfg.spec.k}",
        unit="prompt",
        disable=not progress,
    )

    def snapshot(**kw: Any) -> BenchArtifact:
        update = {"rows": tuple(rows), "aggregates": aggregate(rows, names)}
        return art.model_copy(update={**update, "failed": tuple(failed) or None, **kw})

    plan = _Plan(runners, names, variants, predictions, tokenizer, vocab, failed)
    try:
        for i, prompt in enumerate(bar):
            for row in _prompt_rows(plan, i, prompt):
                if row is not None and i >= cfg.warmup:
                    rows.append(row)
                art = snapshot()
                write_json(path, art)
            bar.set_postfix_str(tables.postfix(art.aggregates) if rows else "warm-up")
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

    runners: dict[str, methods.Runner]
    order: list[str]  # the methods in run order (reversed on odd prompts)
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
    task = methods.Task(ids, i, plan.predictions[i], other, prompt.text, prompt.prediction)
    sequence = plan.order if i % 2 == 0 else plan.order[::-1]
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
        task = methods.Task(ids, i, pred, other, user, file, tuple(history))
        category = "session-t1" if n == 0 else "session-t2+"
        turn = prompt_set.Prompt(f"{session.id}/t{n + 1}", category, user, file)
        sequence = plan.order if (i + n) % 2 == 0 else plan.order[::-1]
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
    runners: Mapping[str, methods.Runner],
    sequence: Sequence[str],
    task: methods.Task,
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
