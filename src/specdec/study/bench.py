"""The throughput benchmark (paper, sections 5 and 6.2): target-only vs speculative decoding on the
same prompts, and the K-sweep.

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

Statistics, as written into `aggregates` (schema.py, specdec.bench/1):
    tok_s_mean, tok_s_std   mean and *sample* standard deviation (ddof = 1; 0.0 for one row) of
                            the per-prompt rates generated / wall_s
    tok_s_pooled            sum generated / sum wall_s (a long prompt weighs more)
    decode_tok_s_pooled     sum generated / sum (wall_s - prefill_s - catchup_s): the decode
                            phase alone, without the prompt prefills that every method pays
                            once; what the microbench's per-round cost model predicts
    acceptance_rate         pooled: sum accepted / sum drafted (None when nothing was drafted)
    positional_acceptance   pooled per draft position: sum accepted_per_pos / sum drafted_per_pos
    tokens_per_round        pooled: sum generated / sum rounds (includes the bonus token)
    ms_per_token            pooled latency split: 1000 * sum <phase>_s / sum generated
    speedup                 speculative tok_s_mean / baseline tok_s_mean; speedup_pooled the
                            same ratio of tok_s_pooled; decode_speedup of decode_tok_s_pooled
    peak_rss_mb             the process's high-water RSS (ru_maxrss): it never decreases within
                            one process, so after earlier runs it is an upper bound for this one
    peak_vram_mb            torch.cuda.max_memory_allocated since this run started; torch
                            allocations only (llama.cpp's own CUDA buffers are invisible to it)

`--compare hf-assisted` adds transformers' own assisted generation (`generate(assistant_model=)`)
as a third method on the same prompts: the outside anchor for our implementation's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specdec.backends import chat as prompting
from specdec.backends import load_model, parse_spec
from specdec.backends.configs import CONFIGS as PAIRS
from specdec.backends.configs import model_record
from specdec.core.config import DRAFTERS, SpecConfig, Warp, check_k
from specdec.core.config import check_int as _check_int
from specdec.core.decode import generate
from specdec.core.model import SpecModel
from specdec.study import prompts as prompt_set
from specdec.study.artifacts import meta_block

#: Named (draft, target) pairs, as in the paper's Table 2 but on the models we have; configs.py
#: is the one definition (gate and microbench read it too).
CONFIGS: dict[str, tuple[str, str]] = {n: (c.draft, c.target) for n, c in PAIRS.items()}
CUSTOM = "custom"  # the config name of a --draft/--target pair
COMPARES = ("hf-assisted",)
METHODS = ("baseline", "speculative", "hf_assisted")
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
    drafter: str = "model"  # model | lookup | composite (drafters.py)
    k_max: int = 8  # the largest K for k="auto" / "schedule"
    p_min: float | None = None  # draft confidence cutoff
    # Extra speculative methods run on the same prompts, "DRAFTER:K" each (e.g. "lookup:auto"):
    # one run holds every method of a comparison table, so their ratios are valid.
    variants: tuple[str, ...] = ()
    # Prompt categories to run (prompts.jsonl's "category"); () = every prompt. Applied before
    # n_prompts: the run takes the first n_prompts prompts of these categories, in file order.
    categories: tuple[str, ...] = ()

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(self.drafter, self.k, self.k_max, self.p_min)

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
        if self.compare is not None:
            if self.compare not in COMPARES:
                raise ValueError(f"unknown --compare {self.compare!r}; choose from {COMPARES}")
            if backends != ("hf", "hf"):
                raise ValueError(
                    "--compare hf-assisted runs transformers' generate(assistant_model=...), so "
                    f"both models must use the hf backend; config {self.name!r} pairs draft "
                    f"{self.draft} with target {self.target} (use --config all_hf, or "
                    "--draft hf:... --target hf:...)"
                )


def prompt_categories() -> tuple[str, ...]:
    """The categories of the vendored prompt set, in order of first appearance."""
    return tuple(dict.fromkeys(p.category for p in prompt_set.load_prompts()))


CATEGORIES = prompt_categories()


def parse_categories(text: str | None) -> tuple[str, ...]:
    """'coding,reasoning' -> ('coding', 'reasoning'); None or '' -> () (every prompt)."""
    if text is None:
        return ()
    return tuple(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))


def select_prompts(
    categories: Sequence[str] = (), limit: int | None = None
) -> list[prompt_set.Prompt]:
    """The first `limit` vendored prompts of `categories` (all when empty), in file order.
    ValueError naming the valid categories for an unknown one."""
    prompts = prompt_set.load_prompts()
    valid = tuple(dict.fromkeys(p.category for p in prompts))
    unknown = [c for c in categories if c not in valid]
    if unknown:
        raise ValueError(
            f"unknown prompt categor{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(map(repr, unknown))}; choose from {', '.join(valid)}"
        )
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    return prompts[:limit] if limit is not None else prompts


def parse_variant(text: str) -> tuple[str, int | str]:
    """'DRAFTER:K' -> (drafter, K), e.g. 'lookup:auto' -> ('lookup', 'auto')."""
    drafter, sep, k = text.partition(":")
    if not sep or drafter not in DRAFTERS:
        raise ValueError(
            f"variant {text!r} must be DRAFTER:K with DRAFTER one of {', '.join(DRAFTERS)} and K "
            "an int >= 1, 'auto' or 'schedule' (e.g. lookup:auto)"
        )
    kk: int | str = int(k) if k.isdigit() else k
    check_k(kk)
    return drafter, kk


def variant_name(drafter: str, k: int | str) -> str:
    return f"{drafter}-k{k}"


def resolve_config(
    name: str | None, draft: str | None = None, target: str | None = None, **settings: Any
) -> BenchConfig:
    """A named pair (`CONFIGS`), or a custom one from `draft` + `target`; `settings` are the
    remaining BenchConfig fields."""
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
    cats = _categories_part(cfg)
    return f"bench_{cfg.name}{drafter}_k{cfg.k}_t{cfg.temperature:g}{cats}{tag_suffix(tag)}.json"


def _categories_part(cfg: BenchConfig) -> str:
    """'_cat-coding-reasoning' for a category-filtered run (so it never replaces the run on the
    whole set); '' otherwise."""
    return "".join(["_cat", *(f"-{c}" for c in cfg.categories)]) if cfg.categories else ""


def tag_suffix(tag: str | None) -> str:
    if tag is None:
        return ""
    if not _SAFE_NAME.match(tag):
        raise ValueError(f"--tag {tag!r} must be letters, digits, '_', '.', '-'")
    return f"_{tag}"


# ------------------------------------------------------------------------------------ running
Runner = Callable[[list[int], int], dict[str, Any]]  # (prompt ids, seed) -> RUN record


def run_bench(
    cfg: BenchConfig,
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    models: tuple[SpecModel, SpecModel] | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """Run the protocol above; write and return the specdec.bench/1 artifact.

    `models` = (draft, target) already loaded (the sweep and tests reuse them; they stay open),
    else both are loaded from `cfg` and closed afterwards. The artifact is rewritten atomically
    after every prompt with `complete: false`; on KeyboardInterrupt the finished rows are kept
    and the interrupt re-raised.
    """
    path = Path(out_dir) / artifact_name(cfg, tag)
    if models is None:
        with loaded_pair(cfg) as (draft, target):
            return _run(cfg, draft, target, path, progress)
    draft, target = models
    if cfg.compare == "hf-assisted" and not all(hasattr(m, "model") for m in models):
        raise ValueError(
            "--compare hf-assisted needs transformers models (hf backend) on both sides"
        )
    return _run(cfg, draft, target, path, progress)


@contextmanager
def loaded_pair(cfg: BenchConfig) -> Iterator[tuple[SpecModel, SpecModel]]:
    """(draft, target) loaded from `cfg`, closed on exit."""
    if cfg.device is not None:
        from specdec.core.device import get_device

        get_device(cfg.device)  # an unavailable device fails before minutes of loading
    draft = load_model(cfg.draft, device=cfg.device)
    try:
        target = load_model(cfg.target, device=cfg.device)
        try:
            yield draft, target
        finally:
            target.close()
    finally:
        draft.close()


def _run(
    cfg: BenchConfig, draft: SpecModel, target: SpecModel, path: Path, progress: bool
) -> dict[str, Any]:
    from tqdm import tqdm

    tokenizer = target.tokenizer if target.tokenizer is not None else draft.tokenizer
    stops = prompting.stop_ids(tokenizer)
    sampling = dict(max_new_tokens=cfg.max_new_tokens, warp=cfg.warp, stop_ids=stops)

    def speculative(drafter: str, k: int | str) -> Runner:
        d = None if drafter == "lookup" else draft  # prompt lookup needs no draft model
        return lambda ids, seed: _record(
            generate(
                target,
                ids,
                draft=d,
                spec=SpecConfig(drafter, k, cfg.k_max, cfg.p_min),
                seed=seed,
                **sampling,
            )
        )

    runners: dict[str, Runner] = {
        "baseline": lambda ids, seed: _record(generate(target, ids, seed=seed, **sampling)),
        "speculative": speculative(cfg.drafter, cfg.k),
    }
    if cfg.compare == "hf-assisted":
        runners["hf_assisted"] = lambda ids, seed: _hf_assisted(
            draft, target, ids, cfg, seed, stops
        )
    variants = {variant_name(*parse_variant(v)): parse_variant(v) for v in cfg.variants}
    for vname, (drafter, k) in variants.items():
        runners[vname] = speculative(drafter, k)
    methods = [m for m in METHODS if m in runners] + list(variants)

    _reset_peak_vram()
    artifact: dict[str, Any] = {
        "schema": "specdec.bench/1",
        "meta": meta_block(),
        "config": asdict(cfg),
        "models": {
            "draft": model_block(cfg.draft, draft),
            "target": model_block(cfg.target, target),
        },
        "rows": [],
        "aggregates": aggregate(cfg.k, [], methods),
        "variants": list(variants),
        "complete": False,
    }
    rows: list[dict[str, Any]] = artifact["rows"]
    bar = tqdm(
        select_prompts(cfg.categories, cfg.n_prompts),
        desc=f"bench {cfg.name} K={cfg.k}",
        unit="prompt",
        disable=not progress,
    )
    try:
        for i, prompt in enumerate(bar):
            ids = _prompt_ids(tokenizer, prompt.text, target.vocab_size)
            sequence = list(methods) if i % 2 == 0 else methods[::-1]
            runs = {m: runners[m](ids, i) for m in sequence}
            if i >= cfg.warmup:
                base_first = sequence.index("baseline") < sequence.index("speculative")
                rows.append(
                    {
                        "index": i,
                        "prompt_id": prompt.id,
                        "category": prompt.category,
                        "prompt_tokens": len(ids),
                        "seed": i,
                        "order": "base-first" if base_first else "spec-first",
                        "sequence": sequence,
                        **{m: runs[m] for m in methods if m not in variants},
                        "variants": {v: runs[v] for v in variants},
                    }
                )
            artifact["aggregates"] = aggregate(cfg.k, rows, methods)
            write_json(path, artifact)
            bar.set_postfix_str(_postfix(artifact["aggregates"]) if rows else "warm-up")
    except KeyboardInterrupt:
        artifact["aggregates"] = aggregate(cfg.k, rows, methods)
        write_json(path, artifact)
        print(f"\ninterrupted: {len(rows)} finished rows kept in {path}", file=sys.stderr)
        raise
    finally:
        bar.close()
    artifact["complete"] = True
    write_json(path, artifact)
    artifact["path"] = str(path)  # for the caller only; not part of the file
    return artifact


def _prompt_ids(tokenizer: Any, text: str, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        return prompting.encode(tokenizer, text)
    # Tokenizer-less (mock) pairs: the prompt's UTF-8 bytes folded into the vocabulary. Not a
    # tokenization of anything; just deterministic, prompt-dependent ids for the harness tests.
    return [b % vocab_size for b in text.encode("utf-8")]


def _record(result: Any) -> dict[str, Any]:
    """RUN = GenerationStats.to_dict() + tokens + stop_reason (decode.py defines each field)."""
    return {**result.stats.to_dict(), "tokens": result.tokens, "stop_reason": result.stop_reason}


# ------------------------------------------------------------------- transformers' assisted
@contextmanager
def _overrides(obj: Any, **values: Any) -> Iterator[None]:
    saved = {k: getattr(obj, k, None) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def _hf_assisted(
    draft: Any, target: Any, ids: list[int], cfg: BenchConfig, seed: int, stops: list[int]
) -> dict[str, Any]:
    """transformers' `generate(assistant_model=...)` on one prompt, timed like our runs.

    transformers 5.x reads the speculation length from the *assistant's* generation_config (a
    `num_assistant_tokens` passed to `generate` lands in the target's config and is ignored), and
    by default also stops drafting early when the draft's confidence drops below 0.4
    (`assistant_confidence_threshold`). Both are pinned on the assistant for the call — constant
    K, no early stop — so the comparison is at the same K as ours. transformers samples from the
    global torch RNG, so `seed` seeds that.

    Rounds and drafted tokens are counted with forward hooks: each target forward is one round
    (the first also holds the prefill) and each draft forward drafts one token. accepted =
    generated - rounds, since every round commits its matches plus one target token.
    """
    import torch

    from specdec.core.device import synchronize

    hf_target, hf_draft = target.model, draft.model
    devices = {target.device, draft.device}
    input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)  # [1, n]
    pad = getattr(target.tokenizer, "pad_token_id", None)
    kwargs: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "attention_mask": torch.ones_like(input_ids),
        "eos_token_id": stops or None,
        "pad_token_id": pad if pad is not None else (stops[0] if stops else None),
    }
    if cfg.temperature > 0:
        # top_k 0 / top_p 1.0 switch those warpers off explicitly (transformers' default top_k is
        # 50, which our engine would not apply).
        kwargs.update(
            do_sample=True,
            temperature=float(cfg.temperature),
            top_k=cfg.top_k or 0,
            top_p=cfg.top_p or 1.0,
        )
    else:
        kwargs.update(do_sample=False)
    calls = {"target": 0, "draft": 0}

    def counter(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[key] += 1

        return hook

    hooks = [
        hf_target.register_forward_hook(counter("target")),
        hf_draft.register_forward_hook(counter("draft")),
    ]
    assistant = {
        "num_assistant_tokens": cfg.k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    try:
        torch.manual_seed(seed)
        with _overrides(hf_draft.generation_config, **assistant):
            for d in devices:
                synchronize(d)
            t0 = time.perf_counter()
            out = hf_target.generate(input_ids, assistant_model=hf_draft, **kwargs)
            for d in devices:
                synchronize(d)
            wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    tokens = [int(t) for t in out[0, len(ids) :].tolist()]
    n, rounds, drafted = len(tokens), calls["target"], calls["draft"]
    return {
        "tokens": tokens,
        "stop_reason": "stop" if tokens and tokens[-1] in stops else "length",
        "prompt_tokens": len(ids),
        "generated": n,
        "wall_s": wall,
        "tokens_per_s": n / wall if wall > 0 else 0.0,
        "ttft_s": None,  # generate() gives no hook at the first committed token
        "rounds": rounds,
        "drafted": drafted,
        "accepted": n - rounds,
        "acceptance_rate": (n - rounds) / drafted if drafted else None,
        "tokens_per_round": n / rounds if rounds else None,
    }


# -------------------------------------------------------------------------------- statistics
def _run_of(row: dict[str, Any], method: str) -> dict[str, Any]:
    return row[method] if method in row else row["variants"][method]


def aggregate(k: int | str, rows: list[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    """The `aggregates` block for these rows (definitions in the module docstring)."""
    core = [m for m in methods if m in METHODS]
    extra = [m for m in methods if m not in METHODS]
    aggs = {m: aggregate_runs([_run_of(r, m) for r in rows]) for m in core}
    base, spec = aggs["baseline"], aggs["speculative"]
    out: dict[str, Any] = dict(aggs)
    out["variants"] = {}
    for m in extra:
        agg = aggregate_runs([_run_of(r, m) for r in rows])
        agg["speedup"] = _ratio(agg["tok_s_mean"], base["tok_s_mean"])
        agg["decode_speedup"] = _ratio(agg["decode_tok_s_pooled"], base["decode_tok_s_pooled"])
        out["variants"][m] = agg
    out["by_category"] = _by_category(rows, methods)
    out["speedup"] = _ratio(spec["tok_s_mean"], base["tok_s_mean"])
    out["speedup_pooled"] = _ratio(spec["tok_s_pooled"], base["tok_s_pooled"])
    out["decode_speedup"] = _ratio(spec["decode_tok_s_pooled"], base["decode_tok_s_pooled"])
    if "hf_assisted" in aggs:
        out["speedup_hf_assisted"] = _ratio(aggs["hf_assisted"]["tok_s_mean"], base["tok_s_mean"])
    out["peak_rss_mb"] = peak_rss_mb()
    out["peak_vram_mb"] = peak_vram_mb()
    return out


def _by_category(rows: list[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    """{category: {method: {n, tok_s_mean, speedup}}}: speedup against the same prompts'
    baseline mean."""
    out: dict[str, Any] = {}
    for cat in sorted({r["category"] for r in rows}):
        sel = [r for r in rows if r["category"] == cat]
        base = statistics.fmean(r["baseline"]["tokens_per_s"] for r in sel)
        out[cat] = {}
        for m in methods:
            mean = statistics.fmean(_run_of(r, m)["tokens_per_s"] for r in sel)
            out[cat][m] = {"n": len(sel), "tok_s_mean": mean, "speedup": _ratio(mean, base)}
    return out


def aggregate_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """AGG for one method's RUN records; sums that a record kind lacks come out None."""

    def total(key: str) -> Any:
        if not runs or any(r.get(key) is None for r in runs):
            return None
        return sum(r[key] for r in runs)

    rates = [r["tokens_per_s"] for r in runs]
    generated, wall = total("generated"), total("wall_s")
    rounds, drafted, accepted = total("rounds"), total("drafted"), total("accepted")
    ttfts = [r["ttft_s"] for r in runs if r.get("ttft_s") is not None]
    positional = None
    if runs and all("drafted_per_pos" in r for r in runs):
        width = max(len(r["drafted_per_pos"]) for r in runs)  # K; shorter only near the budget
        dr = [sum(_at(r["drafted_per_pos"], i) for r in runs) for i in range(width)]
        ac = [sum(_at(r["accepted_per_pos"], i) for r in runs) for i in range(width)]
        positional = [a / d for a, d in zip(ac, dr, strict=True)]
    decode_s = None  # artifacts written before prefill_s existed have no decode phase
    if runs and all("prefill_s" in r for r in runs):
        decode_s = sum(r["wall_s"] - r["prefill_s"] - r.get("catchup_s", 0.0) for r in runs)
    ms = None
    if runs and generated and all("draft_s" in r for r in runs):
        ms = {
            ph: 1000 * sum(r[f"{ph}_s"] for r in runs) / generated
            for ph in ("draft", "verify", "sampling", "other")
        }
    return {
        "n": len(runs),
        "tok_s_mean": statistics.fmean(rates) if rates else None,
        "tok_s_std": statistics.stdev(rates) if len(rates) > 1 else (0.0 if rates else None),
        "tok_s_pooled": _ratio(generated, wall),
        "decode_tok_s_pooled": _ratio(generated, decode_s),
        "ttft_s_mean": statistics.fmean(ttfts) if ttfts else None,
        "generated": generated,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": _ratio(accepted, drafted),
        "positional_acceptance": positional,
        "tokens_per_round": _ratio(generated, rounds),
        "ms_per_token": ms,
    }


def _at(xs: list[int], i: int) -> int:
    return xs[i] if i < len(xs) else 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def peak_rss_mb() -> float | None:
    """Process-wide high-water RSS in MiB (never decreases: an upper bound per run)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB else


def peak_vram_mb() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def _reset_peak_vram() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- artifact I/O
def model_block(spec: str, model: SpecModel) -> dict[str, Any]:
    """configs.model_record, plus a hash of local (non-registry) model files and the HF dtype."""
    block = model_record(spec, model)
    backend, rest = parse_spec(spec)
    if block["sha256"] is None and backend != "mock":
        block["sha256"] = _sha256_path(Path(rest).expanduser())
    hf = getattr(model, "model", None)
    # llama.cpp computes in the file's own quantization: no dtype to report.
    block["dtype"] = str(next(hf.parameters()).dtype).removeprefix("torch.") if hf else None
    return block


def _sha256_path(path: Path) -> str | None:
    """A file's sha256; for a model directory, one digest over its files in sorted path order."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def write_json(path: str | os.PathLike[str], obj: dict[str, Any]) -> None:
    """Write atomically (temp file + os.replace): a reader, or a Ctrl-C, never sees half a file.

    Indented for diffs, but lists of numbers (token ids, per-position counts) stay on one line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v for k, v in obj.items() if k != "path"}, indent=1, allow_nan=False)
    text = _NUMBER_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------- sweep
def run_sweep(
    cfg: BenchConfig,
    ks: Sequence[int],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    models: tuple[SpecModel, SpecModel] | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """`run_bench` at every K in `ks` (cfg.k is ignored), the models loaded once; each K gets its
    own interleaved baseline, because the paper normalizes every K by its own. Writes the per-K
    artifacts and sweep_<config>_t<T>[_<tag>].json (specdec.sweep/1), the latter after every K."""
    ks = list(dict.fromkeys(ks))
    if not ks:
        raise ValueError("the sweep needs at least one K")
    for k in ks:
        _check_int("every K of the sweep", k, 1)
    configs = [replace(cfg, k=k) for k in ks]
    name = f"sweep_{cfg.name}_t{cfg.temperature:g}{_categories_part(cfg)}{tag_suffix(tag)}.json"
    path = Path(out_dir) / name
    if models is None:
        with loaded_pair(cfg) as pair:
            return run_sweep(cfg, ks, out_dir, progress, pair, tag)
    summary: dict[str, Any] = {
        "schema": "specdec.sweep/1",
        "meta": meta_block(),
        "config": {k: v for k, v in asdict(cfg).items() if k != "k"},
        "ks": ks,
        "points": [],
        "complete": False,
    }
    for c in configs:
        try:
            art = run_bench(c, out_dir, progress, models, tag)
        except KeyboardInterrupt:
            write_json(path, summary)
            raise
        agg = art["aggregates"]
        base, spec = agg["baseline"], agg["speculative"]
        summary["points"].append(
            {
                "k": c.k,
                "artifact": Path(art["path"]).name,
                "baseline_tok_s": base["tok_s_mean"],
                "baseline_tok_s_std": base["tok_s_std"],
                "speculative_tok_s": spec["tok_s_mean"],
                "speculative_tok_s_std": spec["tok_s_std"],
                "speedup": agg["speedup"],
                "speedup_pooled": agg["speedup_pooled"],
                "acceptance_rate": spec["acceptance_rate"],
                "tokens_per_round": spec["tokens_per_round"],
                "positional_acceptance": spec["positional_acceptance"],
            }
        )
        write_json(path, summary)
    summary["complete"] = True
    write_json(path, summary)
    summary["path"] = str(path)
    return summary


# ------------------------------------------------------------------------------------- tables
def _pm(mean: float | None, std: float | None) -> str:
    return "-" if mean is None else f"{mean:.2f} ± {std or 0:.2f}"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def format_table(artifacts: dict[str, Any] | Sequence[dict[str, Any]]) -> str:
    """Bench artifacts as a table in the shape of the paper's Table 3 (one line per artifact)."""
    arts = [artifacts] if isinstance(artifacts, dict) else list(artifacts)
    header = [
        "config",
        "K",
        "base tok/s",
        "spec tok/s",
        "speedup",
        "accept.",
        "TTFT_b (s)",
        "TTFT_s (s)",
        "peak RSS (GB)",
    ]
    rows, notes = [], []
    for a in arts:
        agg, cfg = a["aggregates"], a["config"]
        b, s = agg["baseline"], agg["speculative"]
        rss = agg.get("peak_rss_mb")
        rows.append(
            [
                cfg["name"] + ("" if a.get("complete", True) else " (partial)"),
                str(cfg["k"]),
                _pm(b["tok_s_mean"], b["tok_s_std"]),
                _pm(s["tok_s_mean"], s["tok_s_std"]),
                _fmt(agg["speedup"], ".2f", "x"),
                _fmt(s["acceptance_rate"], ".1%"),
                _fmt(b["ttft_s_mean"], ".3f"),
                _fmt(s["ttft_s_mean"], ".3f"),
                _fmt(rss / 1024 if rss is not None else None, ".2f"),
            ]
        )
        h = agg.get("hf_assisted")
        if h is not None:
            notes.append(
                f"{cfg['name']} K={cfg['k']}: transformers assisted generation "
                f"{_pm(h['tok_s_mean'], h['tok_s_std'])} tok/s, "
                f"{_fmt(agg.get('speedup_hf_assisted'), '.2f', 'x')} of baseline, "
                f"acceptance {_fmt(h['acceptance_rate'], '.1%')}"
            )
        for vname, v in agg.get("variants", {}).items():
            notes.append(
                f"{cfg['name']} {vname}: {_pm(v['tok_s_mean'], v['tok_s_std'])} tok/s, "
                f"{_fmt(v.get('speedup'), '.2f', 'x')} of baseline, acceptance "
                f"{_fmt(v['acceptance_rate'], '.1%')}, "
                f"{_fmt(v['tokens_per_round'], '.2f')} tokens/round"
            )
        cats = agg.get("by_category") or {}
        if cats:
            methods = list(next(iter(cats.values())))
            crow = [[c, *(_fmt(cats[c][m]["speedup"], ".2f", "x") for m in methods)] for c in cats]
            notes.append("speedup by prompt category (vs the same prompts' baseline):")
            notes.append(_table(["category", *methods], crow))
    n = {a["aggregates"]["baseline"]["n"] for a in arts}
    foot = f"mean ± sample std over {'/'.join(map(str, sorted(n)))} recorded prompts; peak RSS is"
    foot += " a process-wide high-water mark (an upper bound)"
    return "\n".join([_table(header, rows), *notes, foot])


def format_sweep_table(summary: dict[str, Any]) -> str:
    """A sweep summary in the shape of the paper's Table 4."""
    rows = [
        [
            str(p["k"]),
            _pm(p["speculative_tok_s"], p.get("speculative_tok_s_std")),
            _pm(p["baseline_tok_s"], p.get("baseline_tok_s_std")),
            _fmt(p["acceptance_rate"], ".1%"),
            _fmt(p["speedup"], ".2f", "x"),
        ]
        for p in summary["points"]
    ]
    return _table(["K", "spec tok/s", "base tok/s", "acceptance", "speedup"], rows)


def _postfix(agg: dict[str, Any]) -> str:
    parts = [
        f"base {agg['baseline']['tok_s_mean']:.1f}",
        f"spec {agg['speculative']['tok_s_mean']:.1f}",
    ]
    if "hf_assisted" in agg:
        parts.append(f"hf {agg['hf_assisted']['tok_s_mean']:.1f}")
    return " | ".join(parts) + f" tok/s ({_fmt(agg['speedup'], '.2f', 'x')})"


# ---------------------------------------------------------------------------------------- CLI
