"""Replays: core.decode's own loop, drafters and K policies over recorded greedy outputs, with
a measured verify curve for the cost side (`specdec replay`).

A greedy output is what the target produces after its prompt, whatever drafted for it (the loop
is lossless, and greedy decoding is deterministic where the backend is batch-invariant), so a
replay runs `decode.stream` with a target that answers from the record instead of computing
(backends.replay.ReplayTarget) and a clock whose seconds are modelled (ModelledClock):

    draft    the drafter decode.make_drafter builds for a live run proposes from the committed
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

Policies, by name (`make_policy`):
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

import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specdec.backends.replay import Charged, CostFn, ModelledClock, ReplayTarget
from specdec.core.config import DrafterName, Warp
from specdec.core.cost import curve_at
from specdec.core.decode import make_drafter, stream
from specdec.core.drafters import CompositeDrafter, Drafter, PredictionDrafter, PredictionIndex
from specdec.core.metrics import GenerationStats, Round
from specdec.core.policy import POLICIES, CostModelK, KPolicy, make_policy
from specdec.study.artifacts import provenance, schema
from specdec.study.artifacts.runs import read_round_log

SCHEMA = "specdec.replay/1"
#: best-fixed: the fixed K tried (b = K + 1 at and below the curve's steps: 16, 32, 64 rows)
FIXED_KS = (1, 2, 3, 4, 6, 8, 12, 15, 16, 24, 31, 32, 48, 63, 64)
#: The model-free drafters a replay runs (bench's names; no draft model: nothing to replay it
#: on); "prediction-static": the prediction drafter without rewrites (core.edits), as before
#: issue 22; "prediction-nohints": learned rewrites, none from the instruction
DRAFTERS = ("prediction", "lookup", "wrong-prediction", "prediction-static", "prediction-nohints")
Hint = tuple[tuple[int, ...], tuple[int, ...]]


# ------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Recorded:
    """One recorded greedy generation: what a replay needs of it."""

    id: str
    prompt: tuple[int, ...]  # the chat-templated prompt ids
    output: tuple[int, ...]  # the generated ids
    prediction: tuple[int, ...] | None  # the task's prediction, tokenized alone
    stopped: bool  # the output ended on a stop token (else it ran to the budget)
    max_new_tokens: int
    other_prediction: tuple[int, ...] | None = None  # another task's: the wrong-prediction leg
    hints: tuple[Hint, ...] = ()  # rewrites the instruction names (core.edits.named_rewrites)
    rounds: tuple[Round, ...] | None = None  # the run's own rounds, when its artifact logs them
    drafter: str | None = None  # the drafter those rounds came from (bench's name)
    k: int | str | None = None  # and their K setting


@dataclass(frozen=True)
class Curve:
    """A verify-cost curve: v(b) in target steps (v(1) = 1) and the step's seconds."""

    v: Mapping[int, float]  # b -> target steps for one pass over b tokens
    step_s: float
    source: str = ""

    def at(self, b: int) -> float:
        """v(b) as k="auto" prices it (core.cost.curve_at): measured, interpolated linearly
        between measured points, extrapolated past them at the last two's slope, v(1) = 1."""
        return curve_at(sorted(self.v), self.v.__getitem__, b, 1.0)

    def round_steps(self, k: int, c: float = 0.0) -> float:
        """One round drafting k tokens: v(k + 1) + k c (core.cost's cost(K))."""
        return self.at(k + 1) + k * c


def load_curve(path: str | Path) -> Curve:
    """The verify curve of a microbench artifact (its `ratio` per b and its one-step time)."""
    path = Path(path)
    art = schema.read(json.loads(path.read_text()), str(path), path)
    if not isinstance(art, schema.MicrobenchArtifact):
        raise ValueError(f"{path}: not a microbench artifact (give `specdec microbench`'s JSON)")
    if not art.verify or art.verify[0].b != 1:
        raise ValueError(f"{path}: its verify curve does not start at b = 1")
    return Curve({p.b: p.ratio for p in art.verify}, art.target_step_ms / 1e3, str(path))


def from_bench(path: str | Path, method: str = "baseline", tokenizer: Any = None) -> list[Recorded]:
    """The recorded rows of a bench artifact: `method`'s output per row (target-only's by
    default: a T = 0 bench's greedy output), the prompt and prediction rebuilt from the vendored
    prompt set with the target's tokenizer (checked against the row's prompt_tokens), and that
    method's round log when it has one. `tokenizer`: the target's, if already loaded."""
    from specdec.study.run import bench

    path = Path(path)
    art = schema.read(json.loads(path.read_text()), str(path), path)
    if not isinstance(art, schema.BenchArtifact):
        raise ValueError(f"{path}: not a bench artifact")
    if bench.SESSION in (art.config.get("categories") or ()):
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
    prompts = bench.select_prompts(tuple(art.config.get("categories") or ()))
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


def _run_of(row: schema.BenchRow, method: str, path: Path) -> Mapping[str, Any]:
    try:
        run = row.run(method)
    except KeyError:
        have = ["baseline", "speculative", *row.variants]
        raise ValueError(f"{path}: no method {method!r}; it has {', '.join(have)}") from None
    if not run or "tokens" not in run:
        raise ValueError(f"{path}: {row.prompt_id}'s {method} run recorded no tokens")
    return run


def _method_setting(art: schema.BenchArtifact, method: str) -> tuple[str | None, Any]:
    """(drafter, K) of a bench method: the config's for "speculative", the variant's own."""
    if method == "speculative":
        return art.drafter, art.k
    drafter, sep, k = method.rpartition("-k")
    if sep and drafter in DRAFTERS:
        return drafter, int(k) if k.isdigit() else k
    return None, None


def _tokenizer(spec: str, given: Any) -> tuple[Any, int]:
    """(the target's tokenizer, vocab size) without its weights; (None, V) for a mock target."""
    from specdec.backends import load_model, load_tokenizer_of, parse_spec

    if parse_spec(spec)[0] == "mock":
        model = load_model(spec)  # a mock is its vocabulary size: nothing to load
        return None, model.vocab_size
    tok = given if given is not None else load_tokenizer_of(spec)
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
    from specdec.core.config import SpecConfig, Warp
    from specdec.core.decode import generate
    from specdec.core.policy import AutoPolicies
    from specdec.study.run import bench

    stops = chat.stop_ids(target.tokenizer)
    policies = AutoPolicies(CurveFiles())  # k=auto carries over from prompt to prompt
    out, lines = [], []
    for i, prompt in enumerate(prompts):
        ids, pred = bench.task_ids(target.tokenizer, prompt, target.vocab_size)
        kw: dict[str, Any] = {}
        if drafter is not None:
            kw = {"spec": SpecConfig(drafter if pred is not None else "lookup", "auto")}
            kw.update({"prediction": pred} if pred is not None else {})
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
            res.stop_reason == "stop",
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


# ------------------------------------------------------------------------------ the replay
def task_drafter(kind: str, task: Recorded) -> Drafter:
    """bench's drafter `kind` for one task, as its live run gets it (study.run.methods): built
    by decode.make_drafter, the prediction first, then prompt lookup; "wrong-prediction" drafts
    from another task's prediction; no prediction at all: lookup alone."""
    if kind not in DRAFTERS:
        raise ValueError(f"unknown replay drafter {kind!r}; choose from {', '.join(DRAFTERS)}")
    pred = task.other_prediction if kind == "wrong-prediction" else task.prediction
    start = len(task.prompt)
    if kind == "lookup" or pred is None:
        return _made("lookup", None, start)
    hints = task.hints if kind in ("prediction", "wrong-prediction") else ()
    index = PredictionIndex(list(pred), PredictionDrafter.N_MAX, hints)
    if kind == "prediction-static":  # the one drafter decode has no name for: it never learns
        return CompositeDrafter(
            PredictionDrafter(index, start, learn=False), _made("lookup", None, start)
        )
    return _made("prediction", index, start)


def _made(kind: DrafterName, prediction: PredictionIndex | None, start: int) -> Drafter:
    made = make_drafter(kind, None, prediction, start, None)[0]
    assert made is not None  # a named drafter
    return made


@dataclass
class ReplayRun:
    """One task replayed under one policy."""

    id: str
    stats: GenerationStats  # the loop's counters over the replayed rounds (times: modelled)
    steps: float  # the rounds' cost in target steps (curve), drafting included
    rounds: list[Round] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what the loop committed (the record's ids)

    @property
    def speedup(self) -> float:
        """Decode phase against target-only: generated / steps."""
        return self.stats.generated / self.steps if self.steps else 0.0


def _accepted(x: Sequence[int], task: Recorded, at: int) -> int:
    """How many leading drafts equal the recorded output from position `at` (past a stop token
    nothing is known: rejected)."""
    out, n = task.output, 0
    while n < len(x) and at + n < len(out) and x[n] == out[at + n]:
        n += 1
    return n


@dataclass
class Oracle:
    """A K policy told this round's accept length a (it peeks: the drafter's longest draft
    against the record): drafts the k <= a with the most tokens per step. `start` binds it to
    the task and the drafter the loop runs."""

    k_max: int
    curve: Curve
    c: float = 0.0
    task: Recorded | None = field(default=None, repr=False)
    drafter: Drafter | None = field(default=None, repr=False)
    made: int = 0  # output tokens committed so far

    def start(self, task: Recorded, drafter: Drafter) -> None:
        self.task, self.drafter, self.made = task, drafter, 0

    def pick(self, accept: int, room: int, left: int) -> int:
        """`left`: tokens of the output still to come (a round emits at most that many)."""
        top = min(accept, room, self.k_max)
        steps = self.curve.round_steps
        return max(range(top + 1), key=lambda k: (min(k + 1, left) / steps(k, self.c), -k))

    def choose(self, source: str, remaining: int) -> int:
        assert self.task is not None and self.drafter is not None, "start() binds a task"
        task, at = self.task, self.made
        context = [*task.prompt, *task.output[:at]]  # the loop's committed sequence
        peek = self.drafter.propose(context, min(self.k_max, remaining)).x.tolist()
        return self.pick(_accepted(peek, task, at), remaining, len(task.output) - at)

    def observe(self, r: Round) -> None:
        self.made += r.n_emitted


@dataclass
class PlanOracle(Oracle):
    """The least-cost plan over every position's accept length (set per task by `plan`)."""

    choice: list[int] = field(default_factory=list)

    def plan(self, accept: Sequence[int]) -> None:
        n = len(accept)
        best = [0.0] * (n + 1)
        self.choice = [0] * n
        for i in range(n - 1, -1, -1):
            best[i] = self.curve.round_steps(0) + best[i + 1]
            for k in range(1, min(accept[i], self.k_max) + 1):
                cost = self.curve.round_steps(k, self.c) + best[min(n, i + k + 1)]
                if cost < best[i]:
                    best[i], self.choice[i] = cost, k

    def choose(self, source: str, remaining: int) -> int:
        return min(self.choice[self.made] if self.made < len(self.choice) else 0, remaining)


def accept_lengths(task: Recorded, drafter: Drafter, k_max: int) -> list[int]:
    """At every position of the output, how far a k_max draft would be accepted, the drafter
    following the output token by token (no rounds: the oracle-plan's view)."""
    ctx, out = list(task.prompt), []
    for i in range(len(task.output)):
        room = min(k_max, task.max_new_tokens - i - 1)
        a = 0
        if room > 0 and drafter.source(ctx) is not None:
            a = _accepted(drafter.propose(ctx, room).x.tolist(), task, i)
        out.append(a)
        ctx.append(task.output[i])
    return out


def curve_costs(curve: Curve, c: float = 0.0) -> CostFn:
    """Each round's (draft_s, verify_s) from the curve: k c and v(k + 1) steps, in seconds."""
    return lambda i, k: (k * c * curve.step_s, curve.at(k + 1) * curve.step_s)


def recorded_costs(rounds: Sequence[Round], fallback: CostFn) -> CostFn:
    """The recorded run's own (draft_s, verify_s) for round i while the replay reproduces its
    rounds (k=auto then sees the times the run saw); `fallback` after they part."""

    def cost(i: int, k: int) -> tuple[float, float]:
        if i < len(rounds) and rounds[i].k == k:
            return rounds[i].draft_s, rounds[i].verify_s
        return fallback(i, k)

    return cost


def run_task(
    task: Recorded, drafter: str, policy: KPolicy, cost: CostFn, curve: Curve, c: float = 0.0
) -> ReplayRun:
    """core.decode.stream over a recorded output (greedy): the target a ReplayTarget reading
    the record, the drafter `task_drafter`'s, K from `policy`, the phases timed by `cost`
    (backends.replay). A stopped output ends on its stop token, else at its length."""
    if task.stopped and task.output[-1] in task.output[:-1]:
        raise ValueError(
            f"{task.id}: marked stopped, but its stop token {task.output[-1]} occurs earlier "
            "in the output (a generation ends at its first stop token)"
        )
    dense, back, width = _dense(task)
    clock = ModelledClock(cost)
    made = task_drafter(drafter, dense)
    if isinstance(policy, PlanOracle):  # its plan follows the output with a drafter of its own
        policy.plan(accept_lengths(dense, task_drafter(drafter, dense), policy.k_max))
    if isinstance(policy, Oracle):
        policy.start(dense, made)
    budget = task.max_new_tokens if task.stopped else len(task.output)
    n_ctx = len(task.prompt) + budget
    rounds: list[Round] = []
    s = stream(
        ReplayTarget(dense.prompt, dense.output, width, clock, f"replay:{task.id}", n_ctx),
        list(dense.prompt),
        drafter=Charged(made, clock),
        k=policy,
        warp=Warp(0.0),
        max_new_tokens=budget,
        stop_ids=dense.output[-1:] if task.stopped else (),
        on_round=rounds.append,
        clock=clock,
    )
    tokens = [back[t] for chunk in s for t in chunk]
    if tokens != list(task.output):  # the target answers from the record: never expected
        raise AssertionError(f"{task.id}: the replay committed other tokens than the record")
    steps = sum(curve.round_steps(r.k, c) for r in rounds)
    return ReplayRun(task.id, s.stats, steps, rounds, tokens)


def _dense(task: Recorded) -> tuple[Recorded, list[int], int]:
    """The task with its ids relabeled 0..U-1 in their order (U: the distinct ids it holds), the
    map back, and the width V = U + 1 (ReplayTarget's unknown token). The drafters compare ids
    only for equality, so the rounds are the same, while a logit row is V wide instead of the
    tokenizer's ~150k."""
    seqs = [task.prompt, task.output, task.prediction or (), task.other_prediction or ()]
    seqs += [ids for hint in task.hints for ids in hint]
    back = sorted({t for ids in seqs for t in ids})
    ix = {t: i for i, t in enumerate(back)}

    def d(ids: Sequence[int] | None) -> tuple[int, ...] | None:
        return None if ids is None else tuple(ix[t] for t in ids)

    hints = tuple((d(o), d(n)) for o, n in task.hints)
    dense = replace(
        task,
        prompt=d(task.prompt),
        output=d(task.output),
        prediction=d(task.prediction),
        other_prediction=d(task.other_prediction),
        hints=hints,
    )
    return dense, back, len(back) + 1


# ------------------------------------------------------------------------------ policies
def make_replay_policy(name: str, curve: Curve, k_max: int, c: float = 0.0) -> KPolicy:
    """A policy by its replay name (module docstring), its cost store holding the curve."""
    if name == "oracle":
        return Oracle(k_max, curve, c)
    if name == "oracle-plan":
        return PlanOracle(k_max, curve, c)
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"policy {name!r}: cannot import it ({e})") from None
        policy = factory(k_max)
    elif name in POLICIES:
        policy = POLICIES[name](k_max)
    elif name in ("auto", "schedule") or name.isdigit():
        policy = make_policy(int(name) if name.isdigit() else name, k_max)
    else:
        known = ", ".join(["oracle", "oracle-plan", "auto", "schedule", "N", *POLICIES])
        raise ValueError(f"unknown policy {name!r}; choose from {known} or module:attr")
    if isinstance(policy, CostModelK):  # as a process starts from the curve microbench stored
        policy.load_curve({b: steps * curve.step_s for b, steps in curve.v.items()})
    return policy


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
    per drafter kind shared across prompts and methods (decode._policy's key), a fresh one per
    generation otherwise. Each auto policy starts empty, as in a process without a cost store:
    a run whose store held a curve started elsewhere, and parts from its replay (reported)."""
    from specdec.core.config import SpecConfig

    path = Path(path)
    art = schema.read(json.loads(path.read_text()), str(path), path)
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
            kind = "lookup" if drafter == "lookup" or pred is None else "prediction"
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
) -> dict[str, Any]:
    """specdec.replay/1: the settings, and per policy the pooled and per-task numbers."""
    per = {}
    for r in results:
        per[r.name] = {
            "decode_speedup": r.speedup,
            "geomean_speedup": r.geomean,
            "tasks": {
                run.id: {
                    "decode_speedup": run.speedup,
                    "steps": run.steps,
                    "generated": run.stats.generated,
                    "rounds": run.stats.rounds,
                    "drafted": run.stats.drafted,
                    "accepted": run.stats.accepted,
                    "drafted_by_source": run.stats.drafted_by_source,
                    "accepted_by_source": run.stats.accepted_by_source,
                    "k_histogram": run.stats.k_histogram,
                }
                for run in r.runs
            },
        }
    return {
        "schema": SCHEMA,
        "meta": provenance.meta_block(),
        "config": dict(config),
        "tasks": [
            {"id": t.id, "prompt_tokens": len(t.prompt), "output_tokens": len(t.output)}
            for t in tasks
        ],
        "policies": per,
    }
