"""Grammars for structured outputs: llguidance bound to a model's tokenizer.

Why llguidance (over xgrammar; both are what vLLM, SGLang and llama.cpp use): on this CPU, at
the 1.5B's 151,936-token vocabulary, a JSON-schema mask took 11 us median and 40 us p90 per
token, against xgrammar's 4 us and 20 us: both well under 1% of a 31 ms decode step
(docs/api-extensions.md has the measurement). llguidance needs nothing else installed (xgrammar
brings triton and a TVM runtime), compiles a grammar lazily (no per-schema compile step before
the first token), and gives what speculation needs: rollback, a check of a draft without
moving, and the tokens a grammar forces.

    Grammars(tokenizer, width, stop_ids)   once per model (building the token trie takes ~2 s)
    .json_schema(schema) / .regex(pattern) / .lark(text)
                                           a Grammar, compiled and checked once (ValueError
                                           names the problem): up to a second for a large one,
                                           so off the engine's worker
    .constraint(grammar)                   a fresh matcher (a copy of the compiled one, cheap):
                                           core.processing's Constraint, one per sample
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specdec.core.processing import GrammarError

#: JSON as OpenAI's structured outputs write it: compact, no whitespace between tokens. Why:
#: the grammar then forces every key with its quotes, colon and comma, which are drafted for
#: free (core.processing); flexible whitespace leaves only the key's own token forced. A
#: schema's "x-guidance" {"whitespace_flexible": true} asks for the other.
JSON_OPTIONS = {"whitespace_flexible": False}
#: Any JSON object: OpenAI's response_format {"type": "json_object"}.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: llguidance's resource limits, set here rather than left to a version's defaults, for every
#: grammar checked and every matcher: a mask may cost ~4 ms of lexer work (step_lexer_fuel,
#: ~50k a millisecond) and a round computes up to K + 1 of them; a matcher may build 20,000
#: lexer states (1.9's default allows 250,000, hundreds of MB for one hostile request); the
#: grammar, 500,000 symbols (the 1 MiB body cap's worth of schema). A grammar past a limit fails
#: its request with the limit named (GrammarError), while the server goes on.
LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=20_000,
    max_grammar_size=500_000,
)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: its text (llguidance's) and a matcher at its start, which
    `Grammars.constraint` copies for each sample rather than compiling the text again."""

    text: str
    _start: Any = field(repr=False, compare=False)


class Grammars:
    """llguidance's tokenizer for one model; makes checked grammars and their matchers.

    `width` is the sampling width V (masks are [V]); `stop_ids` are the ids that end a
    generation: where the grammar allows its end, each of them is allowed, and nowhere else."""

    def __init__(self, tokenizer: Any, width: int, stop_ids: Iterable[int]) -> None:
        import llguidance.hf

        self.width = width
        self.stop_ids = sorted(set(stop_ids))
        self._tok = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=width, eos_token=self.stop_ids or None
        )
        self._limits = llguidance.LLParserLimits(**LIMITS)

    def json_schema(self, schema: dict[str, Any] | None) -> Grammar:
        """A grammar for JSON text matching `schema` (None: any JSON object)."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema if schema is not None else ANY_OBJECT, defaults=JSON_OPTIONS
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"the JSON schema is not valid: {e}") from None
        return self._checked(grammar, "JSON schema")

    def lark(self, text: str) -> Grammar:
        """A grammar from Lark text (llguidance's dialect: `%json {...}` embeds a schema)."""
        import llguidance

        return self._checked(llguidance.LLMatcher.grammar_from_lark(text), "grammar")

    def regex(self, pattern: str) -> Grammar:
        """A grammar for text matching the regular expression `pattern` (whole)."""
        import llguidance

        return self._checked(llguidance.LLMatcher.grammar_from_regex(pattern), "regex")

    def constraint(self, grammar: Grammar) -> LLConstraint:
        return LLConstraint(grammar._start.deep_copy(), self)

    def _checked(self, grammar: str, what: str) -> Grammar:
        """`grammar` compiled, once, under LIMITS; ValueError naming what is wrong."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"the {what} cannot be used: {matcher.get_error()}")
        return Grammar(grammar, matcher)


class LLConstraint:
    """An llguidance matcher as core.processing's Constraint (one generation's)."""

    def __init__(self, matcher: Any, grammars: Grammars) -> None:
        self._m = matcher
        self._tokenize = grammars._tok.tokenize_bytes
        self._width = grammars.width
        self._stops = torch.tensor(grammars.stop_ids, dtype=torch.long)

    def allowed(self) -> torch.Tensor | None:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._raise_if_failed()
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._width].astype(bool))
        if not bool(mask.any()):  # the grammar is done: nothing can follow, so end the answer
            mask[self._stops] = True
        return mask

    def _raise_if_failed(self) -> None:
        """GrammarError if the matcher is in its error state (a limit hit, LIMITS): it would
        then allow only the end, and the answer would stop short looking finished."""
        if self._m.is_error():
            raise GrammarError(f"the grammar could not go on: {self._m.get_error()}")

    def consume(self, tokens: Sequence[int]) -> int:
        n = self._m.try_consume_tokens(list(tokens)) if tokens else 0
        self._raise_if_failed()
        return n

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def forced(self) -> list[int]:
        """The bytes the grammar forces, tokenized. llguidance's own forced tokens stop before
        the last token that could merge with what follows (`name` of `name":"`); the whole
        bytes' tokens are a better guess (`name`, `":"`), and a guess is all a draft needs: a
        token the model would not emit is rejected by the accept rule."""
        raw = self._m.compute_ff_bytes()
        return list(self._tokenize(raw)) if raw else []


def schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema an OpenAI `response_format` asks for: json_schema's `schema`, or None
    for json_object (any object). ValueError for anything else."""
    kind = response_format.get("type")
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be an object with a `schema`")
        return spec.get("schema") or ANY_OBJECT
    raise ValueError(
        f"response_format type {json.dumps(kind)} is not one of text, json_object, json_schema"
    )
