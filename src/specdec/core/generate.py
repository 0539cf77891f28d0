"""How a generation is made: its arguments checked before any model work, its drafter and its
K policy built, into a decode.Generation that decode's loop steps. `generate` and `stream`, the
entry points, run one to its end or a round at a time; `make_generation` hands it over unstarted
(a server steps several at once: decode.rounds_together).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

import torch

from specdec.core.config import MODEL_DRAFTERS, DrafterName, SpecConfig, Warp, check_int
from specdec.core.decode import Clock, Generation, SpecStream
from specdec.core.drafters import CompositeDrafter, Drafter, LookupDrafter, ModelDrafter
from specdec.core.metrics import GenerationResult, GenerationStats, Round
from specdec.core.model import SpecModel, TokenIds, as_token_list
from specdec.core.pair import check_pair
from specdec.core.policy import AutoPolicies, KPolicy, make_policy
from specdec.core.pool import DraftPool, PoolDrafter
from specdec.core.prediction import PredictionDrafter, PredictionIndex
from specdec.core.processing import Constraint, Penalties, Processor

_C = TypeVar("_C", SpecConfig, Warp)


def generate(target: SpecModel, prompt_ids: TokenIds, **options: Any) -> GenerationResult:
    """Sample up to `max_new_tokens` tokens after `prompt_ids`, distributed exactly as `target`:
    `make_generation` run to its end. The options are `make_generation`'s keywords, and, in
    their place, the fields of its spec= and warp= as plain keywords (HF's generate's shape):
    `_with_configs`, the one place they become the configs.

    prompt_ids   token ids: a list of ints, a 1-D tensor, or a tokenizer's output (a
                 BatchEncoding or a dict holding input_ids)
    draft        a draft model (SpecModel); with it, the drafter defaults to "model"
    drafter, k, k_max, p_min   how speculation runs (core.config.SpecConfig: "model", "lookup",
                 "composite", "prediction" or a Drafter; K an int, "auto" or "schedule"), or
                 spec=SpecConfig(...)
    temperature, top_k, top_p, min_p, typical_p   how logits become a distribution (core.
                 config.Warp; temperature 0 is greedy, default 0.8), or warp=Warp(...); a config
                 and its keywords together are an error
    penalties    presence, frequency, repetition penalties and logit bias (core.processing.
                 Penalties), applied to every row from its own prefix: exact under speculation
    constraint   a grammar (core.processing.Constraint, e.g. backends.grammar): p is masked to
                 what it allows at every row; the tokens it forces are drafted for free
    logprobs     None: none; n >= 0: each token's log-probability under the model's own
                 distribution, and the n likeliest (core.sampling.token_logprobs)
    seed         the per-generation torch.Generator's seed
    stop_ids     token ids that end the generation (the stop id is the last token returned)
    prediction   token ids the output is expected to mostly repeat (e.g. the file an edit
                 re-emits), drafted from first (core.prediction.PredictionDrafter); it changes
                 the speed, never the output distribution
    policies     k="auto" policies kept by the caller across generations (core.policy.
                 AutoPolicies): what one generation learned carries to the next; None: each
                 call starts from the prior
    pool         a draft pool of earlier requests (core.pool): prompt lookup drafts from it too;
                 the caller adds this request's text to it once the generation ends
    reuse_prefix a block size B (0: off; 1: any length): keep the target's cached KV for the
                 longest common prefix of the prompt and what the cache holds, rounded down to
                 whole blocks, and prefill only the rest (llama-server's cache_prompt); a
                 batch-invariant draft model keeps its shared prefix too. Exact where the
                 backend is batch-invariant (mock, llama.cpp deterministic); elsewhere reused
                 rows computed in another batch shape can flip a greedy tie
    cancelled    asked between prefill chunks; True ends with stop_reason "cancelled"
    on_round     receives every round's Round record, after the stats and the K policy
    clock        times the phases (Clock); None: wall time. A replay passes modelled time
    debug        check the cache invariant after every round

    With a draft model or a drafter, K tokens are drafted per round and verified in one target
    pass (Algorithm 1); with neither this is plain autoregressive sampling through the same
    sampler, the baseline. Every argument is validated before any model work. For a fixed K
    (or "schedule") and a seed the run is bit-reproducible on the same backend and machine;
    k="auto" picks K from wall-clock costs, so which tokens get drafted varies between runs,
    while the output distribution does not (nor greedy output, on a batch-invariant backend).
    """
    s = stream(target, prompt_ids, **options)
    for _ in s:
        pass
    assert s.result is not None
    return s.result


def stream(target: SpecModel, prompt_ids: TokenIds, **options: Any) -> SpecStream:
    """`generate`, one round's committed tokens at a time; the options are generate's."""
    return SpecStream(make_generation(target, prompt_ids, **_with_configs(options)))


def _with_configs(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with the fields of SpecConfig and of Warp given as plain keywords (drafter=,
    k=, ..., temperature=, top_p=, ...; None: not given) folded into `make_generation`'s spec= and
    warp=: the one place the flat keywords become the configs. ValueError when a config and its
    keywords are both given, since one would silently win."""
    out = dict(options)
    for name, cls in (("spec", SpecConfig), ("warp", Warp)):
        flat = {f.name: out.pop(f.name) for f in fields(cls) if f.name in out}
        passed = {key: v for key, v in flat.items() if v is not None}
        given = out.get(name)
        if given is None:
            out[name] = cls(**passed)
        elif passed:
            raise ValueError(
                f"pass either {name}= or its keywords ({', '.join(passed)}), not both: "
                f"{name}={given} already sets them"
            )
    return out


def make_generation(
    target: SpecModel,
    prompt_ids: TokenIds,
    *,
    draft: SpecModel | None = None,
    spec: SpecConfig | None = None,
    warp: Warp | None = None,
    penalties: Penalties | None = None,
    constraint: Constraint | None = None,
    logprobs: int | None = None,
    max_new_tokens: int = 128,
    seed: int = 0,
    stop_ids: Iterable[int] | None = None,
    prediction: TokenIds | PredictionIndex | None = None,
    policies: AutoPolicies | None = None,
    pool: DraftPool | None = None,
    reuse_prefix: int = 0,
    cancelled: Callable[[], bool] | None = None,
    on_round: Callable[[Round], None] | None = None,
    clock: Clock | None = None,
    debug: bool = False,
) -> Generation:
    """A generation set up and checked but not started (every argument is validated before
    any model work): `generate` runs it to the end, `stream` a round at a time, and a caller
    that steps several at once takes it as it is (serve.cycle: decode.rounds_together). The
    settings come whole: `spec` (None: SpecConfig()) and `warp` (None: Warp()); the arguments
    are documented at `generate`."""
    spec = _config(spec, SpecConfig, "spec")
    warp = _config(warp, Warp, "warp")
    prompt = as_token_list(prompt_ids, "prompt_ids")
    kind = spec.drafter_for(draft is not None)
    used = draft if kind in MODEL_DRAFTERS else None
    width = _check_budget(target, used, prompt, max_new_tokens)
    if logprobs is not None:
        check_int("logprobs", logprobs, 0, width)
    adjusted = (penalties is not None and penalties.active) or constraint is not None
    processor = Processor(penalties, constraint, prompt, width) if adjusted else None
    generator = torch.Generator().manual_seed(seed)
    model = (
        ModelDrafter(used, warp, generator, width, spec.p_min, processor and processor.row)
        if used is not None
        else None
    )
    made, key = make_drafter(kind, model, _prediction(prediction, width), len(prompt), pool)
    policy = _policy(spec, target, made, key, policies) if made is not None else None
    gen = Generation(
        target=target,
        drafter=made,
        policy=policy,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        warp=warp,
        width=width,
        generator=generator,
        stop_ids=frozenset(stop_ids or ()),
        stats=GenerationStats(prompt_tokens=len(prompt)),
        debug=debug,
        cancelled=cancelled,
        reuse_prefix=reuse_prefix,
        on_round=on_round,
        clock=clock,
        policies=policies,
        processor=processor,
        top_logprobs=logprobs,
    )
    if model is not None:  # the draft model's catch-up timed by the generation's clock
        model.now = gen.clock.now  # type: ignore[union-attr]
    return gen


def _config(given: _C | None, cls: type[_C], name: str) -> _C:
    """`make_generation`'s `name`= (a SpecConfig or a Warp): `given`, or the default config."""
    if given is None:
        return cls()
    if not isinstance(given, cls):
        raise ValueError(f"{name}= takes a {cls.__name__}, got {type(given).__name__}")
    return given


def _check_budget(
    target: SpecModel, draft: SpecModel | None, prompt: list[int], max_new_tokens: int
) -> int:
    """Check the prompt and the budget against both models; return the sampling width V."""
    check_int("max_new_tokens", max_new_tokens, 1)
    if not prompt:
        raise ValueError("the prompt is empty; pass at least one token id (e.g. BOS)")
    width = target.vocab_size if draft is None else check_pair(draft, target)
    for m in [target] if draft is None else [target, draft]:
        if len(prompt) + max_new_tokens > m.n_ctx:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context window of {m.name} ({m.n_ctx}); shorten the prompt, lower "
                "max_new_tokens, or load the model with a larger n_ctx"
            )
    _check_ids("prompt", prompt, width)
    return width


def _check_ids(what: str, ids: TokenIds, width: int) -> list[int]:
    out = as_token_list(ids, what)
    bad = next((t for t in out if not 0 <= t < width), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the vocabulary [0, {width})")
    return out


def _prediction(
    prediction: TokenIds | PredictionIndex | None, width: int
) -> PredictionIndex | None:
    """The prediction as one checked value: ids become a PredictionIndex, which checks them
    against the vocabulary; an index already checked against this vocabulary or a narrower one
    (a server's, at its edge) is taken as it is."""
    if prediction is None:
        return None
    if not isinstance(prediction, PredictionIndex):
        return PredictionIndex(as_token_list(prediction, "prediction"), vocab=width)
    return prediction.check(width)


def make_drafter(
    kind: DrafterName | Drafter | None,
    model: ModelDrafter | None,
    prediction: PredictionIndex | None,
    start: int,
    pool: DraftPool | None,
) -> tuple[Drafter | None, Hashable]:
    """The one place a generation's drafter is built (stream's; a replay's, study.run.replay):
    `kind`'s (SpecConfig.drafter_for settled it; `model` drafts with the draft model for
    "model" and "composite"), with a prediction, when given, drafted from first (then `kind`'s
    drafter, else prompt lookup), starting at `start` (the prompt's length). Also returns what
    tells its k="auto" policy apart (AutoPolicies): the kind ("prediction" with a prediction;
    a Drafter's class) and the draft model."""
    if kind == "prediction" and prediction is None:
        raise ValueError("drafter 'prediction' needs a prediction (prediction=, --prediction)")
    made: Drafter | None
    name: Hashable
    if kind is None or not isinstance(kind, str):
        made, name = kind, type(kind)
    elif model is not None:  # "model" or "composite"
        made, name = (model if kind == "model" else CompositeDrafter(_lookup(pool), model)), kind
    else:  # "lookup", and "prediction", whose prediction goes first below
        made, name = _lookup(pool), kind
    if prediction is not None:
        rest = made if made is not None else _lookup(pool)
        made, name = CompositeDrafter(PredictionDrafter(prediction, start), rest), "prediction"
    return made, (name, model.model if model is not None else None)


def _lookup(pool: DraftPool | None) -> Drafter:
    """Prompt lookup, over the pool's earlier requests too when there is one."""
    return LookupDrafter() if pool is None else PoolDrafter(pool)


def _policy(
    spec: SpecConfig,
    target: SpecModel,
    drafter: Drafter,
    key: Hashable,
    policies: AutoPolicies | None,
) -> KPolicy:
    """spec.k as a policy: the caller's KPolicy object, k="auto"'s kept policy for this target
    and drafter when the caller keeps them (else a new one), or a new fixed / schedule one."""
    k = spec.k
    if not isinstance(k, (int, str)):  # a KPolicy object (SpecConfig checked that it is one)
        return k
    k_max = spec.resolved_k_max(uses_model=drafter.model is not None)
    if k == "auto" and policies is not None:
        return policies.get(target, key, k_max)
    return make_policy(k, k_max if isinstance(k, str) else k)
