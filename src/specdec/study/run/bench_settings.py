"""What one bench run is: its settings (`BenchConfig`, its out-of-process `Peers`), how they
are written to and read from an artifact's flat `config` block (`CONFIG_KEYS`), the named pairs
(`CONFIGS`), and which vendored prompts a run takes (`select_prompts`). bench.py runs it;
methods.py builds its methods from it (so this imports neither).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from specdec.backends import parse_spec
from specdec.backends.configs import CONFIGS as PAIRS
from specdec.core.checks import check_int
from specdec.core.config import DRAFTERS, WARP_FIELDS, SpecConfig, Warp, check_k, is_policy
from specdec.study.artifacts import MAIN_METHODS
from specdec.study.engines import anchors, endpoint
from specdec.study.run import prompts as prompt_set

#: The drafters a bench method may use: the core's, plus "wrong-prediction", the prediction
#: drafter given another task's file (the leg that shows a wrong prediction costs nothing).
WRONG_PREDICTION = "wrong-prediction"
BENCH_DRAFTERS = (*DRAFTERS, WRONG_PREDICTION)


def core_drafter(drafter: str) -> str:
    """The core drafter a bench drafter runs ("wrong-prediction" is the prediction drafter)."""
    return "prediction" if drafter == WRONG_PREDICTION else drafter


def parse_variant(text: str) -> tuple[str, int | str]:
    """'DRAFTER:K' -> (drafter, K), e.g. 'lookup:auto' -> ('lookup', 'auto')."""
    drafter, sep, k = text.partition(":")
    if not sep or drafter not in BENCH_DRAFTERS:
        raise ValueError(
            f"variant {text!r} must be DRAFTER:K with DRAFTER one of {', '.join(BENCH_DRAFTERS)} "
            "and K an int >= 1, 'auto' or 'schedule' (e.g. lookup:auto)"
        )
    kk: int | str = int(k) if k.isdigit() else k
    check_k(kk)
    return drafter, kk


#: Named (draft, target) pairs, as in the paper's Table 2 but on the models we have; configs.py
#: is the one definition (gate and microbench read it too).
CONFIGS: dict[str, tuple[str, str]] = {n: (c.draft, c.target) for n, c in PAIRS.items()}
CUSTOM = "custom"  # the config name of a --draft/--target pair
#: --compare: transformers' assisted generation, or llama.cpp's own server (engines/anchors.py)
COMPARES = ("hf-assisted", "llama-server")
METHODS = MAIN_METHODS  # in run order; variants follow
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # goes into file names


@dataclass(frozen=True)
class Peers:
    """What runs beside or instead of the in-process methods: a --compare anchor, OpenAI-compatible
    endpoints, llama.cpp's servers, specdec's own servers (--serve). Checks its fields on
    construction; BenchConfig checks them against the models and the prompts."""

    compare: str | None = None  # None, "hf-assisted" or "llama-server" (COMPARES)
    # OpenAI-compatible servers (engines/endpoint.py) that stand in for the in-process methods:
    # `endpoint` runs "speculative", `endpoint_baseline` runs "baseline". With both, no model
    # is loaded (the target's tokenizer only, to count tokens where `usage` is missing).
    endpoint: str | None = None
    endpoint_baseline: str | None = None
    endpoint_model: str | None = None  # the requests' "model" (None: the server's first)
    endpoint_api: str = "chat"  # chat or completions (endpoint.APIS)
    # --compare llama-server: the llama-server methods run beside ours (anchors.SERVER_MODES)
    llama_server: tuple[str, ...] = ()
    # --serve: baseline and speculative run through `specdec serve` processes the bench starts
    # (anchors.SpecdecServer): the served comparison against llama-server, both warm
    served: bool = False

    def __post_init__(self) -> None:
        for url in (self.endpoint, self.endpoint_baseline):
            if url is not None:
                endpoint.Endpoint(url, api=self.endpoint_api)  # checks the URL and the api
        if self.served and (self.endpoint or self.endpoint_baseline):
            raise ValueError(
                "--serve starts specdec's own servers for the baseline and the speculative "
                "method; drop --endpoint/--endpoint-baseline, or drop --serve"
            )
        if self.compare is not None and self.compare not in COMPARES:
            raise ValueError(f"unknown --compare {self.compare!r}; choose from {COMPARES}")
        if self.compare == "llama-server" and not self.llama_server:
            raise ValueError("--compare llama-server needs at least one llama-server mode")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; every field is a `specdec bench` flag, those of one component grouped
    in its own record: `spec` (the speculative method), `warp` (every method's sampling), `peers`
    (what runs out of process). Each record checks its own fields; this checks them together,
    on construction. `to_json` writes the artifact's flat `config` block, `from_json` reads it."""

    name: str
    draft: str  # model spec, BACKEND:NAME_OR_PATH
    target: str
    # The speculative method: a named drafter (core.config.DRAFTERS) and K (an int >= 1, "auto"
    # or "schedule"), k_max, p_min; the variants reuse its k_max and p_min.
    spec: SpecConfig = field(default_factory=lambda: SpecConfig("model", 4))
    warp: Warp = field(default_factory=Warp)  # temperature, top_k, ...: every method's
    n_prompts: int = 30
    warmup: int = 2
    max_new_tokens: int = 128
    device: str | None = None  # None: best available (specdec.core.device.get_device)
    deterministic: bool = False  # batch-invariant llama.cpp numerics (backends.load_model)
    # Extra speculative methods run on the same prompts, "DRAFTER:K" each (e.g. "lookup:auto"):
    # one run holds every method of a comparison table, so their ratios are valid.
    variants: tuple[str, ...] = ()
    # Prompt categories to run (prompts.jsonl's "category"); () = every prompt. Applied before
    # n_prompts: the run takes the first n_prompts prompts of these categories, in file order.
    categories: tuple[str, ...] = ()
    peers: Peers = field(default_factory=Peers)

    @property
    def sessions(self) -> bool:
        """A run of multi-turn edit sessions (the "session" category): servers keep their
        prompt cache on (specdec serve --prompt-cache, llama-server cache_prompt), as an
        editor's server does between the turns of a conversation."""
        return SESSION in self.categories

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SAFE_NAME.match(self.name):
            raise ValueError(f"config name {self.name!r} must be letters, digits, '_', '.', '-'")
        backends = (parse_spec(self.draft)[0], parse_spec(self.target)[0])
        if not isinstance(self.spec.drafter, str) or is_policy(self.spec.k):
            raise ValueError(
                f"a bench names its drafter ({', '.join(DRAFTERS)}) and its K (an int, 'auto' "
                f"or 'schedule'), which its artifact records; got {self.spec}"
            )
        for v in self.variants:
            parse_variant(v)
        self._check_prompts()
        peers = self.peers
        if peers.llama_server:
            # the names only: servers_for checks the builds when the run starts them
            anchors.check_modes(
                peers.llama_server, self.target, self.draft, tools=True, built=False
            )
        if self.sessions and (peers.endpoint_api != "chat" or peers.compare == "hf-assisted"):
            raise ValueError(
                f"the {SESSION!r} category is a chat conversation: it needs --endpoint-api chat "
                "and no --compare hf-assisted"
            )
        if peers.compare == "hf-assisted" and backends != ("hf", "hf"):
            raise ValueError(
                "--compare hf-assisted runs transformers' generate(assistant_model=...), so "
                f"both models must use the hf backend; config {self.name!r} pairs draft "
                f"{self.draft} with target {self.target} (use --config all_hf, or "
                "--draft hf:... --target hf:...)"
            )

    def _check_prompts(self) -> None:
        """categories, n_prompts, warmup and max_new_tokens against the prompt set."""
        if isinstance(self.categories, str) or not all(isinstance(c, str) for c in self.categories):
            raise ValueError(f"categories must be a tuple of names, got {self.categories!r}")
        n_available = len(select_prompts(self.categories))  # checks the category names
        what = "prompts"
        if self.categories:
            what = f"prompts (of categories {', '.join(self.categories)})"
        check_int(what, self.n_prompts, 1, n_available)
        check_int("warmup", self.warmup, 0)
        if self.warmup >= self.n_prompts:
            raise ValueError(
                f"warmup ({self.warmup}) must be < prompts ({self.n_prompts}): at least one "
                "prompt has to be recorded"
            )
        check_int("max_new_tokens", self.max_new_tokens, 1)

    def to_json(self) -> dict[str, Any]:
        """The artifact's `config` block: every setting under its flag's name, flat, in
        CONFIG_KEYS' order (tuples stay tuples; write_json makes them lists); those of
        LATER_WARP_KEYS only when set."""
        records = {"": self, "spec": self.spec, "warp": self.warp, "peers": self.peers}
        block = {}
        for key, part in CONFIG_KEYS:
            value = getattr(records[part], key)
            if value is not None or (key, part) not in LATER_WARP_KEYS:
                block[key] = value
        return block

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> BenchConfig:
        """The BenchConfig a `config` block records, checked as on construction: `to_json`'s
        inverse. A key the block lacks takes its default; "engines" (what the run started, not
        a setting) is passed over; JSON's lists are read back as the tuples they were."""
        home = dict(CONFIG_KEYS)
        unknown = [key for key in config if key not in home and key != "engines"]
        if unknown:
            raise ValueError(f"not a bench setting: {', '.join(unknown)}")
        kw: dict[str, dict[str, Any]] = {part: {} for part in set(home.values())}
        for key, value in config.items():
            if key in home:
                kw[home[key]][key] = tuple(value) if isinstance(value, list) else value
        defaults = _defaults()
        parts = {part: replace(defaults[part], **given) for part, given in kw.items() if part}
        return cls(**kw[""], **parts)


#: Warp's fields the first artifacts had no key for (min_p, typical_p, and any added since),
#: after the others: written only when set, so that a block of a run from before them, which
#: ran with them off, reads back byte for byte.
LATER_WARP_KEYS = tuple(
    (name, "warp") for name in WARP_FIELDS if name not in ("temperature", "top_k", "top_p")
)
#: The artifact's `config` keys (BenchConfig.to_json) in the order its files have always had,
#: each with the record of a BenchConfig that holds it ("": the config itself). The report
#: (study/present) and the committed results read these names: keep them.
CONFIG_KEYS: tuple[tuple[str, str], ...] = (
    ("name", ""),
    ("draft", ""),
    ("target", ""),
    ("k", "spec"),
    ("temperature", "warp"),
    ("top_k", "warp"),
    ("top_p", "warp"),
    ("n_prompts", ""),
    ("warmup", ""),
    ("max_new_tokens", ""),
    ("compare", "peers"),
    ("device", ""),
    ("drafter", "spec"),
    ("k_max", "spec"),
    ("p_min", "spec"),
    ("deterministic", ""),
    ("variants", ""),
    ("categories", ""),
    ("endpoint", "peers"),
    ("endpoint_baseline", "peers"),
    ("endpoint_model", "peers"),
    ("endpoint_api", "peers"),
    ("llama_server", "peers"),
    ("served", "peers"),
    *LATER_WARP_KEYS,
)


def config_defaults() -> dict[str, Any]:
    """The `config` keys that have a default, with it, in CONFIG_KEYS' order: what a run from
    before a flag existed ran with (scripts/migrate_artifacts.py fills them in)."""
    own = _defaults()
    out = {}
    for key, part in CONFIG_KEYS:
        if (key, part) in LATER_WARP_KEYS:  # off unless written
            continue
        value = getattr(own[part], key) if part else own[key]
        if value is not MISSING:
            out[key] = value
    return out


def _defaults() -> dict[str, Any]:
    """BenchConfig's fields' defaults, its records built; MISSING for name, draft and target."""
    return {
        f.name: f.default if f.default_factory is MISSING else f.default_factory()
        for f in fields(BenchConfig)
    }


def prompt_categories() -> tuple[str, ...]:
    """The categories of the vendored prompt set, in order of first appearance."""
    return tuple(dict.fromkeys(p.category for p in prompt_set.load_prompts()))


#: The categories --category accepts: the prompt set's, and "session" (multi-turn edit sessions:
#: study/run/data/sessions.jsonl, run by the session protocol below; alone, not with others)
SESSION = prompt_set.SESSION
CATEGORIES = (*prompt_categories(), SESSION)


def parse_categories(text: str | None) -> tuple[str, ...]:
    """'coding,reasoning' -> ('coding', 'reasoning'); None or '' -> () (every prompt)."""
    if text is None:
        return ()
    return tuple(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))


def select_prompts(
    categories: Sequence[str] = (), limit: int | None = None
) -> list[prompt_set.Prompt]:
    """The first `limit` vendored prompts of `categories` (all when empty), in file order.
    ValueError naming the valid categories for an unknown one. "session" selects the edit
    sessions, each by its opening turn (Session.opening), and runs alone."""
    if SESSION in categories:
        if len(categories) > 1:
            raise ValueError(
                f"the {SESSION!r} category runs alone (a session is several requests, with its "
                "own protocol); bench it in a run of its own"
            )
        openings = [s.opening() for s in prompt_set.load_sessions()]
        return openings[:limit] if limit is not None else openings
    prompts = prompt_set.load_prompts()
    valid = (*dict.fromkeys(p.category for p in prompts), SESSION)
    unknown = [c for c in categories if c not in valid]
    if unknown:
        raise ValueError(
            f"unknown prompt categor{'ies' if len(unknown) > 1 else 'y'} "
            f"{', '.join(map(repr, unknown))}; choose from {', '.join(valid)}"
        )
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    return prompts[:limit] if limit is not None else prompts


def bench_config(
    name: str | None, draft: str | None = None, target: str | None = None, **settings: Any
) -> BenchConfig:
    """A named pair (`CONFIGS`), or a custom one from `draft` + `target`; `settings` are the
    remaining BenchConfig fields. (backends.configs.resolve_config looks up a named pair only.)"""
    if (draft is None) != (target is None):
        raise ValueError("give both --draft and --target (or neither, with --config NAME)")
    if draft is not None:
        if name not in (None, CUSTOM):
            raise ValueError(
                f"--config {name} already fixes the pair; drop --draft/--target, or pass them "
                f"alone (the config is then named {CUSTOM!r})"
            )
        return BenchConfig(CUSTOM, draft, target, **settings)
    if name is None:
        raise ValueError(f"give --config NAME ({', '.join(CONFIGS)}) or --draft and --target")
    if name not in CONFIGS:
        hint = " with --draft SPEC --target SPEC" if name == CUSTOM else ""
        raise ValueError(f"unknown config {name!r}{hint}; choose from {', '.join(CONFIGS)}")
    return BenchConfig(name, *CONFIGS[name], **settings)


def tag_suffix(tag: str | None) -> str:
    """'_<tag>' for a file name ('' for None); ValueError for a tag unsafe in file names."""
    if tag is None:
        return ""
    if not _SAFE_NAME.match(tag):
        raise ValueError(f"--tag {tag!r} must be letters, digits, '_', '.', '-'")
    return f"_{tag}"
