"""Replays: core.decode's own loop, drafters and K policies over recorded greedy outputs, with
a measured verify curve for the cost side (`specdec replay`).

A greedy output is what the target produces after its prompt, whatever drafted for it (the loop
is lossless, and greedy decoding is deterministic where the backend is batch-invariant), so a
replay runs `generate.stream` with a target that answers from the record instead of computing
(backends.replay.ReplayTarget) and a clock whose seconds are modelled (ModelledClock):

    draft    the drafter generate.make_drafter builds for a live run proposes from the committed
             context; K comes from the same K policy objects a generation runs
    verify   the replay target's rows are one-hot on the recorded tokens, so greedy_verify
             accepts a draft while it equals the recorded output at its position; the round
             emits the accepted drafts and the output's next token, cut at the budget or stop
    cost     the round costs v(k + 1) target steps of the verify curve (a microbench artifact)
             plus k * c for drafting, charged to the clock; the policy observes them as the
             round's verify_s and draft_s, as k=auto observes a real pass

Decode-phase speedup = generated tokens / steps (target-only decoding costs v(1) = 1 step per
token); the prompt prefill is left out, as in the bench's decode phase. No wall clock is read
for the numbers, so a replay gives the same table on any machine, loaded or not.

Limits, stated: past a stop token the recorded output says nothing, so drafts reaching beyond it
count as rejected there (the real run may have accepted tokens past the stop that its commit then
cut); an output that neither stopped nor filled its max_new_tokens is replayed as if its length
were the budget; costs the curve lacks (the loop's bookkeeping, ~0.1 ms a token; the drafter's
own time unless `c` is given) are not charged.

Policies, by name (replay_loop.make_replay_policy):
    oracle       told this round's accept length a (the replay peeks at the recorded output):
                 drafts the k <= a with the most tokens per step for the round, or 0
    oracle-plan  knows every position's accept length (a drafter following the output token by
                 token) and takes the plan of least total cost (dynamic programming)
    auto         CostModelK with the curve in its cost store, as after `specdec microbench`
    schedule     transformers' +2/-1
    N            fixed K = N;  best-fixed: each of FIXED_KS, the best in hindsight reported
    NAME         a policy of core.policy.POLICIES (variants of k=auto, for comparisons)
    module:attr  any callable (k_max) -> KPolicy
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdec.core.metrics import Round
from specdec.core.policy import CostModelK, KPolicy, make_policy
from specdec.study.artifacts import (
    BenchArtifact,
    BenchRow,
    MicrobenchArtifact,
    ReplayArtifact,
    ReplayConfig,
    ReplayPolicy,
    ReplayTask,
    ReplayTaskRun,
    read,
)
from specdec.study.artifacts.provenance import meta_block
from specdec.study.artifacts.runs import read_round_log
from specdec.study.run.replay_loop import (
    REPLAY_DRAFTERS,
    Curve,
    Hint,
    Recorded,
    ReplayRun,
    curve_costs,
    make_replay_policy,
    recorded_costs,
    run_task,
)

SCHEMA = ReplayArtifact.SCHEMA
#: best-fixed: the fixed K tried (b = K + 1 at and below the curve's steps: 16, 32, 64 rows)
FIXED_KS = (1, 2, 3, 4, 6, 8, 12, 15, 16, 24, 31, 32, 48, 63, 64)


# ------------------------------------------------------------------------------ inputs
def load_curve(path: str | Path) -> Curve:
    """The verify curve of a microbench artifact (its `ratio` per b and its one-step time)."""
    path = Path(path)
    art = read(json.loads(path.read_text()), str(path), path)
    if not isinstance(art, MicrobenchArtifact):
        raise ValueError(f"{path}: not a microbench artifact (give `specdec microbench`'s JSON)")
    if not art.verify or art.verify[0].b != 1:
        raise ValueError(f"{path}: its verify curve does not start at b = 1")
    return Curve({p.b: p.ratio for p in art.verify}, art.target_step_ms / 1e3, str(path))


def from_bench(path: str | Path, method: str = "baseline", tokenizer: Any = None) -> list[Recorded]:
    """The recorded rows of a bench artifact: `method`'s output per row (target-only's by
    default: a T = 0 bench's greedy output), the prompt and prediction rebuilt from the vendored
    prompt set with the target's tokenizer (checked against the row's prompt_tokens), and that
    method's round log when it has one. `tokenizer`: the target's, if already loaded."""
    from specdec.study.run import bench, bench_settings

    path = Path(path)
    art = read(json.loads(path.read_text()), str(path), path)
    if not isinstance(art, BenchArtifact):
        raise ValueError(f"{path}: not a bench artifact")
    if bench_settings.SESSION in (art.config.get("categories") or ()):
        raise ValueError(
            f"{path}: a session run (its turns' prompts are conversations built from earlier "
            "answers); replay single-turn bench artifacts, or write the turns as JSONL"
        )
    if art.temperature not in (0, 0.0):
        raise ValueError(
            f"{path}: T = {art.temperature}; a replay needs greedy (T = 0) outputs, whose every "
            "token the target chose by argmax"
        )
    tokenizer, vocab = _tokenizer(art.target_spec, tokenizer)
    prompts = bench_settings.select_prompts(tuple(art.config.get("categories") or ()))
    drafter, k = _method_setting(art, method)
    preds = [bench.task_ids(tokenizer, p, vocab)[1] for p in prompts[: art.config["n_prompts"]]]
    out = []
    for row in art.rows:
        if row.index is None or not 0 <= row.index < len(prompts):
            raise ValueError(f"{path}: row {row.prompt_id} has no usable prompt index")
        prompt = prompts[row.index]
        if prompt.id != row.prompt_id:
            raise ValueError(f"{path}: row {row.index} is {row.prompt_id}, the set has {prompt.id}")
        ids, pred = bench.task_ids(tokenizer, prompt, vocab)
        if len(ids) != row.prompt_tokens:
            raise ValueError(
                f"{path}: {row.prompt_id} has {len(ids)} prompt tokens here, the artifact "
                f"{row.prompt_tokens}: another tokenizer or prompt set than the run's"
            )
        run = _run_of(row, method, path)
        log = run.get("round_log")
        out.append(
            Recorded(
                id=row.prompt_id,
                prompt=tuple(ids),
                output=tuple(run["tokens"]),
                prediction=None if pred is None else tuple(pred),
                other_prediction=_tuple(bench.another_prediction(preds, row.index)),
                hints=_hints(tokenizer, prompt.text),
                stopped=run.get("stop_reason") == "stop",
                max_new_tokens=art.max_new_tokens or len(run["tokens"]),
                rounds=None if log is None else read_round_log(log, str(path)),
                drafter=drafter,
                k=k,
            )
        )
    return out


def _hints(tokenizer: Any, text: str) -> tuple[Hint, ...]:
    """The instruction's named rewrites as the prediction tokenizes them (none without a
    tokenizer)."""
    from specdec.backends import chat

    return tuple(chat.prediction_hints(tokenizer, text))


def _run_of(row: BenchRow, method: str, path: Path) -> Mapping[str, Any]:
    try:
        run = row.run(method)
    except KeyError:
        have = ["baseline", "speculative", *row.variants]
        raise ValueError(f"{path}: no method {method!r}; it has {', '.join(have)}") from None
    if not run or "tokens" not in run:
        raise ValueError(f"{path}: {row.prompt_id}'s {method} run recorded no tokens")
    return run


def _method_setting(art: BenchArtifact, method: str) -> tuple[str | None, Any]:
    """(drafter, K) of a bench method: the config's for "speculative", the variant's own."""
    if method == "speculative":
        return art.drafter, art.k
    drafter, sep, k = method.rpartition("-k")
    if sep and drafter in REPLAY_DRAFTERS:
        return drafter, int(k) if k.isdigit() else k
    return None, None


def _tokenizer(model_spec: str, given: Any) -> tuple[Any, int]:
    """(the target's tokenizer, vocab size) without its weights; (None, V) for a mock target."""
    from specdec.backends import load_model, load_tokenizer_of, parse_spec

    if parse_spec(model_spec)[0] == "mock":
        model = load_model(model_spec)  # a mock is its vocabulary size: nothing to load
        return None, model.vocab_size
    tok = given if given is not None else load_tokenizer_of(model_spec)
    return tok, len(tok)


def from_jsonl(path: str | Path, tokenizer: Any) -> list[Recorded]:
    """Recorded generations from a JSONL file, one object per line: `id`, `prompt` (text, put
    in the chat template) or `prompt_ids`, `output` (text) or `output_ids`, optional
    `prediction` / `prediction_ids`, `stopped` (false), `max_new_tokens` (the output's
    length) and `hint_ids` ([[old ids], [new ids]] pairs: the rewrites the instruction names).
    Text needs `tokenizer` (the target's)."""
    from specdec.backends import chat
    from specdec.study.run.bench import another_prediction as bench_another

    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            r = json.loads(line)
            prompt = _ids(r, "prompt", lambda t: chat.encode(tokenizer, t), where)
            output = _ids(r, "output", lambda t: chat.encode_prediction(tokenizer, t), where)
            pred = None
            if "prediction" in r or "prediction_ids" in r:
                pred = _ids(r, "prediction", lambda t: chat.encode_prediction(tokenizer, t), where)
            rec = Recorded(
                id=str(r.get("id", n)),
                prompt=tuple(prompt),
                output=tuple(output),
                prediction=None if pred is None else tuple(pred),
                stopped=bool(r.get("stopped", False)),
                max_new_tokens=int(r.get("max_new_tokens", len(output))),
                hints=tuple((tuple(o), tuple(h)) for o, h in r.get("hint_ids", ())),
            )
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: not a replay record ({e})") from None
        if rec.max_new_tokens < len(rec.output) or not rec.prompt or not rec.output:
            raise ValueError(
                f"{where}: needs a prompt, an output, and max_new_tokens >= its length"
            )
        out.append(rec)
    # the wrong-prediction leg drafts from the next record's prediction, as bench's does
    preds = [list(r.prediction) if r.prediction is not None else None for r in out]
    others = [_tuple(bench_another(preds, i)) for i in range(len(out))]
    return [replace(r, other_prediction=o) for r, o in zip(out, others, strict=True)]


def _tuple(ids: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if ids is None else tuple(ids)


def _ids(r: Mapping[str, Any], key: str, encode: Callable[[str], list[int]], where: str) -> list:
    if f"{key}_ids" in r:
        ids = r[f"{key}_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: {key}_ids must be a list of token ids")
        return ids
    if not isinstance(r.get(key), str):
        raise ValueError(f"{where}: give `{key}` (text) or `{key}_ids`")
    try:
        return encode(r[key])
    except ValueError as e:  # no tokenizer: say which flag gives one
        raise ValueError(f"{where}: {e}; pass --target SPEC to tokenize text") from None


def record(
    target: Any,
    prompts: Sequence[Any],
    max_new_tokens: int,
    path: str | Path,
    drafter: str | None = "prediction",
    progress: bool = True,
) -> list[Recorded]:
    """Greedy outputs of `target` for vendored prompts, written to `path` as replay JSONL (ids
    only, so reading it back needs no tokenizer). `drafter` "prediction" (the prompt's
    prediction at k=auto, then lookup) makes recording faster; its greedy output is
    target-only's where the backend is batch-invariant (mock; llama.cpp on files whose weights
    specdec's kernels or ggml's per-row kernels multiply: docs/exactness.md); None decodes
    target-only."""
    import sys

    from specdec.backends import chat
    from specdec.backends.costs import CurveFiles
    from specdec.core.config import SpecConfig, Warp, runs_as
    from specdec.core.generate import generate
    from specdec.core.metrics import StopReason
    from specdec.core.policy import AutoPolicies
    from specdec.study.run import bench

    stops = chat.stop_ids(target.tokenizer)
    policies = AutoPolicies(CurveFiles())  # k=auto carries over from prompt to prompt
    out, lines = [], []
    for i, prompt in enumerate(prompts):
        ids, pred = bench.task_ids(target.tokenizer, prompt, target.vocab_size)
        kw: dict[str, Any] = {}
        if drafter is not None:
            spec = SpecConfig(runs_as(drafter, has_prediction=pred is not None), "auto")
            kw = {"spec": spec, **({"prediction": pred} if pred is not None else {})}
        res = generate(
            target,
            ids,
            warp=Warp(0.0),
            max_new_tokens=max_new_tokens,
            stop_ids=stops,
            policies=policies,
            **kw,
        )
        rec = Recorded(
            prompt.id,
            tuple(ids),
            tuple(res.tokens),
            _tuple(pred),
            res.stop_reason == StopReason.STOP,
            max_new_tokens,
            hints=_hints(target.tokenizer, prompt.text),
        )
        out.append(rec)
        lines.append(json.dumps(_jsonl_record(rec, target.name, drafter)))
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")  # after every prompt
        if progress:
            print(f"{i + 1}/{len(prompts)} {prompt.id}: {len(res.tokens)} tokens", file=sys.stderr)
    return out


def _jsonl_record(rec: Recorded, target: str, drafter: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": rec.id, "target": target, "recorded_with": drafter or "target-only"}
    d.update(prompt_ids=list(rec.prompt), output_ids=list(rec.output))
    if rec.prediction is not None:
        d["prediction_ids"] = list(rec.prediction)
    d.update(stopped=rec.stopped, max_new_tokens=rec.max_new_tokens)
    if rec.hints:
        d["hint_ids"] = [[list(o), list(n)] for o, n in rec.hints]
    return d


# ------------------------------------------------------------------------------ policies
@dataclass
class PolicyResult:
    """One policy over every task (the policy object kept across tasks, as one process)."""

    name: str
    runs: list[ReplayRun]

    @property
    def speedup(self) -> float:
        """Pooled decode-phase speedup: all tokens / all steps (the bench's decode_speedup)."""
        steps = sum(r.steps for r in self.runs)
        return sum(r.stats.generated for r in self.runs) / steps if steps else 0.0

    @property
    def geomean(self) -> float:
        return math.exp(sum(math.log(r.speedup) for r in self.runs) / len(self.runs))

    def total(self, what: str) -> int:
        return sum(getattr(r.stats, what) for r in self.runs)


def replay(
    tasks: Sequence[Recorded],
    drafter: str,
    policy: str,
    curve: Curve,
    k_max: int = 64,
    c: float = 0.0,
    fresh: bool = False,
) -> PolicyResult:
    """Every task under one policy, in order; `fresh`: a new policy object per task (else one
    kept across tasks, as a process keeps k=auto's estimates between requests)."""
    pol = make_replay_policy(policy, curve, k_max, c)
    runs = []
    for t in tasks:
        if fresh:
            pol = make_replay_policy(policy, curve, k_max, c)
        runs.append(run_task(t, drafter, pol, curve_costs(curve, c), curve, c))
    return PolicyResult(policy, runs)


def best_fixed(
    tasks: Sequence[Recorded], drafter: str, curve: Curve, k_max: int = 64, c: float = 0.0
) -> PolicyResult:
    """The fixed K of FIXED_KS (up to k_max) with the best pooled speedup, in hindsight."""
    results = [replay(tasks, drafter, str(k), curve, k_max, c) for k in FIXED_KS if k <= k_max]
    best = max(results, key=lambda r: r.speedup)
    return PolicyResult(f"best fixed (K = {best.name})", best.runs)


def run_policies(
    tasks: Sequence[Recorded],
    drafter: str,
    policies: Iterable[str],
    curve: Curve,
    k_max: int = 64,
    c: float = 0.0,
    fresh: bool = False,
) -> list[PolicyResult]:
    """Each named policy ("best-fixed" expands to the best of FIXED_KS)."""
    out = []
    for name in policies:
        if name == "best-fixed":
            out.append(best_fixed(tasks, drafter, curve, k_max, c))
        else:
            out.append(replay(tasks, drafter, name, curve, k_max, c, fresh))
    return out


# ------------------------------------------------------------------------------ reproduction
@dataclass(frozen=True)
class Reproduction:
    """A recorded run against its replay, fed the run's own round times."""

    id: str
    method: str
    rounds: int  # recorded rounds
    same_rounds: int  # leading rounds with the same source, k, accepted and emitted counts
    first_difference: tuple[Round | None, Round | None] | None  # (recorded, replayed)
    recorded_verify_s: float  # the run's measured time in verify passes (decode phase)
    curve_verify_s: float  # the same rounds costed by the curve

    @property
    def reproduced(self) -> bool:
        return self.first_difference is None

    @property
    def cost_error(self) -> float:
        """curve / measured - 1 over the run's own rounds: how far the curve is from the run."""
        return self.curve_verify_s / self.recorded_verify_s - 1 if self.recorded_verify_s else 0.0


def _key(r: Round) -> tuple[str, int, int, int]:
    return r.source, r.k, r.n_accepted, r.n_emitted


def reproduce(
    task: Recorded, drafter: str, policy: KPolicy, curve: Curve, method: str = ""
) -> Reproduction:
    """Replay a task whose artifact logged its rounds with the run's drafter and a policy in the
    state the run's started in, feeding it the run's own times; compare round by round."""
    if task.rounds is None:
        raise ValueError(f"{task.id}: its artifact has no round_log (re-run the bench)")
    run = run_task(task, drafter, policy, recorded_costs(task.rounds, curve_costs(curve)), curve)
    rec, rep = list(task.rounds), run.rounds
    same = 0
    while same < min(len(rec), len(rep)) and _key(rec[same]) == _key(rep[same]):
        same += 1
    diff = None
    if same < max(len(rec), len(rep)):
        diff = (rec[same] if same < len(rec) else None, rep[same] if same < len(rep) else None)
    return Reproduction(
        task.id,
        method,
        len(rec),
        same,
        diff,
        sum(r.verify_s for r in rec),
        sum(curve.at(r.k + 1) * curve.step_s for r in rec),
    )


def reproduce_bench(path: str | Path, curve: Curve, tokenizer: Any = None) -> list[Reproduction]:
    """Every logged speculative run of a bench artifact replayed in the order the bench ran
    them (each row's `sequence`), with the policies a bench process keeps: one k=auto policy
    per drafter kind shared across prompts and methods (generate._policy's key), a fresh one per
    generation otherwise. Each auto policy starts empty, as in a process without a cost store:
    a run whose store held a curve started elsewhere, and parts from its replay (reported)."""
    from specdec.core.config import SpecConfig, runs_as
    from specdec.study.run.bench_settings import core_drafter

    path = Path(path)
    art = read(json.loads(path.read_text()), str(path), path)
    methods = [m for m in ("speculative", *art.variants) if _method_setting(art, m)[0]]
    recs = {m: from_bench(path, m, tokenizer) for m in methods}
    logged = {m: r for m, r in recs.items() if all(t.rounds is not None for t in r)}
    k_max = SpecConfig(k_max=art.config.get("k_max")).resolved_k_max(uses_model=False)
    shared: dict[str, KPolicy] = {}
    out = []
    for i, row in enumerate(art.rows):
        for m in (x for x in row.sequence if x in logged):
            task = logged[m][i]
            drafter = task.drafter or "lookup"
            pred = task.other_prediction if drafter == "wrong-prediction" else task.prediction
            # generate._policy's key: what the bench's drafter ran as (lookup was given none)
            kind = runs_as(core_drafter(drafter), has_prediction=pred is not None)
            if task.k == "auto":
                policy = shared.setdefault(kind, CostModelK(k_max))
            else:
                policy = make_policy(task.k, k_max if isinstance(task.k, str) else task.k)
            out.append(reproduce(task, drafter, policy, curve, m))
    return out


# ------------------------------------------------------------------------------ output
def format_table(results: Sequence[PolicyResult], tasks: Sequence[Recorded]) -> str:
    """Per policy: pooled and per-task decode speedup, rounds, drafted, accepted."""
    from specdec.study.present import fmt

    header = ["policy", "decode", "geomean", *(t.id for t in tasks)]
    header += ["rounds", "drafted", "accepted", "pred. acc./rej."]
    rows = []
    for r in results:
        rows.append(
            [
                r.name,
                f"{r.speedup:.3f}x",
                f"{r.geomean:.3f}x",
                *(f"{run.speedup:.2f}x" for run in r.runs),
                str(r.total("rounds")),
                str(r.total("drafted")),
                f"{r.total('accepted')} ({r.total('accepted') / max(1, r.total('drafted')):.0%})",
                f"{r.total('accepted_prediction_tokens')}/{r.total('rejected_prediction_tokens')}",
            ]
        )
    return fmt.text_table(header, rows)


def to_artifact(
    results: Sequence[PolicyResult],
    tasks: Sequence[Recorded],
    config: Mapping[str, Any],
) -> ReplayArtifact:
    """specdec.replay/1: the settings, and per policy the pooled and per-task numbers."""
    policies = {
        r.name: ReplayPolicy(
            decode_speedup=r.speedup,
            geomean_speedup=r.geomean,
            tasks={run.id: _task_run(run) for run in r.runs},
        )
        for r in results
    }
    return ReplayArtifact(
        meta=meta_block(),
        config=ReplayConfig.model_validate(dict(config)),
        tasks=tuple(
            ReplayTask(id=t.id, prompt_tokens=len(t.prompt), output_tokens=len(t.output))
            for t in tasks
        ),
        policies=policies,
    )


def _task_run(run: ReplayRun) -> ReplayTaskRun:
    st = run.stats
    return ReplayTaskRun(
        decode_speedup=run.speedup,
        steps=run.steps,
        generated=st.generated,
        rounds=st.rounds,
        drafted=st.drafted,
        accepted=st.accepted,
        drafted_by_source=st.drafted_by_source,
        accepted_by_source=st.accepted_by_source,
        k_histogram=st.k_histogram,
    )
