"""k="auto" policies kept per tenant, so that one API key's requests never steer another's K.

core.policy.AutoPolicies keeps one CostModelK per (target, drafter, k_max) across generations:
acceptance per draft source, draft cost, and the verify-cost curve v(b). Kept once per engine,
one tenant's traffic steered every other's speculation: 30 short requests of a repeated random
block at temperature 2 (lookup drafts it, the target rejects it) left the next key's unrelated
greedy prompt drafting nothing for 64 rounds (issue 33; the idle decay is slow on purpose, so
the poison lasts hundreds of rounds), and that key's k_histogram told it how the other's drafts
had fared. So each tenant (serve.keys: an API key's id) has an AutoPolicies of its own, at most
`scopes` of them, the least recently used dropped first (its tenant starts from the priors).

The verify-cost curve stays common: it measures the machine, not anyone's text. A tenant's new
policy starts from the latest curve a generation of any tenant stored (`SharedCurves`), and the
store behind it (backends.costs) keeps the curve for the next process, as before.
"""

from __future__ import annotations

import collections
import threading
import weakref

from specdec.core.cost import VerifyCurve
from specdec.core.model import SpecModel
from specdec.core.policy import AutoPolicies, CurveStore

#: Tenants whose policies are held at once: a handful of small dicts each; tenants are API keys,
#: so only a server with more keys than this ever drops one.
DEFAULT_POLICY_SCOPES = 256


class SharedCurves:
    """A CurveStore over another (or none): every sample any policy stored, per target, in
    memory, so that a tenant's first policy starts from what the others measured."""

    def __init__(self, inner: CurveStore | None) -> None:
        self.inner = inner
        self._latest: weakref.WeakKeyDictionary[SpecModel, VerifyCurve] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def load(self, target: SpecModel) -> VerifyCurve:
        with self._lock:
            latest = self._latest.get(target)
        if latest is not None:
            return VerifyCurve(latest.samples())
        return VerifyCurve() if self.inner is None else self.inner.load(target)

    def save(self, target: SpecModel, curve: VerifyCurve, replace: bool = False) -> object:
        with self._lock:
            kept = VerifyCurve() if replace else self._latest.get(target, VerifyCurve())
            self._latest[target] = kept.merged(curve)
        return None if self.inner is None else self.inner.save(target, curve, replace)


class TenantPolicies:
    """One AutoPolicies per tenant over SharedCurves, `scopes` at most (LRU)."""

    def __init__(
        self, curves: CurveStore | None = None, scopes: int = DEFAULT_POLICY_SCOPES
    ) -> None:
        if scopes < 1:
            raise ValueError(f"scopes must be >= 1, got {scopes}")
        self.curves = SharedCurves(curves)
        self.scopes = scopes
        self._held: collections.OrderedDict[str, AutoPolicies] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant: str) -> AutoPolicies:
        """The policies of `tenant`'s requests (new ones on its first request)."""
        with self._lock:
            policies = self._held.get(tenant)
            if policies is None:
                policies = self._held[tenant] = AutoPolicies(self.curves)
                while len(self._held) > self.scopes:
                    self._held.popitem(last=False)
            self._held.move_to_end(tenant)
            return policies

    def __len__(self) -> int:
        return len(self._held)
