"""What one generation is asked to do, validated once, on construction.

    Warp        how logits become a distribution: temperature, top-k, top-p, min-p. Applied
                identically to the draft and the target, so the output is exactly the warped
                target.
    SpecConfig  how speculation runs: drafter, K (an int, "auto", "schedule" or a KPolicy),
                k_max, p_min. Everything in it looks only at the draft side and at costs, so no
                setting changes the output distribution.

Every layer that takes these settings (the decoder, the bench, the server, the CLI) builds one of
these and lets it check the values: one rule per setting, one error message. Torch-free, so the
CLI can declare its flags without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from specdec.core.checks import check_int

if TYPE_CHECKING:  # annotations only: the protocols module imports torch
    from specdec.core.protocols import Drafter, KPolicy

#: The drafters by name (core.drafters) and what each runs: the one place that says it (a new
#: drafter is a row here and a case in decode.make_drafter).
#:   lookup      prompt lookup over the context (and a draft pool)
#:   prediction  the request's prediction, else prompt lookup
#:   model       a draft model
#:   composite   prompt lookup, else the draft model
DRAFTER_RUNS: dict[str, frozenset[str]] = {
    "lookup": frozenset({"lookup"}),
    "prediction": frozenset({"prediction", "lookup"}),
    "model": frozenset({"model"}),
    "composite": frozenset({"lookup", "model"}),
}
DRAFTERS = tuple(DRAFTER_RUNS)
#: The named drafters that run a draft model.
MODEL_DRAFTERS = tuple(d for d, runs in DRAFTER_RUNS.items() if "model" in runs)
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

DrafterName = Literal["model", "lookup", "composite", "prediction"]
KName = Literal["auto", "schedule"]


def is_policy(k: object) -> bool:
    """A KPolicy object passed as k (core.policy), e.g. a CostModelK with a known cost curve."""
    return all(hasattr(k, m) for m in ("choose", "observe"))


def check_k(k: Any) -> None:
    """K: an int >= 1, 'auto', 'schedule' or a KPolicy object."""
    if is_policy(k) or (isinstance(k, str) and k in NAMED_K):
        return
    check_int("k (draft tokens per round)", k, 1, alternatives="'auto', 'schedule'")


@dataclass(frozen=True)
class Warp:
    """How logits become a distribution (see `core.sampling.probs_from_logits`)."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1)
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1
        ):
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or so close to 0 that dividing by it overflows."""
        return self.temperature < GREEDY_BELOW


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
        p = self.p_min
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1
        ):
            raise ValueError(f"p_min must be in [0, 1), got {p!r}")

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
        if kind in ("lookup", "prediction") and has_draft_model:
            raise ValueError(f"drafter {kind!r} uses no draft model; drop draft= (or --draft)")
        return kind


def default_drafter(
    drafter: DrafterName | Drafter | None, has_draft_model: bool
) -> DrafterName | Drafter | None:
    """`drafter`, or, when none is named, the draft model's when one is given (else none)."""
    if drafter is None and has_draft_model:
        return "model"
    return drafter


Config = TypeVar("Config", SpecConfig, Warp)


def config_from(
    given: Config | None, cls: type[Config], name: str, keywords: Mapping[str, Any]
) -> Config:
    """`given` (a SpecConfig or Warp passed as `name`=), else one built from the `keywords` that
    were passed (not None); ValueError when both are, since one would silently win."""
    passed = {key: v for key, v in keywords.items() if v is not None}
    if given is None:
        return cls(**passed)
    if not isinstance(given, cls):
        raise ValueError(f"{name}= takes a {cls.__name__}, got {type(given).__name__}")
    if passed:
        raise ValueError(
            f"pass either {name}= or its keywords ({', '.join(passed)}), not both: "
            f"{name}={given} already sets them"
        )
    return given
