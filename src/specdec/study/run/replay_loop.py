"""The replay proper (study/run/replay.py's docstring: how and why): one recorded greedy output
through core.decode's loop, its target answering from the record, its clock the verify curve's;
the drafters a live run gets, the oracle K policies that peek at the record, and the policies by
their replay names.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from specdec.backends.replay import Charged, CostFn, ModelledClock, ReplayTarget
from specdec.core.config import DrafterName, Warp, runs_as
from specdec.core.cost import curve_at
from specdec.core.drafters import CompositeDrafter, Drafter
from specdec.core.generate import make_drafter, stream
from specdec.core.metrics import GenerationStats, Round
from specdec.core.policy import POLICIES, CostModelK, KPolicy, make_policy
from specdec.core.prediction import PredictionDrafter, PredictionIndex

#: The model-free drafters a replay runs (bench's names; no draft model: nothing to replay it
#: on); "prediction-static": the prediction drafter without rewrites (core.edits), as before
#: issue 22; "prediction-nohints": learned rewrites, none from the instruction
REPLAY_DRAFTERS = (
    "prediction",
    "lookup",
    "wrong-prediction",
    "prediction-static",
    "prediction-nohints",
)
Hint = tuple[tuple[int, ...], tuple[int, ...]]


# ------------------------------------------------------------------------------ a task, a curve
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


# ------------------------------------------------------------------------------ the replay
def task_drafter(kind: str, task: Recorded) -> Drafter:
    """bench's drafter `kind` for one task, as its live run gets it (study.run.methods): built
    by generate.make_drafter, the prediction first, then prompt lookup; "wrong-prediction" drafts
    from another task's prediction; no prediction at all: lookup alone."""
    if kind not in REPLAY_DRAFTERS:
        raise ValueError(
            f"unknown replay drafter {kind!r}; choose from {', '.join(REPLAY_DRAFTERS)}"
        )
    pred = task.other_prediction if kind == "wrong-prediction" else task.prediction
    start = len(task.prompt)
    # every replay drafter but lookup is the prediction drafter, as it runs with(out) one
    if kind == "lookup" or runs_as("prediction", has_prediction=pred is not None) == "lookup":
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
    """core.generate.stream over a recorded output (greedy): the target a ReplayTarget reading
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
