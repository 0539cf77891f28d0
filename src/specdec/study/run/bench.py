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
`artifacts.Agg`, whose field comments define each one (means of per-prompt rates, pooled
sums and ratios, the latency split); `aggregate` adds the speedups, the variants and the
per-category means (`Aggregates`).

The run's settings (BenchConfig) and the prompt selection are bench_settings.py's; the methods
themselves (in process, served, endpoints, llama.cpp's tools) are built in methods.py; the
terminal table is present/tables.py.

`--compare hf-assisted` adds transformers' own assisted generation (hf_assisted.py) as a third
method on the same prompts: the outside anchor for our implementation's speed. `sweep.py` runs
this protocol at several K.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.backends import chat as prompting
from specdec.core.model import SpecModel
from specdec.study.artifacts import (
    BenchArtifact,
    BenchRow,
    write_json,
)
from specdec.study.artifacts.provenance import (
    meta_block,
    model_block,
    reset_peak_vram,
)
from specdec.study.artifacts.runs import aggregate
from specdec.study.engines import endpoint
from specdec.study.engines import hf_assisted as hf
from specdec.study.present import tables
from specdec.study.run import methods
from specdec.study.run import prompts as prompt_set
from specdec.study.run.bench_settings import (
    METHODS,
    SESSION,
    BenchConfig,
    select_prompts,
    tag_suffix,
)


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
