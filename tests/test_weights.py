"""A load that says what it got (backends/weights.py, issue 44 item 2): a GGUF file's weight
types, the kernel that multiplies each, whether the default mode is batch-invariant for it, in
`specdec models inspect`, a warning at load, and the server's /v1/models entry.

The file that is not covered is made here: the registry's smollm2 requantized to Q4_0 with
llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`), in a temporary
directory; no weights are committed.
"""

from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path

import pytest

from specdec.backends.weights import (
    ROW_INVARIANT_TYPES,
    SDMM_TYPES,
    WeightReport,
    inspect_weights,
    invariant_by_construction,
    kernel_of,
)


def test_the_verdict_follows_the_kernels_of_the_types() -> None:
    assert invariant_by_construction(frozenset({"Q4_K", "Q6_K"}), "avx512")
    assert not invariant_by_construction(frozenset({"Q4_K", "Q6_K"}), None)  # sdmm off
    assert invariant_by_construction(frozenset({"Q4_1", "Q8_0"}), None)  # ggml's per-row types
    assert not invariant_by_construction(frozenset({"Q5_K", "Q6_K"}), "avx2")
    assert not invariant_by_construction(frozenset({"Q4_K/3d"}), "avx512")  # experts
    assert kernel_of("Q4_K", "avx2").startswith("sdmm (avx2)")
    assert "not batch-invariant" in kernel_of("Q8_0/3d", "avx512")
    report = WeightReport("f.gguf", "qwen2", "x", {"Q5_K": 700, "Q6_K": 300}, "avx512")
    assert not report.invariant and report.breaking == ["Q5_K"]
    rec = report.record()
    assert [w["share"] for w in rec["weights"]] == [0.7, 0.3]
    assert rec["breaking_types"] == ["Q5_K"] and rec["batch_invariant"] is False
    assert any("NOT batch-invariant (Q5_K)" in line for line in report.lines())
    assert SDMM_TYPES & ROW_INVARIANT_TYPES == {"Q5_0", "Q8_0"}


@pytest.fixture(scope="module")
def q4_0(smol_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smollm2 requantized to Q4_0 (llama.cpp's quantizer; ~2 s)."""
    import llama_cpp

    out = tmp_path_factory.mktemp("requant") / "smollm2-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(
        str(smol_path).encode(), str(out).encode(), ctypes.byref(params)
    )
    assert rc == 0 and out.stat().st_size > 0
    return out


@pytest.mark.model
def test_inspect_names_an_uncovered_type_and_says_the_guarantee_does_not_hold(
    q4_0: Path, smol_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from specdec.cli.main import main

    assert inspect_weights(smol_path, "avx512").invariant  # Q4_1 and Q8_0: covered
    report = inspect_weights(q4_0, "avx512")
    assert report.architecture == "llama" and report.breaking == ["Q4_0"]
    assert abs(sum(w["share"] for w in report.record()["weights"]) - 1) < 1e-9
    assert main(["models", "inspect", str(q4_0)]) == 0
    text = capsys.readouterr().out
    assert "Q4_0" in text and "NOT batch-invariant (Q4_0)" in text and "deterministic" in text
    assert main(["models", "inspect", str(q4_0), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breaking_types"] == ["Q4_0"]


@pytest.mark.model
def test_a_default_load_of_an_uncovered_file_warns_once_naming_the_types(
    q4_0: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from specdec.backends import load_model
    from specdec.serve.app import _weights_card

    with caplog.at_level(logging.WARNING, logger="specdec.backends.llamacpp"):
        model = load_model(f"llamacpp:{q4_0}", n_threads=2)
    try:
        warned = [r.getMessage() for r in caplog.records if "Q4_0" in r.getMessage()]
        assert len(warned) == 1 and "deterministic=True" in warned[0]
        assert model.batch_invariant is False
        card = _weights_card(model)
        assert card is not None and card["batch_invariant"] is False
        assert set(card["types"]) == {"Q4_0", "Q8_0"}
    finally:
        model.close()
