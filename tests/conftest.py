"""Shared fixtures: the real test model, loaded once per session, and the suite's markers.

    smol_path        Path of smollm2-135m.gguf (SmolLM2-135M-Instruct Q4_1, vocab 49152), fetched
                     into $SPECDEC_HOME on first use.
    smol_hf          load_model("hf:smollm2-135m"): dequantized, fp32, CPU, TEST_THREADS threads.
    smol_llamacpp    load_model("llamacpp:smollm2-135m"): Q4_1 in llama.cpp, default settings
                     (TEST_THREADS threads).
    smol_prompt_ids  ~300 token ids of real text: a chat-templated prompt plus an answer.
    pair             (target, draft) mock models, module-wide, shaped by `pair_spec` (a module
                     overrides that fixture for another vocabulary, scale or noise).
    qwen05_path      Path of qwen2.5-coder-0.5b.gguf, fetched on first use.
A test that needs a model fetches it (`fetched`); where it cannot, the test fails, never skips.

The session runs in a $SPECDEC_HOME of its own (`_hermetic_home`): the caches anyone can rebuild
(models, wheels, conversions, locks) are links to the real ones, and the machine's state is empty:
no built anchor, no stored k=auto curve. Why: a test that passed only where someone had run
`specdec anchors build` (or whose k=auto read what an earlier run stored) passed on the
developer's machine and failed on a fresh one. A test that needs a build says so with
@pytest.mark.anchors and sees the real home.

The two models are session-wide (loading the HF one takes ~10 s): a test or a module fixture
that needs one asks for these rather than loading its own. Every test that asks for one gets it
with an EMPTY cache: the fixture resets it before handing it out.

Markers (pyproject.toml), so that `make test-fast` can leave out what is slow by nature:
    model   needs a real model: added here to every test that uses smol_path (every fixture
            above does); a test that loads one itself (other settings, a subprocess, the CLI)
            says so with @pytest.mark.model
    stats   a statistical test: thousands of seeded generations or draws, an explicit
            statistic and threshold
    slow    slow for another reason (a subprocess CLI run, a build, a long soak)
`make test` runs them all.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from schedule import DurationRecorder, make_scheduler, wants_recording
from support import TEST_THREADS, PairSpec

from specdec.backends import load_model
from specdec.backends.mock import MockModel
from specdec.backends.registry import specdec_home
from specdec.core.model import SpecModel

#: What the hermetic home links to the real one: caches, each rebuilt from pinned sources if lost
#: (registry models, built wheels, pinned sources, tokenizer and config conversions, fetch
#: locks). Everything else (anchors, k=auto's costs) starts empty.
SHARED_CACHES = ("models", "wheels", "sdists", "tokenizers", "configs", "locks")


def _hermetic_home() -> Path:
    """A fresh $SPECDEC_HOME for this session (exported, so subprocesses use it too), with the
    caches linked in; the real home is returned."""
    real = specdec_home()
    home = Path(tempfile.mkdtemp(prefix="specdec-test-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    for name in SHARED_CACHES:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    os.environ["SPECDEC_HOME"] = str(home)
    return real


REAL_HOME = _hermetic_home()


SMOL = "smollm2-135m"
# llama.cpp's tiled K-quant matmul off for the whole test process: it reads the switch once per
# process, and default-mode and deterministic models share this one (backends/llamacpp.py). It
# changes nothing for smollm2's Q4_1 weights, nor on a CPU with AMX.
os.environ.setdefault("GGML_CPU_TILED_MM", "0")

_QUESTION = "Explain what speculative decoding is and why its output is lossless."
# An answer long enough to carry the contract tests past position 256, where llama.cpp's
# flash-attention kernels would change code path for an f16 K cache (backends/llamacpp.py).
_ANSWER = (
    "Speculative decoding speeds up text generation by letting a small draft model guess several "
    "tokens ahead, and then asking the large target model to check all of the guesses in a single "
    "forward pass. Because the target scores every drafted position at once, a round that accepts "
    "four guesses costs roughly one step of the big model instead of four. The accept rule is the "
    "clever part: each drafted token is kept with probability min(1, p/q), where p is the target's "
    "probability and q the draft's, and when a guess is rejected a replacement is sampled from the "
    "normalized positive part of p minus q. A short calculation shows that every emitted token is "
    "then distributed exactly as if the target had produced it alone, which is why the method is "
    "called lossless: it changes the speed, never the distribution. In practice the speedup "
    "depends on how often the draft agrees with the target, on how cheap the draft is, "
    "and on how well the "
    "hardware turns a batch of several tokens into one pass. On a laptop CPU a verify pass of five "
    "tokens may cost almost as much as five single steps, and then no draft can help; on a GPU the "
    "same pass is nearly free, and acceptance rates of one half already pay off."
)


#: Fixtures that need a real model: a test that uses one (directly or through another fixture)
#: is marked `model`.
MODEL_FIXTURES = frozenset({"smol_path", "qwen05_path"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` (make test's two phases): whole modules, costliest first (schedule.py)"""
    return make_scheduler(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_configure(config: pytest.Config) -> None:
    if wants_recording(config):
        config.pluginmanager.register(DurationRecorder(), "specdec-durations")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(autouse=True)
def _real_home_for_builds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `anchors` (it needs `specdec anchors build`) sees the real home's builds."""
    if request.node.get_closest_marker("anchors") is not None:
        monkeypatch.setenv("SPECDEC_HOME", str(REAL_HOME))


def fetched(name: str) -> Path:
    """The cached file of registry model `name`, fetched first if needed (ModelFetchError, a
    failure, when it cannot be: a missing model never skips a test)."""
    from specdec.backends.registry import resolve

    return resolve(name, progress=False)


@pytest.fixture(scope="module")
def pair_spec() -> PairSpec:
    """The shape of `pair`'s models; a module that wants another overrides this fixture."""
    return PairSpec()


@pytest.fixture(scope="module")
def pair(pair_spec: PairSpec) -> tuple[MockModel, MockModel]:
    """(target, draft) mock models for a module of mock-model tests, shaped by `pair_spec`: the
    target has vocabulary `v` and logit scale `scale`, the draft is the target plus Gaussian
    noise `noise`."""
    scale = {} if pair_spec.scale is None else {"scale": pair_spec.scale}
    target = MockModel(pair_spec.v, seed=0, **scale)
    return target, MockModel.near(target, noise=pair_spec.noise, seed=1)


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return fetched(SMOL)


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """qwen2.5-coder-0.5b.gguf (the default draft, vocabulary 151936), fetched if needed."""
    return fetched("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def _smol_hf_session(smol_path: Path) -> Iterator[SpecModel]:
    model = load_model(f"hf:{SMOL}", n_threads=TEST_THREADS)  # torch.set_num_threads: global
    yield model
    model.close()


@pytest.fixture(scope="session")
def _smol_llamacpp_session(smol_path: Path) -> Iterator[SpecModel]:
    model = load_model(f"llamacpp:{SMOL}", n_threads=TEST_THREADS)
    yield model
    model.close()


@pytest.fixture
def smol_hf(_smol_hf_session: SpecModel) -> SpecModel:
    _smol_hf_session.reset()
    return _smol_hf_session


@pytest.fixture
def smol_llamacpp(_smol_llamacpp_session: SpecModel) -> SpecModel:
    _smol_llamacpp_session.reset()
    return _smol_llamacpp_session


@pytest.fixture(scope="session")
def smol_prompt_ids(_smol_llamacpp_session: SpecModel) -> list[int]:
    tok = _smol_llamacpp_session.tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _ANSWER}],
        tokenize=True,
        return_dict=False,
    )
    return list(ids)
