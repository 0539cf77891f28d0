"""A load that says what it got (backends/weights.py, issue 44 item 2): a GGUF file's weight
types, the kernel that multiplies each, whether the default mode is batch-invariant for it, in
`specdec models inspect`, a warning at load, and the server's /v1/models entry.

The files are made here: the registry's smollm2 requantized with llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`) in a temporary directory, to IQ3_S (a type no
invariant kernel takes), to Q4_0, Q5_K_M and Q3_K_S (sdmm's since issue 44), to Q2_K, IQ4_XS,
F16 and BF16 (since issue 52); no weights are committed.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import TEST_THREADS

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
    assert invariant_by_construction(frozenset({"Q5_K", "Q6_K"}), "avx2")
    assert invariant_by_construction(frozenset({"IQ4_XS", "Q2_K", "BF16"}), "avx2")
    assert not invariant_by_construction(frozenset({"IQ4_XS", "Q6_K"}), None)
    assert not invariant_by_construction(frozenset({"IQ3_S", "Q6_K"}), "avx2")
    assert not invariant_by_construction(frozenset({"Q4_K/3d"}), "avx512")  # experts
    assert kernel_of("Q4_K", "avx2").startswith("sdmm (avx2)")
    assert "not batch-invariant" in kernel_of("Q8_0/3d", "avx512")
    report = WeightReport("f.gguf", "qwen2", "x", {"IQ2_XS": 700, "Q6_K": 300}, "avx512")
    assert not report.invariant and report.breaking == ["IQ2_XS"]
    rec = report.record()
    assert [w["share"] for w in rec["weights"]] == [0.7, 0.3]
    assert rec["breaking_types"] == ["IQ2_XS"] and rec["batch_invariant"] is False
    assert any("NOT batch-invariant (IQ2_XS)" in line for line in report.lines())
    assert ROW_INVARIANT_TYPES <= SDMM_TYPES  # sdmm takes the per-row types too, for speed


def _requantize(src: Path, ftype: int, out: Path, pure: bool = False) -> Path:
    """`src` requantized by llama.cpp's own quantizer to `ftype` (llama_ftype; ~1 s here);
    `pure`: every tensor of that type where its rows allow, without the ftype's mix."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.allow_requantize = True
    params.nthread = 2  # worker threads that join, no spinning barrier: never stalls
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0 and out.stat().st_size > 0
    return out


#: The files the tests make from smollm2: name -> (llama_ftype, pure). Where a row is not whole
#: 256-value super-blocks (smollm2's 576 columns) llama.cpp falls back to another type.
#:   iq3_s   IQ3_S (neither sdmm's nor ggml's per-row kernels take it) in ffn_down, IQ4_NL
#:           (sdmm's) elsewhere
#:   q4_0    Q4_0 (sdmm's)
#:   q5_k_m  Q5_K, Q5_1 where rows are not whole super-blocks, Q6_K: all sdmm's
#:   q3_k_s  Q3_K (packed as Q6_K) in ffn_down (Q3_K_M gives those Q4_K/Q5_K here, so no Q3_K
#:           at all), Q4_0 elsewhere
#:   q2_k    Q2_K, pure: the Q2_K mix would give ffn_down Q3_K, and smollm2 would hold no Q2_K
#:   iq4_xs  IQ4_XS, IQ4_NL where rows are not whole super-blocks
#:   f16     F16, from its Q8_0 (each value exact in fp16's 11 bits)
#:   bf16    BF16
REQUANT = {
    "iq3_s": ("LLAMA_FTYPE_MOSTLY_IQ3_S", False),
    "q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", False),
    "q5_k_m": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
    "q3_k_s": ("LLAMA_FTYPE_MOSTLY_Q3_K_S", False),
    "q2_k": ("LLAMA_FTYPE_MOSTLY_Q2_K", True),
    "iq4_xs": ("LLAMA_FTYPE_MOSTLY_IQ4_XS", False),
    "f16": ("LLAMA_FTYPE_MOSTLY_F16", False),
    "bf16": ("LLAMA_FTYPE_MOSTLY_BF16", False),
}


@pytest.fixture(scope="module")
def requantized(smol_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """smollm2 requantized as REQUANT names it, each file made once for the module."""
    import llama_cpp

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            ftype, pure = REQUANT[name]
            out = tmp_path_factory.mktemp("requant") / f"smollm2-{name}.gguf"
            made[name] = _requantize(smol_path, getattr(llama_cpp, ftype), out, pure)
        return made[name]

    return get


@pytest.mark.model
def test_inspect_names_an_uncovered_type_and_says_the_guarantee_does_not_hold(
    requantized: Callable[[str], Path], smol_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from specdec.cli.main import main

    iq3_s, q4_0 = requantized("iq3_s"), requantized("q4_0")
    assert inspect_weights(smol_path, "avx512").invariant  # Q4_1 and Q8_0: covered
    assert inspect_weights(q4_0, "avx512").invariant  # Q4_0 and Q8_0: sdmm's
    report = inspect_weights(iq3_s, "avx512")
    assert report.architecture == "llama" and report.breaking == ["IQ3_S"]
    assert abs(sum(w["share"] for w in report.record()["weights"]) - 1) < 1e-9
    assert main(["models", "inspect", str(iq3_s)]) == 0
    text = capsys.readouterr().out
    assert "IQ3_S" in text and "NOT batch-invariant (IQ3_S" in text and "deterministic" in text
    assert main(["models", "inspect", str(iq3_s), "--json"]) == 0
    assert "IQ3_S" in json.loads(capsys.readouterr().out)["breaking_types"]
    assert main(["models", "inspect", str(q4_0), "--json", "--measure"]) == 0
    m = json.loads(capsys.readouterr().out)["measured"]
    assert m["cached"] == 256 and 0 < m["step_ms"] and 0 < m["pass16_ms"] and m["v16"] > 0


@pytest.mark.model
def test_a_default_load_of_an_uncovered_file_warns_once_naming_the_types(
    requantized: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    from specdec.backends import load_model
    from specdec.serve.app import _weights_card

    with caplog.at_level(logging.WARNING, logger="specdec.backends.llamacpp"):
        model = load_model(f"llamacpp:{requantized('iq3_s')}", n_threads=TEST_THREADS)
    try:
        warned = [r.getMessage() for r in caplog.records if "IQ3_S" in r.getMessage()]
        assert len(warned) == 1 and "deterministic=True" in warned[0]
        assert model.batch_invariant is False
        card = _weights_card(model)
        assert card is not None and card["batch_invariant"] is False
        assert "IQ3_S" in card["types"] and card["types"]["IQ4_NL"].startswith("sdmm")
    finally:
        model.close()


@pytest.mark.model
@pytest.mark.parametrize("ftype", ["q4_0", "q5_k_m", "q3_k_s", "q2_k", "iq4_xs", "f16", "bf16"])
def test_a_requantized_file_on_sdmm_rows_bit_identical_and_greedy_speculation_exact(
    ftype: str, requantized: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Q4_0, Q5_K_M (Q5_K, Q5_1, Q6_K), Q3_K_S (Q3_K packed as Q6_K, Q4_0), Q2_K, IQ4_XS (with
    IQ4_NL), F16 and BF16 run sdmm's kernels: the default load is batch-invariant and says
    nothing; row i of a b-row pass has the bits of token i's single step, b = 2..64; greedy
    speculation equals target-only token for token."""
    from specdec.backends import load_model
    from specdec.backends.llamacpp_kernels import sdmm_isa
    from specdec.core.generate import generate

    path = requantized(ftype)
    report = inspect_weights(path, sdmm_isa())
    main_type = {"q5_k_m": "Q5_K", "q3_k_s": "Q3_K"}.get(ftype, ftype.upper())
    assert main_type in report.type_bytes
    with caplog.at_level(logging.WARNING, logger="specdec.backends.llamacpp"):
        m = load_model(f"llamacpp:{path}", n_threads=TEST_THREADS, n_ctx=512)
    try:
        assert report.invariant and m.batch_invariant
        assert not [r for r in caplog.records if "batch-invariant" in r.getMessage()]
        ids = [(7 * i + 3) % 4000 + 100 for i in range(80)]
        m.reset()
        m.prefill(ids[:8])
        single = [m.extend([t])[-1].clone() for t in ids[8:72]]
        for b in (2, 7, 16, 64):
            m.truncate(8)
            rows = m.extend(ids[8 : 8 + b])
            for i in range(b):
                assert torch.equal(rows[i], single[i]), f"b={b} row {i}"
        prompt = m.tokenizer.apply_chat_template(
            [{"role": "user", "content": "List the planets of the solar system, in order."}],
            add_generation_prompt=True,
            return_dict=False,
        )
        alone = generate(m, prompt, temperature=0, max_new_tokens=64).tokens
        for kw in ({"drafter": "lookup", "k": 4}, {"drafter": "lookup", "k": "auto"}):
            assert generate(m, prompt, temperature=0, max_new_tokens=64, **kw).tokens == alone
    finally:
        m.close()
