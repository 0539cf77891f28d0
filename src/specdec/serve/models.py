"""What the engine serves with: the target and draft and their slots, the tokenizer's services
(serve.tokens), the grammar cache, the default speculation and the k="auto" policies.

The app calls it once per request, `prepare` (off the event loop and off the worker): the
prompt tokenized, the request validated against the models (serve.validation.validate_request),
its grammar compiled and its prediction's index built, in a GenParams the worker starts from
(`generation`). The worker alone runs the models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from specdec.backends import chat as prompting
from specdec.backends.grammar import Grammar, Grammars
from specdec.core.config import SpecConfig, Warp
from specdec.core.decode import Generation
from specdec.core.generate import make_generation, stream
from specdec.core.metrics import Round
from specdec.core.model import SpecModel
from specdec.core.policy import AutoPolicies
from specdec.core.pool import DraftPool
from specdec.core.prediction import PredictionIndex
from specdec.serve.errors import bad
from specdec.serve.gen_params import GenParams, Structure
from specdec.serve.keys import ANONYMOUS
from specdec.serve.speculation import SpecDefaults, Speculation, resolve_speculation
from specdec.serve.tenant_policies import TenantPolicies
from specdec.serve.tokens import Tokens
from specdec.serve.validation import DEFAULT_MAX_TOKENS
from specdec.serve.validation import validate_request as validate
from specdec.serve.wire import ChatRequest, CompletionRequest

if TYPE_CHECKING:
    from specdec.serve.config import ServeConfig


class Drafting(TypedDict):
    """What a request drafts with: make_generation's (and stream's) arguments of that name."""

    draft: SpecModel | None
    spec: SpecConfig
    prediction: PredictionIndex | None
    pool: DraftPool | None
    policies: AutoPolicies


class ServedModels:
    """The models, their slots (slot i: a KV cache each on the shared weights; slot 0: the
    models themselves) and the services requests are prepared with."""

    def __init__(
        self,
        target: SpecModel,
        draft: SpecModel | None,
        cfg: ServeConfig,
        policies: TenantPolicies,
    ) -> None:
        self.target = target
        self.draft = draft
        self.model_id = model_id = cfg.target  # what clients send as `model`
        self.targets = target.slots(cfg.parallel)
        self.drafts = draft.slots(cfg.parallel) if draft is not None else [None] * cfg.parallel
        # What a request gets when its `speculation` object does not say (the start-up flags)
        self.defaults = SpecDefaults(cfg.spec_config(), draft is not None)
        # What one request's k="auto" learned carries to the next of its tenant
        self.policies = policies
        # Prompts in, text out (serve.tokens): request threads encode, the worker decodes
        self.tokens = Tokens(target.tokenizer or getattr(draft, "tokenizer", None), model_id)
        self.stop_ids = prompting.stop_ids(self.tokens.tokenizer)
        self._grammars: Grammars | None = None  # built on the first request with a structure
        self._grammars_lock = threading.Lock()
        # Every model the prompt must fit, for max_tokens validation.
        self.n_ctx = min(m.n_ctx for m in (target, draft) if m is not None)

    @property
    def tokenizer(self) -> object | None:
        return self.tokens.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: object | None) -> None:
        self.tokens.tokenizer = tokenizer

    # -------------------------------------------------------------------------- the app's call
    def prepare(self, req: ChatRequest | CompletionRequest) -> tuple[GenParams, str]:
        """A parsed request, ready for the queue: its GenParams (prompt ids, validated
        arguments, compiled grammar, prediction index) and the prompt's text for `echo`
        ("" without). ApiError 400 naming the problem. Call off the event loop and off the
        worker: a prompt up to --max-body-bytes is templated and tokenized here, a grammar
        compiled (the first builds llguidance's token trie, ~2 s for 150k tokens)."""
        tokens, given, ends = self.tokens, None, frozenset[int]()
        if isinstance(req, ChatRequest):
            prompt = tokens.encode_chat(req.chat_messages(), _rendered_tools(req))
        elif req.suffix is not None and (req.suffix or tokens.fim is not None):
            prompt, ends = self._fim_prompt(req)
        else:
            given = req.single_prompt()
            prompt = tokens.encode_text(given) if isinstance(given, str) else given
        pred = None
        if req.prediction is not None:
            pred = tokens.encode_prediction(req.prediction.text())
        fmt = tokens.tool_format if isinstance(req, ChatRequest) and req.tools else None
        vocab = self.target.vocab_size
        params = validate(req, self.n_ctx, vocab, prompt, pred, self.defaults, fmt)
        if params.structure is not None:  # checked now, a 400 before the queue
            params = dataclasses.replace(params, grammar=self.grammar(params.structure))
        if params.prediction is not None:  # its hints, and its index if it may be built ahead
            params = tokens.prepare_prediction(params, _instruction(req))
        if ends:
            params = dataclasses.replace(params, stop_ids=ends)
        if not params.echo or given is None:
            return params, ""
        # token ids are decoded only once validate has checked them against the vocabulary
        return params, given if isinstance(given, str) else tokens.text_of(given)

    def _fim_prompt(self, req: CompletionRequest) -> tuple[list[int], frozenset[int]]:
        """A completion with a suffix: the FIM prompt for the middle between its prompt and
        its suffix, and the tokens that end a middle (serve.tokens.encode_fim)."""
        prefix = req.single_prompt()
        if not isinstance(prefix, str):
            raise bad("a suffix needs a text prompt (the text before the gap)", "prompt")
        if req.echo:
            raise bad("echo and suffix together are not supported", "echo")
        n_predict = req.max_tokens if isinstance(req.max_tokens, int) else DEFAULT_MAX_TOKENS
        return self.tokens.encode_fim(prefix, req.suffix or "", [], "", self.n_ctx, n_predict)

    def grammar(self, structure: Structure) -> Grammar:
        """The grammar of a request's structure, compiled and checked against the model's
        tokenizer: ApiError 400 naming the problem. Each sample runs on a copy of it."""
        try:
            grammars = self.grammars()
            if structure.functions:
                fmt = self.tokens.tool_format
                assert fmt is not None, "validation.validate_request checked the tool format"
                return grammars.lark(fmt.grammar(list(structure.functions), structure.parallel))
            if structure.regex is not None:
                return grammars.regex(structure.regex)
            if structure.lark is not None:
                return grammars.lark(structure.lark)
            return grammars.json_schema(structure.schema)
        except ValueError as e:
            raise bad(str(e), _structure_param(structure)) from None

    def grammars(self) -> Grammars:
        with self._grammars_lock:
            if self._grammars is None:
                tokenizer = self.tokens.tokenizer
                if tokenizer is None:
                    raise ValueError(f"{self.model_id} has no tokenizer to build a grammar with")
                with self.tokens.lock:
                    self._grammars = Grammars(tokenizer, self.target.vocab_size, self.stop_ids)
            return self._grammars

    # -------------------------------------------------------------------------- the worker's
    def generation(
        self,
        p: GenParams,
        slot: int,
        tenant: str,
        pool: DraftPool | None,
        reuse_prefix: int,
        *,
        cancelled: Callable[[], bool],
        on_round: Callable[[Round], None] | None,
    ) -> Generation:
        """A request's generation in `slot`, drafting from its prediction and `pool`, set up
        and checked (make_generation: ValueError for a bad argument, before any model work)
        but not started; `cancelled` is polled between prefill chunks."""
        constraint = self.grammars().constraint(p.grammar) if p.grammar else None
        drafting = self.stream_args(p.speculation, p.prediction, pool, tenant, slot)
        gen = make_generation(
            self.targets[slot],
            p.prompt_ids,
            **drafting,
            warp=p.warp,
            penalties=p.penalties,
            constraint=constraint,
            logprobs=p.logprobs,
            max_new_tokens=p.max_tokens,
            seed=p.seed,
            stop_ids=[*self.stop_ids, *p.stop_ids],
            cancelled=cancelled,
            on_round=on_round,
            reuse_prefix=reuse_prefix,
        )
        # in company, K at most the server's k_max for its kind of drafter (a request's own
        # fixed K, up to MAX_REQUEST_K, would set its neighbours' rounds)
        gen.k_company = self.defaults.config.resolved_k_max(gen.drafts_with_model)
        return gen

    def stream_args(
        self,
        sp: Speculation,
        prediction: PredictionIndex | None,
        pool: DraftPool | None = None,
        tenant: str = ANONYMOUS,
        slot: int = 0,
    ) -> Drafting:
        """`make_generation`'s draft, spec, prediction, pool and policies for a request's
        speculation: the draft model (`slot`'s) only for the drafters that run it, no prediction
        without a drafter (it drafts nothing), the draft pool only for the drafters that run
        prompt lookup, the k="auto" policies of the request's tenant."""
        return Drafting(
            draft=self.drafts[slot] if sp.uses_draft else None,
            spec=sp.run_config(),
            prediction=prediction if sp.drafts else None,
            pool=pool if sp.uses_lookup else None,
            policies=self.policies.get(tenant),
        )

    def warm_up(self) -> None:
        """A 2-token generation with the default speculation, and one with the draft model if
        the default does not use it (a request may ask for it): surfaces a bad model pair or
        option at startup rather than in a request, and pays one-time costs there too. Hold
        the engine's lock."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        prompt = [bos if bos is not None else 0]
        default = resolve_speculation(None, self.defaults, False)
        runs = [default]
        if self.draft is not None and not default.uses_draft:
            runs.append(resolve_speculation({"drafter": "model"}, self.defaults, False))
        for sp in runs:
            for _ in stream(
                self.target, prompt, **self.stream_args(sp, None), warp=Warp(0.0), max_new_tokens=2
            ):
                pass

    def reset_slot(self, slot: int) -> None:
        """Leave nothing half-written for the slot's next request (a pass that raised may have)."""
        for m in (self.targets[slot], self.drafts[slot]):
            if m is not None:
                with contextlib.suppress(Exception):
                    m.reset()

    @property
    def kv_usage(self) -> float:
        """The target's KV cells holding tokens over all of its slots' cells, 0 to 1."""
        held = sum(t.n_cached for t in self.targets)
        return held / (self.target.n_ctx * len(self.targets))


def _rendered_tools(req: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template renders: none with tool_choice "none" (the model is not to
    call them, so it is not told of them)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _instruction(req: ChatRequest | CompletionRequest) -> str:
    """The text that may name the request's edits ("rename `X` to `Y`"): the last user message,
    or a text prompt."""
    if isinstance(req, ChatRequest):
        users = [m for m in req.messages if m.role == "user"]
        return users[-1].text() if users else ""
    prompt = req.single_prompt()
    return prompt if isinstance(prompt, str) else ""


def _structure_param(s: Structure) -> str:
    """The request field a structure came from, for its 400."""
    if s.functions:
        return "tools"
    if s.regex is not None:
        return "guided_regex"
    return "guided_grammar" if s.lark is not None else "response_format"
