"""The SpecModel contract (core/model.py), one suite for every backend (the style guide's
principle 4).

Backends: `mock` (exact), `replay` (a recorded output, backends/replay.py: exact), `hf`
(smollm2-135m dequantized, fp32 CPU) and `llamacpp` (the same GGUF, Q4_1, default settings: flash
attention, q8_0 K cache). The real ones are marked model but run in `make test`; each loads once
per session (conftest.py).

Tolerances are max |logit difference| against a fresh evaluation of the same tokens, measured on a
2-core x86 CPU and set with margin:
    mock      0      integer table lookups, nothing to round.
    replay    0      one-hot rows read off the record.
    hf        1e-3   fp32 CPU matmuls pick their blocking by batch shape, so a token evaluated in a
                     chunk of 1..8 after a cache differs from the same token in one forward pass at
                     the rounding level: measured max 7.6e-5 after detours (3 seeds), 9.5e-5 for
                     one prefill vs token by token, with logits up to 39 in magnitude.
    llamacpp  0      bit-identical. Flash attention plus a quantized K cache send every batch shape
                     through the same kernels; with llama.cpp's default f16 K cache a single token
                     past position 256 differed from a batch by 1.75, and a long prefill from
                     token-by-token by 2.6 (backends/llamacpp.py explains why).
"""

from __future__ import annotations

import random

import pytest
import torch
from support import TEST_THREADS

from specdec.backends import load_model
from specdec.backends.mock import MockModel
from specdec.backends.registry import CorruptModelError, ModelFetchError
from specdec.backends.replay import ReplayTarget
from specdec.core.model import SpecModel, SpecModelError

TOL = {"mock": 0.0, "replay": 0.0, "hf": 1e-3, "llamacpp": 0.0}
BACKENDS = [
    "mock",
    "replay",
    pytest.param("hf", marks=pytest.mark.model),
    pytest.param("llamacpp", marks=pytest.mark.model),
]
MOCK_V = 48
SCHEDULE_SEEDS = (0, 1)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model(backend: str, request: pytest.FixtureRequest) -> SpecModel:
    """The backend's model with an empty cache."""
    if backend == "mock":
        return MockModel(vocab_size=MOCK_V, seed=0)
    if backend == "replay":  # the walk's sequence as the record: rows on and off it both occur
        walk = request.getfixturevalue("seq")
        return ReplayTarget(walk[:150], walk[150:], MOCK_V + 1, n_ctx=4096)  # as the mock
    return request.getfixturevalue(f"smol_{backend}")


@pytest.fixture
def seq(backend: str, request: pytest.FixtureRequest) -> list[int]:
    """The token sequence the tests walk: real text for real models (random ids drive real models
    into odd activations with huge logits), random ids for the mock."""
    if backend in ("mock", "replay"):
        rng = random.Random(123)
        return [rng.randrange(MOCK_V) for _ in range(300)]
    ids = request.getfixturevalue("smol_prompt_ids")
    # torch has no kernel that changes past position 256 (llama.cpp's f16 K cache did): HF walks
    # the first 96 ids, a third of the single steps (~10 s each test on 2 cores)
    return ids[:96] if backend == "hf" else ids


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------ shape, dtype, device
def test_extend_returns_float32_cpu_logits_of_full_width(model: SpecModel, seq: list[int]) -> None:
    logits = model.extend(seq[:5])
    assert logits.shape == (5, model.vocab_size)
    assert logits.dtype == torch.float32
    assert logits.device.type == "cpu"
    assert torch.isfinite(logits).all()
    assert model.n_cached == 5 and model.cached_tokens == seq[:5]
    assert model.extend(torch.tensor(seq[5:8])).shape == (3, model.vocab_size)  # 1-D LongTensor
    assert model.n_cached == 8


def test_real_models_report_the_gguf_vocabulary(smol_hf: SpecModel, smol_llamacpp: SpecModel):
    # Both read the same GGUF: the logit width is its 49152-token vocabulary, and it equals the
    # tokenizer's length (smollm2 pads nothing; Qwen pads its output layer to 151936).
    assert smol_hf.vocab_size == smol_llamacpp.vocab_size == 49152
    assert len(smol_hf.tokenizer) == len(smol_llamacpp.tokenizer) == 49152


# ----------------------------------------------------------------- extend/truncate consistency
def walk_with_detours(model: SpecModel, seq: list[int], rng: random.Random):
    """Feed `seq` in chunks of 1..8 the way a speculative decoder would, with detours: wrong tokens
    extended and rolled back (rejected drafts), truncations back into accepted tokens, and
    truncations at or past the end (no-ops). Returns (start, logits) for every extend of `seq`."""
    records = []
    pos = 0
    while pos < len(seq):
        chunk = seq[pos : pos + rng.randint(1, 8)]
        records.append((pos, model.extend(chunk)))
        pos += len(chunk)
        r = rng.random()
        if r < 0.4:
            model.extend([rng.randrange(model.vocab_size) for _ in range(rng.randint(1, 8))])
            pos -= rng.randint(0, min(3, pos))
            model.truncate(pos)
        elif r < 0.5:
            model.truncate(pos + rng.randint(0, 4))
        assert model.n_cached == pos
        assert model.cached_tokens == seq[:pos]
    return records


@pytest.mark.parametrize("seed", SCHEDULE_SEEDS)
def test_detours_leave_no_trace(model: SpecModel, seq: list[int], backend: str, seed: int) -> None:
    """After any extend/truncate sequence, each extend's logits match a fresh evaluation."""
    fresh = model.forward(seq)  # [len(seq), V]: one pass, no cache history
    records = walk_with_detours(model, seq, random.Random(seed))
    worst = max(max_diff(lg, fresh[s : s + len(lg)]) for s, lg in records)
    assert worst <= TOL[backend], f"{backend}: max |diff| {worst:.3g} > {TOL[backend]}"


def test_batch_shape_does_not_change_logits(model: SpecModel, seq: list[int], backend: str):
    """One prefill, token by token, and chunks of 2..8 give the same logits (within TOL).

    This is what makes greedy speculative decoding (verify batches of K+1) reproduce greedy plain
    decoding (one token per step) exactly. llama.cpp's real sequence runs past position 256.
    """
    prefill = model.extend(seq)  # [n, V]
    model.reset()
    one_by_one = torch.cat([model.extend([t]) for t in seq])
    model.reset()
    rng = random.Random(7)
    chunks, pos = [], 0
    while pos < len(seq):
        k = rng.randint(2, 8)
        chunks.append(model.extend(seq[pos : pos + k]))
        pos += k
    chunked = torch.cat(chunks)
    assert max_diff(prefill, one_by_one) <= TOL[backend]
    assert max_diff(chunked, one_by_one) <= TOL[backend]


def test_prefill_builds_the_same_cache_as_extend(model: SpecModel, seq: list[int], backend: str):
    """prefill (no logits asked for) leaves the cache that extend would: the logits that follow
    match a fresh evaluation within TOL, and the bookkeeping is the same."""
    fresh = model.forward(seq)  # [n, V]
    cut = len(seq) // 2
    model.prefill(seq[:cut])
    assert model.n_cached == cut and model.cached_tokens == seq[:cut]
    rest = model.extend(seq[cut:])  # [n - cut, V]
    assert max_diff(rest, fresh[cut:]) <= TOL[backend]
    with pytest.raises(SpecModelError, match="empty"):
        model.prefill([])
    assert model.n_cached == len(seq)


def test_a_saved_cache_restores_bit_for_bit(model: SpecModel, seq: list[int], backend: str):
    """save/restore (a server's RAM prompt cache): after a detour through other tokens and an
    empty cache, the restored cache continues exactly as the saved one would; a backend that
    cannot copy its cache says so with None."""
    cut = len(seq) // 2
    model.prefill(seq[:cut])
    saved = model.save()
    if saved is None:
        assert backend in ("hf", "replay")  # they prefill again instead
        return
    assert saved.tokens == tuple(seq[:cut]) and saved.nbytes > 0
    expected = model.extend(seq[cut:])
    model.reset()
    model.extend(seq[cut:][:7])  # a detour
    model.restore(saved)
    assert model.cached_tokens == seq[:cut]
    assert torch.equal(model.extend(seq[cut:]), expected)
    model.restore(saved)  # twice: a saved cache is not used up
    model.truncate(cut - 3)  # a restored cache rolls back as any other
    assert torch.equal(model.extend(seq[cut - 3 :])[3:], expected)
    other = MockModel(vocab_size=MOCK_V, seed=5)
    with pytest.raises(SpecModelError, match="same model"):
        other.restore(saved)


def test_truncate_at_or_past_the_end_is_a_noop(model: SpecModel, seq: list[int]) -> None:
    model.extend(seq[:6])
    for n in (6, 7, 1000):
        model.truncate(n)
        assert model.n_cached == 6
    expected = model.forward(seq[:7])[6]
    assert max_diff(model.extend(seq[6:7])[0], expected) <= 1e-3
    model.truncate(0)
    assert model.n_cached == 0 and model.cached_tokens == []
    model.truncate(0)  # empty stays empty
    assert model.n_cached == 0


def test_forward_leaves_the_cache_alone(model: SpecModel, seq: list[int], backend: str) -> None:
    model.extend(seq[:10])
    out = model.forward(seq[20:40])
    assert out.shape == (20, model.vocab_size) and out.dtype == torch.float32
    assert model.cached_tokens == seq[:10]
    # The cache still continues the first 10 tokens, bit-for-bit as if forward never ran...
    after = model.extend(seq[10:15])
    model.reset()
    model.extend(seq[:10])
    assert torch.equal(after, model.extend(seq[10:15]))
    # ...and forward equals extending an empty cache.
    model.reset()
    assert max_diff(out, model.extend(seq[20:40])) <= TOL[backend]


# ------------------------------------------------------------------------------- bad input
def test_bad_tokens_and_lengths_raise_and_lose_nothing(model: SpecModel, seq: list[int]) -> None:
    model.extend(seq[:4])
    before = model.forward(seq[:5])[4]
    V = model.vocab_size
    bad_calls = [
        (lambda: model.extend([]), "empty token list"),
        (lambda: model.extend(torch.tensor([], dtype=torch.long)), "empty token list"),
        (lambda: model.extend([seq[4], V]), f"token id {V} is outside the vocabulary"),
        (lambda: model.extend([-1]), "token id -1 is outside the vocabulary"),
        # a batch of one ([1, n], as return_tensors="pt" gives) is one sequence; two are not
        (lambda: model.extend(torch.tensor([[1, 2], [3, 4]])), "one sequence is"),
        (lambda: model.forward([]), "empty token list"),
        (lambda: model.truncate(-1), "truncate's length must be an integer >= 0, got -1"),
        (lambda: model.truncate(2.0), "truncate's length must be an integer >= 0, got 2.0"),
        (lambda: model.extend([seq[0]] * (model.n_ctx - 3)), "exceeds the context window"),
        (lambda: model.forward([seq[0]] * (model.n_ctx + 1)), "exceed the context window"),
    ]
    for call, message in bad_calls:
        with pytest.raises(SpecModelError, match=message):
            call()
        assert model.cached_tokens == seq[:4]  # nothing appended, nothing lost
    assert max_diff(model.extend(seq[4:5])[0], before) <= 1e-3


def test_context_window_is_enforced_exactly() -> None:
    m = MockModel(vocab_size=MOCK_V, n_ctx=16)
    m.extend(list(range(16)))  # exactly full is fine
    with pytest.raises(SpecModelError, match="context window of 16"):
        m.extend([0])
    m.truncate(15)
    m.extend([0])


@pytest.mark.model
def test_llamacpp_small_context_fills_and_refuses(smol_path) -> None:
    m = load_model(
        f"llamacpp:{smol_path}", n_ctx=64, n_batch=16, n_threads=TEST_THREADS
    )  # 64 tokens in 4 decode calls
    try:
        ids = list(range(100, 164))
        full = m.extend(ids)
        with pytest.raises(SpecModelError, match="context window of 64"):
            m.extend([5])
        m.truncate(60)
        assert torch.equal(m.extend(ids[60:]), full[60:])  # rollback freed room; same numbers
    finally:
        m.close()


# ------------------------------------------------------------------------------- loading
@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("smollm2-135m", SpecModelError, "no backend prefix.*hf, llamacpp, mock"),
        ("vllm:smollm2-135m", SpecModelError, "unknown backend 'vllm'.*hf, llamacpp, mock"),
        ("hf:", SpecModelError, "names no model"),
        ("llamacpp:/no/such/model.gguf", ModelFetchError, "known models:.*smollm2-135m"),
        ("hf:no-such-model", ModelFetchError, "no-such-model.*known models"),
        ("mock:vocab=abc", SpecModelError, "not a number"),
        ("mock:colour=3", SpecModelError, "bad mock option"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        load_model(spec)


def test_mock_spec_builds_the_mock() -> None:
    m = load_model("mock:vocab=32,seed=3", n_ctx=100)
    assert isinstance(m, MockModel) and m.vocab_size == 32 and m.n_ctx == 100
    assert torch.equal(m.forward([1, 2, 3]), MockModel(32, seed=3).forward([1, 2, 3]))
    assert load_model("mock:").vocab_size == MOCK_V  # defaults


@pytest.mark.model  # copies the real model file
@pytest.mark.parametrize("backend", ["hf", "llamacpp"])
def test_damaged_gguf_is_a_python_error(backend: str, smol_path, tmp_path) -> None:
    """llama.cpp may abort the process on a damaged file; we must refuse it first."""
    truncated = tmp_path / "truncated.gguf"
    with smol_path.open("rb") as f:
        truncated.write_bytes(f.read(2 * 1024 * 1024))
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(CorruptModelError, match=r"truncated|not a readable GGUF"):
        load_model(f"{backend}:{truncated}")
    with pytest.raises(CorruptModelError, match="not a GGUF file"):
        load_model(f"{backend}:{noise}")


def test_llamacpp_refuses_a_directory(tmp_path) -> None:
    with pytest.raises(SpecModelError, match=r"llama.cpp needs a .gguf file"):
        load_model(f"llamacpp:{tmp_path}")


# ------------------------------------------------------------------ HF vs llama.cpp agreement
@pytest.mark.model
def test_hf_and_llamacpp_agree_on_the_greedy_token(
    smol_hf: SpecModel, smol_llamacpp: SpecModel, smol_prompt_ids: list[int]
) -> None:
    """Same weights, different numerics (fp32 dequantized vs Q4_1 kernels): teacher-forced over
    the 292 positions of a real chat the argmax agreed at 96.2% of positions (281/292) when
    measured; max |logit diff| was 3.0, the Q4_1 quantization error. A wiring bug (wrong
    positions, wrong tokenizer, stale cache) drops the agreement to a few percent."""
    hf = smol_hf.forward(smol_prompt_ids)  # [n, V]
    lc = smol_llamacpp.forward(smol_prompt_ids)  # [n, V]
    agree = (hf.argmax(-1) == lc.argmax(-1)).float().mean().item()
    assert agree >= 0.90, f"greedy agreement {agree:.1%}"
