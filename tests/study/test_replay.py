"""`specdec replay`: the replay loop's accounting on hand-checked cases, and the property that
matters: replaying a recorded run reproduces its rounds exactly (same sources, K, accepted and
emitted counts, round by round), on mock models and on a real model with the prediction drafter,
k=auto included (fed the run's own round times, the policy makes the run's decisions). There
is one loop: a replay is core.generate.stream on a target that answers from the record
(backends/replay.py), so a live run and its replay take the same rounds and commit the same
tokens (the "one loop" tests).

Cost tolerance, stated: fed the run's own times, the replay's verify time equals the run's
measured decode-phase verify time to 1e-9 (relative); costed by a curve instead, it differs by
the curve's error, which `specdec replay --check` prints per run (not tested here: it is a
property of the machine's timings, not of the code).
"""

from __future__ import annotations

import json

import pytest

from specdec.backends import load_model
from specdec.backends.mock import MockModel
from specdec.backends.replay import ModelledClock
from specdec.cli.main import main
from specdec.core.config import SpecConfig, Warp
from specdec.core.policy import CostModelK
from specdec.study.artifacts import ReplayArtifact, read, to_json
from specdec.study.run import replay as rp
from specdec.study.run import replay_loop as loop
from specdec.study.run.bench import run_bench
from specdec.study.run.bench_settings import bench_config

CURVE = loop.Curve({1: 1.0, 2: 1.8, 4: 2.1, 8: 3.0, 16: 3.8, 32: 5.8, 33: 9.3, 64: 12.2}, 0.065)


def _task(output: list[int], prediction: list[int] | None, **kw) -> loop.Recorded:
    fields = dict(max_new_tokens=len(output), stopped=False)
    return loop.Recorded("t", (1, 2, 3), tuple(output), _t(prediction), **{**fields, **kw})


def _t(ids):
    return None if ids is None else tuple(ids)


PRED = list(range(100, 160))  # 60 distinct tokens: the file


def test_curve_interpolates_and_extrapolates_per_token() -> None:
    assert CURVE.at(1) == 1.0 and CURVE.at(33) == 9.3
    assert CURVE.at(3) == pytest.approx((1.8 + 2.1) / 2)
    slope = (12.2 - 9.3) / (64 - 33)  # beyond the last point: the last two points' slope
    assert CURVE.at(128) == pytest.approx(12.2 + slope * (128 - 64))
    # the rule k="auto" prices a pass with (core.cost.curve_at): a replay prices it alike
    policy = CostModelK(k_max=64, verify_s=CURVE.v)
    for b in (3, 5, 33, 50, 64, 100, 128):
        assert CURVE.at(b) == pytest.approx(policy.v(b)), b
    assert CURVE.round_steps(3, c=0.1) == pytest.approx(2.1 + 0.3)


def test_a_perfect_copy_at_fixed_k_costs_what_the_rounds_say() -> None:
    """20 tokens that repeat the prediction, K = 4: every round drafts 4, accepts 4 and adds
    the bonus token, so 4 rounds of v(5) steps."""
    task = _task(PRED[:20], PRED[:20])
    run = loop.run_task(task, "prediction", loop.make_replay_policy("4", CURVE, 64), *_costs())
    assert [(r.k, r.n_accepted, r.n_emitted) for r in run.rounds] == [(4, 4, 5)] * 4
    assert run.stats.generated == 20 and run.stats.accepted_prediction_tokens == 16
    assert run.steps == pytest.approx(4 * CURVE.at(5))
    assert run.speedup == pytest.approx(20 / (4 * CURVE.at(5)))
    assert sum(r.verify_s for r in run.rounds) == pytest.approx(4 * CURVE.at(5) * CURVE.step_s)


def _costs():
    return loop.curve_costs(CURVE), CURVE


def test_an_edit_is_rejected_and_the_stop_ends_the_output() -> None:
    """The output changes two tokens at 30 and stops at 40: drafts past the edit and past the
    stop are rejected; every token of the output is emitted exactly once."""
    out = [*PRED[:30], 7, 8, *PRED[32:40]]
    task = _task(out, PRED, stopped=True, max_new_tokens=64)
    run = loop.run_task(task, "prediction", loop.make_replay_policy("8", CURVE, 64), *_costs())
    assert run.stats.generated == len(out)
    emitted = sum(r.n_emitted for r in run.rounds)
    assert emitted == len(out)
    assert run.stats.rejected_prediction_tokens > 0  # the drafts across the edit
    last = run.rounds[-1]
    assert last.n_accepted < last.k or last.k == 0  # past the stop: nothing known, rejected


def test_oracles_bound_every_fixed_k_and_auto() -> None:
    """On an edit-shaped output the plan oracle's cost is the least of any K policy here, and
    the per-round oracle never drafts a token that is rejected."""
    out = [*PRED[:25], 1, 2, 3, *PRED[25:45], 9, *PRED[46:60]]
    task = _task(out, PRED)
    speed = {}
    for name in ("oracle", "oracle-plan", "auto", "schedule", *map(str, rp.FIXED_KS)):
        res = rp.replay([task], "prediction", name, CURVE)
        speed[name] = res.speedup
        if name == "oracle":
            assert res.total("accepted") == res.total("drafted") > 0
    others = [v for k, v in speed.items() if not k.startswith("oracle")]
    assert speed["oracle-plan"] >= max(others) - 1e-9
    assert speed["oracle"] >= max(others) * 0.95


def test_best_fixed_reports_the_best_k_in_hindsight() -> None:
    task = _task([*PRED[:30], 5, *PRED[31:60]], PRED)
    best = rp.best_fixed([task], "prediction", CURVE)
    each = {k: rp.replay([task], "prediction", str(k), CURVE).speedup for k in rp.FIXED_KS}
    assert best.speedup == pytest.approx(max(each.values()))
    assert best.name == f"best fixed (K = {max(each, key=each.get)})"


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        loop.make_replay_policy("fast", CURVE, 64)
    with pytest.raises(ValueError, match="cannot import"):
        loop.make_replay_policy("nowhere.at.all:Policy", CURVE, 64)
    with pytest.raises(ValueError, match="unknown replay drafter"):
        loop.task_drafter("model", _task([1], None))


def test_a_policy_given_as_module_attr() -> None:
    pol = loop.make_replay_policy("specdec.core.policy:ScheduleK", CURVE, 8)
    assert type(pol).__name__ == "ScheduleK" and pol.k_max == 8


# ------------------------------------------------------------------------------ one loop
class _Timed(MockModel):
    """A mock target whose passes take the curve's modelled time (`clock`, a ModelledClock) in
    place of the microseconds a mock takes: k=auto then chooses the same K on every run, idle
    or loaded, as it does in a replay."""

    clock: ModelledClock | None = None

    def _extend(self, ids: list[int]):
        out = super()._extend(ids)
        if self.clock is not None:
            self.clock.verified(len(ids))
        return out


def _live(target, prompt, drafter, k, pred, stops=()):
    """A greedy live run of generate() on a mock target, with its round log; on a _Timed
    target in modelled time (CURVE's costs; the drafters here draft for free)."""
    from specdec.core.generate import generate

    rounds = []
    kw = {"prediction": pred} if drafter == "prediction" else {}
    if isinstance(target, _Timed):
        kw["clock"] = target.clock = ModelledClock(loop.curve_costs(CURVE))
    res = generate(
        target,
        prompt,
        drafter=drafter,
        k=k,
        temperature=0.0,
        max_new_tokens=60,
        stop_ids=stops,
        on_round=rounds.append,
        **kw,
    )
    return res, rounds


def _replayed(target, prompt, drafter, k, pred, stops=()):
    """(live result, live rounds, replay of the live output): the replay fed the live run's
    own round times, so k=auto observes what it observed live."""
    from specdec.core.config import K_MAX_FREE
    from specdec.core.policy import make_policy

    res, rounds = _live(target, prompt, drafter, k, pred, stops)
    task = loop.Recorded(
        "t", tuple(prompt), tuple(res.tokens), tuple(pred), res.stop_reason == "stop", 60
    )
    # k=auto as the live run made it (generate._policy: no stored curve), else the replay's name
    policy = (
        make_policy(k, K_MAX_FREE) if k == "auto" else loop.make_replay_policy(str(k), CURVE, 64)
    )
    cost = loop.recorded_costs(rounds, loop.curve_costs(CURVE))
    return res, rounds, loop.run_task(task, drafter, policy, cost, CURVE)


def _walk(rounds):
    return [(r.source, r.k, r.n_accepted, r.n_emitted) for r in rounds]


#: (drafter, K, whether some draft is rejected on this mock output: the mismatch path)
LIVE_CASES = [("lookup", 3, True), ("prediction", 8, True), ("prediction", "schedule", False)]
LIVE_CASES += [("prediction", "auto", True), ("lookup", "auto", True)]


@pytest.mark.parametrize(("drafter", "k", "rejects"), LIVE_CASES)
def test_a_replay_takes_the_live_runs_rounds(drafter, k, rejects) -> None:
    """A live greedy run (mock target, generate()) and the replay of its output take the
    same rounds: the same source and K each round, the same accepted and emitted counts, the
    same tokens; k=auto included (the replay feeds it the live rounds' times). Both are the
    one loop, core.generate.stream, so a change to it reaches the replay."""
    target = _Timed(16, seed=0, scale=3.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    out = _live(target, prompt, None, 1, [])[0].tokens  # target-only, to build a prediction
    pred = [*out[:20], 9, 9, 9, *out[23:]]  # the output, three tokens edited
    res, rounds, run = _replayed(target, prompt, drafter, k, pred)
    assert res.stop_reason == "length" and len(res.tokens) == 60
    assert _walk(run.rounds) == _walk(rounds)
    assert run.tokens == res.tokens
    assert sum(r.k for r in rounds) > 0 and any(r.n_accepted < r.k for r in rounds) == rejects
    assert [r.verify_s for r in run.rounds] == [r.verify_s for r in rounds]  # its own times
    assert run.stats.generated == res.stats.generated and run.stats.drafted == res.stats.drafted


def test_a_replay_of_a_stopped_run_ends_on_its_stop_token() -> None:
    """With a stop token the rounds are the same up to the last, whose drafts past the stop the
    record cannot judge (the replay rejects them; live, the target may have accepted some
    before the commit cut at the stop): module docstring's limit, and only there."""
    target = MockModel(16, seed=0, scale=3.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    out = _live(target, prompt, None, 1, [])[0].tokens
    end = max(i for i, t in enumerate(out) if t not in out[:i])  # a token's first occurrence
    # drafted from the target-only output, so live the drafts past the stop are accepted
    res, rounds, run = _replayed(target, prompt, "prediction", 8, out, stops=[out[end]])
    assert res.stop_reason == "stop" and res.tokens == out[: end + 1]
    assert run.tokens == res.tokens
    assert _walk(run.rounds)[:-1] == _walk(rounds)[:-1]
    (s1, k1, a1, e1), (s2, k2, a2, e2) = _walk(run.rounds)[-1], _walk(rounds)[-1]
    assert (s1, k1, e1) == (s2, k2, e2) and a1 < a2  # live accepted past the stop


# ------------------------------------------------------------------------------ reproduction
def _check_reproduced(path, reps: list[rp.Reproduction]) -> None:
    art = json.loads(path.read_text())
    runs = {}
    for row in art["rows"]:
        for m in ("speculative", *row["variants"]):
            runs[(row["prompt_id"], m)] = row[m] if m == "speculative" else row["variants"][m]
    assert {(r.id, r.method) for r in reps} == set(runs)
    for r in reps:
        assert r.reproduced, (r.id, r.method, r.same_rounds, r.rounds, r.first_difference)
        run = runs[(r.id, r.method)]
        assert r.rounds == run["rounds"]
        # the log holds every round: its times sum to the run's verify time (prefill apart)
        assert r.recorded_verify_s == pytest.approx(run["verify_s"], rel=1e-9)
    assert sum(run["drafted"] for run in runs.values()) > 0  # the runs really drafted


def test_replay_reproduces_a_recorded_bench_on_mock_models(tmp_path) -> None:
    """A fresh bench run (k=auto, its policy shared across prompts as in a process; fixed K and
    the schedule beside it) and its replay agree round for round."""
    model_spec = "mock:vocab=16,seed=0,scale=3"
    target = load_model(model_spec)
    pair = (MockModel.near(target, noise=0.7, seed=1), target)
    cfg = bench_config(
        None,
        "mock:vocab=16,seed=1",
        model_spec,
        spec=SpecConfig("lookup", "auto"),
        warp=Warp(temperature=0.0),
        n_prompts=4,
        warmup=0,
        max_new_tokens=60,
        variants=("lookup:3", "lookup:schedule"),
    )
    art = run_bench(cfg, tmp_path, progress=False, models=pair)
    reps = rp.reproduce_bench(art.path, CURVE)
    _check_reproduced(art.path, reps)
    tasks = rp.from_bench(art.path)
    assert [t.output for t in tasks] == [tuple(r.baseline["tokens"]) for r in art.rows]


def test_replay_reproduces_the_prediction_drafter_on_a_real_model(
    smol_llamacpp, tmp_path, monkeypatch
) -> None:
    """smollm2 on two rewrite tasks: the prediction drafter with k=auto (shared by the right
    and the wrong prediction, as in a bench process) and lookup at fixed K. No stored curve
    (an empty $SPECDEC_HOME, once the model is loaded), so the auto policy starts empty as
    the replay's does."""
    model_spec = "llamacpp:smollm2-135m"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    model = smol_llamacpp
    cfg = bench_config(
        None,
        model_spec,
        model_spec,
        spec=SpecConfig("prediction", "auto"),
        warp=Warp(temperature=0.0),
        categories=("rewrite",),
        n_prompts=2,
        warmup=0,
        max_new_tokens=48,
        variants=("wrong-prediction:auto", "lookup:8"),
    )
    art = run_bench(cfg, tmp_path, progress=False, models=(model, model))
    reps = rp.reproduce_bench(art.path, CURVE, model.tokenizer)
    _check_reproduced(art.path, reps)
    by_source = [s for row in art.rows for s in row.speculative["drafted_by_source"]]
    assert any(s.startswith("prediction") for s in by_source)


# ------------------------------------------------------------------------------ inputs, CLI
def test_jsonl_records_and_their_errors(tmp_path) -> None:
    f = tmp_path / "runs.jsonl"
    recs = [
        {"id": "a", "prompt_ids": [1, 2], "output_ids": PRED[:10], "prediction_ids": PRED},
        {"prompt_ids": [3], "output_ids": [5, 6], "stopped": True, "max_new_tokens": 8},
    ]
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    a, b = rp.from_jsonl(f, tokenizer=None)
    assert a.id == "a" and a.prediction == tuple(PRED) and a.max_new_tokens == 10
    assert b.id == "2" and b.stopped and b.max_new_tokens == 8 and b.prediction is None
    f.write_text(json.dumps({"prompt": "text", "output_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="--target"):
        rp.from_jsonl(f, tokenizer=None)
    f.write_text(json.dumps({"prompt_ids": [1], "output_ids": [1, 2], "max_new_tokens": 1}))
    with pytest.raises(ValueError, match="max_new_tokens"):
        rp.from_jsonl(f, tokenizer=None)


def test_cli_replays_a_jsonl_with_a_microbench_curve(tmp_path, capsys) -> None:
    f = tmp_path / "runs.jsonl"
    out = [*PRED[:20], 1, *PRED[21:50]]
    f.write_text(
        json.dumps({"id": "x", "prompt_ids": [1], "output_ids": out, "prediction_ids": PRED})
    )
    curve = "results/cpu/microbench_llamacpp-qwen2.5-coder-1.5b_ctx1024.json"
    js = tmp_path / "replay.json"
    argv = ["replay", str(f), "--curve", curve, "--policy", "oracle,auto,best-fixed,4"]
    assert main([*argv, "--json", str(js)]) == 0
    table = capsys.readouterr().out
    for name in ("oracle", "auto", "best fixed", "4"):
        assert name in table
    art = json.loads(js.read_text())
    assert art["schema"] == rp.SCHEMA and set(art["policies"]) >= {"oracle", "auto", "4"}
    assert art["policies"]["oracle"]["tasks"]["x"]["generated"] == len(out)
    again = read(art, str(js))
    assert isinstance(again, ReplayArtifact) and to_json(again) == art  # reads back as written
    hist = again.policies["oracle"].tasks["x"].k_histogram  # K -> rounds
    assert hist and all(isinstance(k, int) for k in hist)
    assert main(["replay", str(f), "--curve", str(f)]) == 2  # not a microbench: a clear error
    assert "error:" in capsys.readouterr().err


def test_record_writes_greedy_outputs_that_replay_reads_back(tmp_path) -> None:
    """`specdec replay --record`: greedy outputs (here drafted by lookup at k=auto on a mock
    pair, greedy-exact) written as JSONL; read back, they are the target-only outputs."""
    from specdec.core.config import Warp
    from specdec.core.generate import generate
    from specdec.study.run.bench import task_ids
    from specdec.study.run.bench_settings import select_prompts

    target = MockModel(16, seed=0, scale=3.0)
    prompts = select_prompts(("rewrite",), 2)
    path = tmp_path / "out.jsonl"
    recs = rp.record(target, prompts, 20, path, progress=False)
    back = rp.from_jsonl(path, tokenizer=None)
    assert back == recs and [r.id for r in back] == [p.id for p in prompts]
    for r, p in zip(back, prompts, strict=True):
        ids = task_ids(None, p, 16)[0]
        assert list(r.prompt) == ids
        assert list(r.output) == generate(target, ids, max_new_tokens=20, warp=Warp(0.0)).tokens
