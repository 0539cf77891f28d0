"""The draft-verify loop (paper, Algorithm 1) and its baseline.

Cache choreography, an invariant checked after every round when `debug=True`:
    seq        the committed sequence (prompt + generated)
    target     holds seq[:-1]; each round extends it once with [seq[-1], x_1..x_K], and the last
               K+1 logit rows are p_1..p_{K+1} (row i predicts x_{i+1}; row K is the bonus row)
    draft      holds a prefix of seq (its drafter extends the uncached suffix before drafting)
After the accept walk both caches are truncated to the accepted length: target to len(seq) - 1.

The baseline (`draft=None`) is the same loop with K = 0: extend the target by the last token and
sample from p_1 through the same sampler. Greedy (temperature 0) consumes no randomness.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .control import CostModelK, KPolicy, calibrate_verify, make_policy
from .device import synchronize
from .drafters import DRAFTERS, CompositeDrafter, Drafter, LookupDrafter, ModelDrafter, Warp
from .models.base import SpecModel, as_token_list
from .sampling import greedy_verify, rejection_sample


@dataclass
class GenerationStats:
    """Per-generation counters. Definitions (after vLLM's spec-decode metrics):

    rounds            target forward passes after the prefill (one per round; for the baseline,
                      one per generated token)
    drafted           draft tokens proposed and sent to verification
    accepted          drafted tokens kept by the accept rule
    drafted_per_pos   drafted_per_pos[i]: rounds that drafted a token at position i+1
    accepted_per_pos  accepted_per_pos[i]: rounds whose draft at position i+1 was accepted
    generated         tokens committed (accepted + one recovered or bonus token per round)
    tokens_per_round  generated / rounds: mean acceptance length, including the bonus token
    acceptance_rate   accepted / drafted (pooled)
    ttft_s            start of the call to the first committed token (includes the prefill and,
                      when speculating, the whole first draft + verify round)
    wall_s            start of the call to the last committed token
    draft_s           time inside the drafter (draft forward passes and draft-side sampling)
    verify_s          time inside target forward passes, the prefill included
    prefill_s         the part of verify_s spent on the prompt prefill (paid once per request
                      whatever the method; wall_s - prefill_s - catchup_s is the decode phase
                      that the microbench's cost model predicts)
    catchup_s         the part of draft_s a draft model spent prefilling context it had not
                      seen (the prompt in the first round; tokens committed by lookup rounds)
    sampling_s        target-side warping plus the accept/reject walk
    calibration_s     k="auto" only: the one-off measurement of the verify cost curve for a
                      model not seen before in this process (0 afterwards)
    other_s           wall_s minus the four above: bookkeeping, cache truncation, Python
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    generated: int = 0
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    calibration_s: float = 0.0
    prefill_s: float = 0.0
    catchup_s: float = 0.0

    @property
    def other_s(self) -> float:
        spent = self.draft_s + self.verify_s + self.sampling_s + self.calibration_s
        return max(0.0, self.wall_s - spent)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def positional_acceptance(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
        ]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """generated / decode-phase seconds: the prompt prefills (target and draft) left out."""
        decode_s = self.wall_s - self.prefill_s - self.catchup_s
        return self.generated / decode_s if decode_s > 0 else 0.0

    def record_round(self, k: int, n_accepted: int, n_emitted: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n_accepted
        self.generated += n_emitted
        grow = k - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(k):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += i < n_accepted

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            other_s=self.other_s,
            acceptance_rate=self.acceptance_rate,
            tokens_per_round=self.tokens_per_round,
            positional_acceptance=self.positional_acceptance,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids only (a stop id, if hit, is the last one)
    stop_reason: str  # "stop" (a stop id was emitted) or "length" (max_new_tokens reached)
    stats: GenerationStats


class _Clock:
    """Adds synchronized wall time to named fields of a GenerationStats."""

    def __init__(self, stats: GenerationStats, devices: Sequence[torch.device]) -> None:
        self.stats = stats
        self.devices = devices
        self.last: dict[str, float] = {}  # seconds of the latest interval of each phase

    def now(self) -> float:
        for d in self.devices:
            synchronize(d)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.now()
        yield
        dt = self.now() - t0
        self.last[name] = dt
        setattr(self.stats, name, getattr(self.stats, name) + dt)


class SpecStream:
    """Iterator of committed token chunks; `.result` is set once it is exhausted."""

    def __init__(self, chunks: Iterator[list[int]], state: dict) -> None:
        self._chunks = chunks
        self._state = state
        self.stats: GenerationStats = state["stats"]
        self.result: GenerationResult | None = None

    def __iter__(self) -> SpecStream:
        return self

    def __next__(self) -> list[int]:
        try:
            return next(self._chunks)
        except StopIteration:
            s = self._state
            self.result = GenerationResult(s["tokens"], s["stop_reason"], s["stats"])
            raise

    def close(self) -> None:
        """Stop generating (e.g. the client went away); caches stay consistent."""
        self._chunks.close()  # type: ignore[attr-defined]


def stream(
    target: SpecModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    draft: SpecModel | None = None,
    drafter: str | Drafter | None = None,
    k: int | str = 4,
    k_max: int = 8,
    p_min: float | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    debug: bool = False,
) -> SpecStream:
    """Like `generate`, but yields each round's committed tokens as they are accepted.

    All arguments are validated before any model work is done.
    """
    prompt = as_token_list(prompt_ids)
    warp = Warp(temperature, top_k, top_p)
    width = _validate(target, draft, drafter, prompt, k, k_max, p_min, max_new_tokens, warp)
    generator = torch.Generator().manual_seed(seed)
    drafter_obj = _make_drafter(drafter, draft, warp, generator, width, p_min)
    policy = None
    if drafter_obj is not None:
        if _is_policy(k):
            policy = k
        elif k == "auto":
            policy = _auto_policy(target, draft, drafter, k_max)
        else:
            policy = make_policy(k, k_max if k in _NAMED_K else int(k))
    state: dict = {"stats": GenerationStats(prompt_tokens=len(prompt)), "tokens": []}
    state["stop_reason"] = "length"
    chunks = _loop(target, drafter_obj, policy, prompt, max_new_tokens, warp, width, generator,
                   set(stop_ids or ()), debug, state)  # fmt: skip
    return SpecStream(chunks, state)


def generate(
    target: SpecModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    draft: SpecModel | None = None,
    drafter: str | Drafter | None = None,
    k: int | str = 4,
    k_max: int = 8,
    p_min: float | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
    debug: bool = False,
) -> GenerationResult:
    """Sample up to `max_new_tokens` tokens after `prompt_ids`, distributed exactly as `target`.

    With `draft`, K = `k` tokens are drafted per round and verified in one target pass (Algorithm
    1); with no draft and no drafter this is plain autoregressive sampling through the same
    sampler, the baseline. `drafter`: "model" (the default with a draft), "lookup" (prompt
    lookup, needs no draft model), "composite" (lookup, else the draft model), or a Drafter.
    `k`: an int >= 1, "auto" (K in 0..k_max chosen each round from measured costs, see
    control.py), "schedule" (transformers' +2/-1) or a KPolicy object. `p_min`: stop drafting
    when the draft's top probability falls below it. `temperature=0` is greedy. `seed` makes the run
    bit-reproducible. `debug` checks the cache invariant after every round.
    """
    s = stream(target, prompt_ids, draft=draft, drafter=drafter, k=k, k_max=k_max, p_min=p_min,
               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
               top_p=top_p, seed=seed, stop_ids=stop_ids, debug=debug)  # fmt: skip
    for _ in s:
        pass
    assert s.result is not None
    return s.result


def _make_drafter(
    kind: str | Drafter | None,
    draft: SpecModel | None,
    warp: Warp,
    generator: torch.Generator,
    width: int,
    p_min: float | None,
) -> Drafter | None:
    if kind is None:
        kind = "model" if draft is not None else None
    if kind is None or not isinstance(kind, str):
        return kind
    if kind == "lookup":
        return LookupDrafter()
    model = ModelDrafter(draft, warp, generator, width, p_min)  # validated: draft is not None
    return model if kind == "model" else CompositeDrafter(LookupDrafter(), model)


def _loop(
    target: SpecModel,
    drafter: Drafter | None,
    policy: KPolicy | None,
    prompt: list[int],
    max_new_tokens: int,
    warp: Warp,
    width: int,
    generator: torch.Generator,
    stop_ids: set[int],
    debug: bool,
    state: dict,
) -> Iterator[list[int]]:
    stats: GenerationStats = state["stats"]
    out: list[int] = state["tokens"]
    draft_model = getattr(drafter, "model", None)  # model-free drafters have none
    clock = _Clock(stats, [target.device] + ([draft_model.device] if draft_model else []))
    t_start = clock.now()
    seq = list(prompt)
    with clock.phase("verify_s"):  # prefill: the target holds seq[:-1] between rounds
        target.reset()
        if len(seq) > 1:
            target.prefill(seq[:-1])
    stats.prefill_s = clock.last["verify_s"]
    if draft_model is not None:
        # Fresh caches per call, so a seeded run never depends on what ran before it (reusing a
        # shared prefix would change draft numerics slightly, and with them the sampled drafts).
        draft_model.reset()
    if isinstance(policy, CostModelK) and not policy.verify_s:  # k="auto": v(b) measured once
        # per model, then refined online
        with clock.phase("calibration_s"):
            policy.verify_s.update(calibrate_verify(target, policy.k_max, seq))
    while len(out) < max_new_tokens:
        room = max_new_tokens - len(out) - 1  # a round emits <= k+1 tokens: never overshoot
        source = drafter.source(seq) if drafter is not None and room > 0 else None
        k = policy.choose(source, room) if policy is not None and source is not None else 0
        # 1. draft
        x, q = torch.empty(0, dtype=torch.long), None  # [k], [k, V] | None
        clock.last["draft_s"] = 0.0
        if k > 0:
            with clock.phase("draft_s"):
                x, q = drafter.propose(seq, k)
            k = x.numel()  # a drafter may propose fewer than asked
        # 2. verify: one target pass over [last committed, x_1..x_k] -> p_1..p_{k+1}
        with clock.phase("verify_s"):
            logits = target.extend([seq[-1], *x.tolist()])[:, :width]  # [k+1, V]
        # 3. accept walk
        with clock.phase("sampling_s"):
            if warp.greedy:
                emitted, n_acc = greedy_verify(x, logits)
            else:
                emitted, n_acc = rejection_sample(x, q, warp.probs(logits), generator)
        # 4. commit, then roll both caches back to the accepted length
        new = emitted.tolist()[: max_new_tokens - len(out)]
        stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
            state["stop_reason"] = "stop"
        seq += new
        out += new
        target.truncate(len(seq) - 1)
        if k > 0:
            drafter.observe(n_acc)
        catchup_s = getattr(drafter, "catchup_s", 0.0) if k else 0.0
        stats.catchup_s += catchup_s
        if policy is not None:
            draft_s = max(0.0, clock.last["draft_s"] - catchup_s)
            policy.observe(source or "none", k, n_acc, draft_s, clock.last["verify_s"])
        stats.record_round(k, n_acc, len(new))
        if debug:
            _check_caches(target, drafter, seq)
        now = clock.now()
        if stats.rounds == 1:
            stats.ttft_s = now - t_start
        stats.wall_s = now - t_start
        yield new
        if state["stop_reason"] == "stop":
            return


def _check_caches(target: SpecModel, drafter: Drafter | None, seq: list[int]) -> None:
    """Both caches must hold a prefix of the committed sequence; the target exactly seq[:-1]."""
    if target.cached_tokens != seq[:-1]:
        raise AssertionError(
            f"target cache holds {target.n_cached} tokens that are not seq[:-1] "
            f"(len {len(seq) - 1}): the last-K+1-rows alignment or the truncation is wrong"
        )
    model = getattr(drafter, "model", None)
    if model is not None and model.cached_tokens != seq[: model.n_cached]:
        raise AssertionError("draft cache is not a prefix of the committed sequence")


_NAMED_K = ("auto", "schedule")

#: k="auto" policies, kept per target model for the life of the process: what one generation
#: learned (acceptance per draft source, draft cost, v(b)) carries over to the next, so a pair
#: where drafting cannot pay stops exploring it after the first request instead of every time.
_AUTO_POLICIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _auto_policy(
    target: SpecModel, draft: SpecModel | None, drafter: object, k_max: int
) -> CostModelK:
    kind = drafter if isinstance(drafter, str) or drafter is None else id(drafter)
    key = (kind, id(draft) if draft is not None else None, k_max)
    per_target = _AUTO_POLICIES.setdefault(target, {})
    if key not in per_target:
        per_target[key] = CostModelK(k_max)
    return per_target[key]


def _is_policy(k: object) -> bool:
    """A KPolicy object passed as k (control.py), e.g. a CostModelK with a known cost curve."""
    return hasattr(k, "choose") and hasattr(k, "observe")


def _validate(
    target: SpecModel,
    draft: SpecModel | None,
    drafter: str | Drafter | None,
    prompt: list[int],
    k: int | str,
    k_max: int,
    p_min: float | None,
    max_new_tokens: int,
    warp: Warp,
) -> int:
    """Check every argument before any work; return the shared sampling width V."""
    if warp.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {warp.temperature}")
    if warp.top_p is not None and not 0 < warp.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {warp.top_p}")
    if warp.top_k is not None and warp.top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None to disable), got {warp.top_k}")
    if _is_policy(k):
        pass
    elif k not in _NAMED_K and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(
            f"k (draft tokens per round) must be an integer >= 1, 'auto' or 'schedule'; got {k!r}"
        )
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if p_min is not None and not 0 <= p_min < 1:
        raise ValueError(f"p_min must be in [0, 1), got {p_min}")
    if isinstance(drafter, str) and drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; use one of {', '.join(DRAFTERS)}")
    if drafter in ("model", "composite") and draft is None:
        raise ValueError(f"drafter {drafter!r} needs a draft model; pass draft= (or --draft)")
    if drafter == "lookup" and draft is not None:
        raise ValueError("drafter 'lookup' uses no draft model; drop draft= (or --draft)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt:
        raise ValueError("the prompt is empty; pass at least one token id (e.g. BOS)")
    width = target.vocab_size
    models = [target]
    if draft is not None and drafter in (None, "model", "composite"):
        from .tokenizer import check_pair  # HF-free for mock pairs; imported lazily

        width = check_pair(draft, target)
        models.append(draft)
    for m in models:
        if len(prompt) + max_new_tokens > m.n_ctx:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context window of {m.name} ({m.n_ctx}); shorten the prompt, lower "
                "max_new_tokens, or load the model with a larger n_ctx"
            )
    bad = next((t for t in prompt if not 0 <= t < width), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {width})")
    return width
