"""What one generation is asked to do, validated once, on construction.

    Warp        how logits become a distribution: temperature, top-k, typical-p, top-p, min-p.
                Applied identically to the draft and the target, so the output is exactly the
                warped target.
    SpecConfig  how speculation runs: drafter, K (an int, "auto", "schedule" or a KPolicy),
                k_max, p_min. Everything in it looks only at the draft side and at costs, so no
                setting changes the output distribution.

Every layer that takes these settings (the decoder, the bench, the server, the CLI) builds one of
these and lets it check the values: one rule per setting, one error message. Torch-free, so the
CLI can declare its flags without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from specdec.core.checks import check_fraction, check_int

if TYPE_CHECKING:  # annotations only: the protocols module imports torch
    from specdec.core.protocols import Drafter, KPolicy

#: The drafters by name (core.drafters, core.prediction), in the order the CLI and the server
#: list them: the one place that names them. A Literal, so a type checker knows the names;
#: DRAFTERS reads them back at run time. A new drafter is a name here, its row in DRAFTER_RUNS
#: and a case in core.generate.make_drafter (tests/test_api.py holds the two to each other).
DrafterName = Literal["lookup", "prediction", "model", "composite"]
DRAFTERS: tuple[DrafterName, ...] = get_args(DrafterName)
#: What each named drafter runs, from which every set of drafters below derives:
#:   lookup      prompt lookup over the context (and a draft pool)
#:   prediction  the request's prediction, else prompt lookup
#:   model       a draft model
#:   composite   prompt lookup, else the draft model
DRAFTER_RUNS: dict[DrafterName, frozenset[str]] = {
    "lookup": frozenset({"lookup"}),
    "prediction": frozenset({"prediction", "lookup"}),
    "model": frozenset({"model"}),
    "composite": frozenset({"lookup", "model"}),
}
#: The named drafters that run a draft model.
MODEL_DRAFTERS = tuple(d for d, runs in DRAFTER_RUNS.items() if "model" in runs)
#: The named drafters that run none (their drafts cost nothing to make: K_MAX_FREE).
FREE_DRAFTERS = tuple(d for d, runs in DRAFTER_RUNS.items() if "model" not in runs)
#: The named drafters that run prompt lookup, so draft from a draft pool too (serve.draft_pools).
LOOKUP_DRAFTERS = tuple(d for d, runs in DRAFTER_RUNS.items() if "lookup" in runs)
#: The named K policies (core.policy): cost-model K, transformers' +2/-1 schedule.
NAMED_K = ("auto", "schedule")
#: Default largest K: with a draft model, each drafted token costs a draft step; the model-free
#: drafters' drafts cost nothing to make, and a copy is accepted whole however long it is.
K_MAX_MODEL, K_MAX_FREE = 8, 64
#: Temperatures below this sample as greedy. Why: logits / 1e-39 overflow float32 to inf and the
#: softmax to NaN; vLLM draws the same line (its _SAMPLING_EPS is 1e-5).
GREEDY_BELOW = 1e-5

KName = Literal["auto", "schedule"]


def is_policy(k: object) -> bool:
    """A KPolicy object passed as k (core.policy), e.g. a CostModelK with a known cost curve."""
    return all(hasattr(k, m) for m in ("choose", "observe"))


def parse_k(text: str) -> int | str:
    """K as written on a command line: an int >= 1, 'auto' or 'schedule'; ValueError otherwise."""
    if text in NAMED_K:
        return text
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"expected an int >= 1, 'auto' or 'schedule', got {text!r}") from None
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    return k


def check_k(k: Any) -> None:
    """K: an int >= 1, 'auto', 'schedule' or a KPolicy object."""
    if is_policy(k) or (isinstance(k, str) and k in NAMED_K):
        return
    check_int("k (draft tokens per round)", k, 1, alternatives="'auto', 'schedule'")


def _flag(kind: type, help: str, off: float | None = None) -> dict[str, Any]:
    """A Warp field's metadata: its command-line flag's type and help (cli.args makes one flag
    per field, `--top-p` for top_p) and the value that switches it off where a peer engine takes
    no None (transformers' generate, llama.cpp)."""
    return {"type": kind, "help": help, "off": off}


@dataclass(frozen=True)
class Warp:
    """How logits become a distribution (`core.sampling.warped`): temperature, then the
    truncations in llama.cpp's order, top-k, typical-p, top-p, min-p. One field per setting: the
    CLI's flags (cli.args), the server's request fields (serve.wire) and the bench's endpoint
    requests (study.engines.endpoint) are these fields by name."""

    temperature: float = field(
        default=0.8,
        metadata=_flag(float, "sampling temperature >= 0, 0 = greedy (float; default 0.8)"),
    )
    top_k: int | None = field(
        default=None,
        metadata=_flag(int, "keep the k most likely tokens, k >= 1 (int; default off)", off=0),
    )
    top_p: float | None = field(
        default=None, metadata=_flag(float, "nucleus mass in (0, 1] (float; default off)", off=1.0)
    )
    min_p: float | None = field(
        default=None,
        metadata=_flag(
            float,
            "keep tokens with p >= min_p x the likeliest token's, in [0, 1] (float; default off)",
            off=0.0,
        ),
    )
    typical_p: float | None = field(
        default=None,
        metadata=_flag(
            float,
            "locally typical sampling: keep the tokens whose -log p is nearest the entropy, "
            "this much mass of them, in (0, 1], 1 = off (float; default off)",
            off=1.0,
        ),
    )

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1)
        check_fraction("top_p", self.top_p, low_open=True)
        check_fraction("min_p", self.min_p)
        check_fraction("typical_p", self.typical_p, low_open=True)

    def explicit(self) -> dict[str, Any]:
        """Every field by name, one that is off given as the value that switches it off (its
        "off": top_k 0, top_p 1.0, ...): for a peer engine whose own defaults are not off
        (transformers' top_k 50, llama-server's chain)."""
        return {
            f.name: f.metadata["off"] if (v := getattr(self, f.name)) is None else v
            for f in fields(self)
        }

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or so close to 0 that dividing by it overflows."""
        return self.temperature < GREEDY_BELOW


#: Warp's fields by name, in order: what the layers that carry the settings map by name.
WARP_FIELDS = tuple(f.name for f in fields(Warp))


@dataclass(frozen=True)
class SpecConfig:
    """How speculation runs. `drafter=None` with no draft model is target-only decoding.

    drafter  "model" (a draft model; the default when one is given), "lookup" (prompt lookup),
             "composite" (lookup, else the model), "prediction" (the prediction passed to
             `stream`, else lookup), or a Drafter object (core.drafters). Whatever the drafter,
             a prediction, when given, is drafted from first.
    k        draft tokens per round: an int >= 1, "auto" (K in 0..k_max from measured costs,
             core.policy.CostModelK), "schedule" (transformers' +2/-1), or a KPolicy object
    k_max    the largest K for "auto" and "schedule"; None: K_MAX_MODEL with a draft model,
             K_MAX_FREE for the model-free drafters (lookup, prediction), whose long drafts cost
             nothing to make and pay on copies (core.policy.CostModelK.depth_cap)
    p_min    stop drafting when the draft's top probability falls below it (llama.cpp's p-min)
    """

    drafter: DrafterName | Drafter | None = None
    k: int | KName | KPolicy = 4
    k_max: int | None = None
    p_min: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.drafter, str) and self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; use one of {', '.join(DRAFTERS)}")
        check_k(self.k)
        if self.k_max is not None:
            check_int("k_max", self.k_max, 1)
        check_fraction("p_min", self.p_min, high_open=True)

    def resolved_k_max(self, uses_model: bool) -> int:
        """k_max, or its default for a drafter that does (not) run a draft model."""
        if self.k_max is not None:
            return self.k_max
        return K_MAX_MODEL if uses_model else K_MAX_FREE

    def drafter_for(self, has_draft_model: bool) -> DrafterName | Drafter | None:
        """The drafter this config runs with (`default_drafter`); ValueError when the drafter
        and the draft model do not go together."""
        kind = default_drafter(self.drafter, has_draft_model)
        if kind in MODEL_DRAFTERS and not has_draft_model:
            raise ValueError(f"drafter {kind!r} needs a draft model; pass draft= (or --draft)")
        if kind in FREE_DRAFTERS and has_draft_model:
            raise ValueError(f"drafter {kind!r} uses no draft model; drop draft= (or --draft)")
        return kind


def default_drafter(
    drafter: DrafterName | Drafter | None, has_draft_model: bool
) -> DrafterName | Drafter | None:
    """`drafter`, or, when none is named, the draft model's when one is given (else none)."""
    if drafter is None and has_draft_model:
        return "model"
    return drafter


def runs_as(
    drafter: DrafterName | Drafter | None, has_prediction: bool
) -> DrafterName | Drafter | None:
    """The drafter to name to core.generate for `drafter` where a prediction may or may not come
    with a generation (a server's request, a bench's prompt, a replay's task): "prediction" is
    the prediction, else prompt lookup (DRAFTER_RUNS), so without one it runs as "lookup"; with
    one it is itself, which core.generate.make_drafter builds as "lookup" with the prediction
    drafted first (a given prediction goes first whatever the drafter). Every other drafter
    runs as itself. make_drafter refuses "prediction" with no prediction: a caller who names it
    directly has a prediction to pass."""
    if drafter == "prediction" and not has_prediction:
        return "lookup"
    return drafter
