"""The `speculation` extension: a request's drafter, k and k_max over the server's defaults.

`SpecDefaults` (the start-up flags) -> `resolve_speculation(request's object)` -> `Speculation`,
which says what `decode.stream` runs with (`spec_config`) and what the response reports
(`settings`). docs/api-extensions.md has the user's view, with the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.core.checks import check_int, shown
from specdec.core.config import (
    DRAFTERS,
    LOOKUP_DRAFTERS,
    MODEL_DRAFTERS,
    NAMED_K,
    KName,
    SpecConfig,
    default_drafter,
)
from specdec.serve.errors import bad

if TYPE_CHECKING:
    from specdec.core.policy import KPolicy

#: What a request's speculation.drafter may name: core.config.DRAFTERS and "none" (no drafting at
#: all, not even from the request's prediction: the target decodes alone).
SPEC_DRAFTERS = ("none", *DRAFTERS)
#: The fields of the `speculation` object.
SPEC_FIELDS = ("drafter", "k", "k_max")
#: The largest k or k_max a request may ask for. A round verifies k + 1 tokens in one target pass;
#: past 128 a pass costs as much as the drafts could save, and the model-free drafters' own
#: default is 64.
MAX_REQUEST_K = 128


@dataclass(frozen=True)
class SpecDefaults:
    """The server's start-up speculation flags: what a request that does not say gets.

    drafter    one of SPEC_DRAFTERS, or None when no flag chose one: then a request's prediction
               is drafted from (else prompt lookup), and without a prediction the target
               decodes alone (what the server always did)
    k, k_max, p_min   as core.config.SpecConfig (k=auto unless -k says otherwise)
    has_draft  a draft model is loaded: "model" and "composite" need one
    """

    drafter: str | None = None
    k: int | KName | KPolicy = "auto"
    k_max: int | None = None
    p_min: float | None = None
    has_draft: bool = False

    @classmethod
    def of(cls, spec: SpecConfig, has_draft: bool) -> SpecDefaults:
        """The defaults of an engine started with `spec` (its drafter None: core.config's
        default)."""
        drafter = default_drafter(spec.drafter, has_draft)
        return cls(drafter, spec.k, spec.k_max, spec.p_min, has_draft)

    def speculation(self, has_prediction: bool = False) -> Speculation:
        """What a request without a `speculation` object runs with."""
        return resolve_speculation(None, self, has_prediction)


@dataclass(frozen=True)
class Speculation:
    """One request's speculation, resolved against the server's defaults.

    drafter  one of SPEC_DRAFTERS; a request's prediction is drafted from first with any of them
             but "none" (core.decode.stream)
    k        an int, "auto" or "schedule"; None for "none"
    k_max    as asked (or the server's --k-max); None: core.config's default for the drafter
    p_min    the server's --p-min, for the draft model's drafts
    """

    drafter: str = "none"
    k: int | str | None = None
    k_max: int | None = None
    p_min: float | None = None

    @property
    def uses_draft(self) -> bool:
        return self.drafter in MODEL_DRAFTERS

    @property
    def uses_lookup(self) -> bool:
        return self.drafter in LOOKUP_DRAFTERS

    def spec_config(self) -> SpecConfig:
        """What `decode.stream` runs with. "prediction" runs as "lookup": stream drafts from a
        given prediction first whatever the drafter, so "the prediction, else prompt lookup" is
        lookup with the prediction passed, and lookup alone without one (stream refuses
        drafter "prediction" without a prediction: that was `serve --drafter prediction`'s
        start-up failure)."""
        if self.drafter == "none":
            return SpecConfig()  # no drafter and no draft model: the target alone
        kind = "lookup" if self.drafter == "prediction" else self.drafter
        return SpecConfig(kind, self.k, self.k_max, self.p_min if self.uses_draft else None)

    def settings(self) -> dict[str, Any]:
        """drafter, k and the k_max in force (core.config's default when none was given)."""
        if self.drafter == "none":
            return {"drafter": "none", "k": None, "k_max": None}
        k = self.k if isinstance(self.k, (int, str)) else type(self.k).__name__  # a KPolicy
        named = isinstance(self.k, str)
        k_max = self.spec_config().resolved_k_max(self.uses_draft) if named else None
        return {"drafter": self.drafter, "k": k, "k_max": k_max}


def resolve_speculation(raw: Any, defaults: SpecDefaults, has_prediction: bool) -> Speculation:
    """A request's `speculation` object (`raw`, None when absent) over the server's defaults;
    400 naming the field, the allowed values and the fix for anything else."""
    if raw is None:
        raw = {}
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
    drafter = _spec_drafter(raw.get("drafter"), defaults, has_prediction)
    k, k_max = raw.get("k"), raw.get("k_max")
    if drafter == "none":
        for name, value in (("k", k), ("k_max", k_max)):
            if value is not None:
                why = "" if raw.get("drafter") is not None else " (this server's default)"
                raise bad(
                    f"speculation.{name} has no effect with drafter 'none'{why}, which drafts "
                    "nothing; leave it out, or set speculation.drafter (e.g. lookup)",
                    f"speculation.{name}",
                    "invalid_value",
                )
        return Speculation()
    k = defaults.k if k is None else _spec_k("k", k)
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
        k_max = defaults.k_max
    return Speculation(drafter, k, k_max, defaults.p_min)


def _spec_drafter(value: Any, defaults: SpecDefaults, has_prediction: bool) -> str:
    if value is None:
        if defaults.drafter is not None:
            return defaults.drafter
        return "prediction" if has_prediction else "none"
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
    return value


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
