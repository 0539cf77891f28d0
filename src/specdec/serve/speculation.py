"""The `speculation` extension: a request's drafter, k and k_max over the server's defaults.

The settings are core.config.SpecConfig's; this module adds only what the server needs on top:
the start-up SpecConfig with whether a draft model is loaded (`SpecDefaults`), a request's
SpecConfig resolved against it (`resolve_speculation` -> `Speculation`: what `generate.stream`
runs with, and the settings the response echoes), and the wire's name for no drafter, "none"
(core's drafter None), which is read and written here alone. docs/api-extensions.md has the
user's view, with the same rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from specdec.core.checks import check_int, shown
from specdec.core.config import (
    DRAFTERS,
    LOOKUP_DRAFTERS,
    MODEL_DRAFTERS,
    NAMED_K,
    DrafterName,
    SpecConfig,
    default_drafter,
    runs_as,
)
from specdec.serve.errors import bad

if TYPE_CHECKING:  # annotations only: the protocols module imports torch
    from specdec.core.protocols import Drafter

#: The wire's name for core's drafter None: no drafting at all, not even from the request's
#: prediction (the target decodes alone).
NO_DRAFTER = "none"
#: What a request's speculation.drafter may name: core.config.DRAFTERS and NO_DRAFTER.
SPEC_DRAFTERS = (NO_DRAFTER, *DRAFTERS)
#: The fields of the `speculation` object.
SPEC_FIELDS = ("drafter", "k", "k_max")
#: The largest k or k_max a request may ask for. A round verifies k + 1 tokens in one target pass;
#: past 128 a pass costs as much as the drafts could save, and the model-free drafters' own
#: default is 64.
MAX_REQUEST_K = 128
#: The server's K unless -k says: K per round from measured costs (core.policy.CostModelK),
#: which stops drafting where it cannot pay; a fixed K = 4 costs time wherever a verify pass is
#: dear (a CPU) or the drafts are poor.
DEFAULT_K = "auto"


@dataclass(frozen=True)
class SpecDefaults:
    """The server's start-up speculation: what a request that does not say gets.

    config     the start-up flags (serve.config.ServeConfig.spec_config). Its drafter None with no
               draft model: no flag chose one, so a request's prediction is drafted from (else
               prompt lookup), and without a prediction the target decodes alone
    has_draft  a draft model is loaded: "model" and "composite" need one
    """

    config: SpecConfig = SpecConfig(k=DEFAULT_K)  # noqa: RUF009 - frozen
    has_draft: bool = False

    @property
    def drafter(self) -> DrafterName | Drafter | None:
        """The default drafter (core.config.default_drafter: "model" with a draft model when no
        flag chose one); None when none is chosen."""
        return default_drafter(self.config.drafter, self.has_draft)

    def card(self) -> dict[str, Any]:
        """/v1/models' `speculation`: what a request may ask of this server, and what it gets
        by default (drafter null: no flag chose one, so a request's prediction, else nothing)."""
        k, k_max = self.config.k, self.config.k_max
        return {
            "drafters": [d for d in SPEC_DRAFTERS if self.has_draft or d not in MODEL_DRAFTERS],
            "default": {
                "drafter": self.drafter,
                "k": k if isinstance(k, (int, str)) else None,  # a KPolicy has no wire name
                "k_max": k_max,
            },
            "max_k": MAX_REQUEST_K,
        }


@dataclass(frozen=True)
class Speculation:
    """One request's speculation, resolved against the server's defaults.

    config          its core.config.SpecConfig, the drafter as the request named it (or the
                    server's default). Drafter None (the wire's "none") drafts nothing, not even
                    the request's prediction; with any other drafter the prediction is drafted
                    from first (core.generate.make_drafter). p_min is set only for the drafters
                    that run the draft model, k_max only for the named k ('auto', 'schedule').
    has_prediction  the request carries a prediction, which goes to the core beside the config
    """

    config: SpecConfig = SpecConfig()  # noqa: RUF009 - frozen; no drafter: the target alone
    has_prediction: bool = False

    @property
    def drafts(self) -> bool:
        return self.config.drafter is not None

    @property
    def uses_draft(self) -> bool:
        return self.config.drafter in MODEL_DRAFTERS

    @property
    def uses_lookup(self) -> bool:
        return self.config.drafter in LOOKUP_DRAFTERS

    @property
    def drafter_name(self) -> str:
        """The drafter as the API names it (responses, /metrics' labels): "none" for none."""
        drafter = self.config.drafter
        if drafter is None:
            return NO_DRAFTER
        return drafter if isinstance(drafter, str) else type(drafter).__name__

    def run_config(self) -> SpecConfig:
        """What the core runs: the drafter as it runs with or without the request's prediction
        (core.config.runs_as: "prediction" without one is prompt lookup), decided here once."""
        drafter = runs_as(self.config.drafter, self.has_prediction)
        return dataclasses.replace(self.config, drafter=drafter)

    def settings(self) -> dict[str, Any]:
        """drafter, k and the k_max in force (core.config's default when none was given), as
        usage.speculation echoes them."""
        if not self.drafts:
            return {"drafter": NO_DRAFTER, "k": None, "k_max": None}
        k = self.config.k
        named = isinstance(k, str)
        return {
            "drafter": self.drafter_name,
            "k": k if isinstance(k, (int, str)) else type(k).__name__,  # a KPolicy
            "k_max": self.config.resolved_k_max(self.uses_draft) if named else None,
        }


def resolve_speculation(raw: Any, defaults: SpecDefaults, has_prediction: bool) -> Speculation:
    """A request's `speculation` object (`raw`, None when absent) over the server's defaults;
    400 naming the field, the allowed values and the fix for anything else."""
    raw = _spec_object(raw)
    drafter = _spec_drafter(raw.get("drafter"), defaults, has_prediction)
    k, k_max = raw.get("k"), raw.get("k_max")
    if drafter is None:
        for name, value in (("k", k), ("k_max", k_max)):
            if value is not None:
                why = "" if raw.get("drafter") is not None else " (this server's default)"
                raise bad(
                    f"speculation.{name} has no effect with drafter '{NO_DRAFTER}'{why}, which "
                    "drafts nothing; leave it out, or set speculation.drafter (e.g. lookup)",
                    f"speculation.{name}",
                    "invalid_value",
                )
        return Speculation()  # drafts nothing: its prediction goes nowhere
    k = defaults.config.k if k is None else _spec_k("k", k)
    if k_max is not None:
        _spec_k("k_max", k_max, named=False)
        if not isinstance(k, str):
            raise bad(
                f"speculation.k_max bounds k 'auto' or 'schedule', and this request's k is {k}; "
                "leave k_max out, or send k 'auto'",
                "speculation.k_max",
                "invalid_value",
            )
    elif isinstance(k, str):  # the server's --k-max bounds the named policies only
        k_max = defaults.config.k_max
    p_min = defaults.config.p_min if drafter in MODEL_DRAFTERS else None  # a draft model's setting
    return Speculation(SpecConfig(drafter, k, k_max, p_min), has_prediction)


def _spec_object(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad(
            'speculation must be an object, e.g. {"drafter": "lookup", "k": "auto"}; got '
            f"{type(raw).__name__}",
            "speculation",
            "invalid_type",
        )
    unknown = sorted(set(raw) - set(SPEC_FIELDS))
    if unknown:
        raise bad(
            f"speculation.{shown(unknown[0], quote=False)} is not a field of speculation; its "
            f"fields are {', '.join(SPEC_FIELDS)}",
            "speculation",
            "unknown_parameter",
        )
    return raw


def _spec_drafter(
    value: Any, defaults: SpecDefaults, has_prediction: bool
) -> DrafterName | Drafter | None:
    """The drafter a request runs (None: none), from its speculation.drafter (None: not set)."""
    if value is None:
        if defaults.drafter is not None:
            return defaults.drafter
        return "prediction" if has_prediction else None
    if not isinstance(value, str) or value not in SPEC_DRAFTERS:
        raise bad(
            f"speculation.drafter must be one of {', '.join(SPEC_DRAFTERS)}; got {shown(value)}",
            "speculation.drafter",
            "invalid_value",
        )
    if value in MODEL_DRAFTERS and not defaults.has_draft:
        raise bad(
            f"speculation.drafter {value!r} needs a draft model, and this server has none "
            "(start it with --draft SPEC); use none, lookup or prediction",
            "speculation.drafter",
            "invalid_value",
        )
    return None if value == NO_DRAFTER else cast(DrafterName, value)


def _spec_k(name: str, value: Any, named: bool = True) -> int | str:
    if named and isinstance(value, str) and value in NAMED_K:
        return value
    param = f"speculation.{name}"
    return check_int(
        param,
        value,
        1,
        MAX_REQUEST_K,
        alternatives="'auto', 'schedule'" if named else "",
        error=lambda message: bad(message, param, "invalid_value"),
    )
