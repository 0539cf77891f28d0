"""What one generation runs with: `GenParams`, a request checked against the models
(serve.validation.validate_request) and finished off the worker by serve.models (its grammar
compiled, its prediction's index built) and serve.infill (a FIM prompt's stop ids).

Nothing here parses or checks: these are the values the worker passes down to
core.generate.make_generation, whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.backends.grammar import Grammar
from specdec.core.config import Warp
from specdec.core.prediction import PredictionIndex
from specdec.core.processing import Penalties
from specdec.serve.speculation import Speculation
from specdec.serve.tools import ToolFormat


@dataclass(frozen=True)
class GenParams:
    """One request, validated: what the worker needs to generate it."""

    prompt_ids: list[int]
    max_tokens: int
    warp: Warp
    seed: int
    stop: tuple[str, ...]
    # the request's prediction where something drafts from it (None with drafter "none"),
    # checked at the edge (serve.validation), with the rewrites its instruction names as hints;
    # its n-gram index built ahead off the engine's lock where the engine's budget allows
    # (serve.tokens.Tokens.prepare_prediction), else by the worker before it takes the lock
    prediction: PredictionIndex | None = None
    speculation: Speculation = Speculation()  # noqa: RUF009 - frozen; the server's defaults applied
    origins: bool = False  # stream_options.include_speculation: token origins per chunk
    penalties: Penalties | None = None  # presence/frequency/repetition penalties, logit_bias
    logprobs: int | None = None  # None: none; n: each token's and the n likeliest
    n: int = 1  # samples of the prompt, sample i seeded with seed + i
    echo: bool = False  # completions: the prompt's text before the answer's
    structure: Structure | None = None  # what the output must match (response_format, tools)
    tools: ToolFormat | None = None  # read tool calls out of the text in this format
    grammar: Grammar | None = None  # the structure's grammar, compiled by the app (off the worker)
    # tokens that end this request besides the model's own (a FIM prompt's: backends.fim)
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Structure:
    """What the output must match: JSON by a schema (None: any object); or, with `functions`
    ({"name", "parameters"} each), one tool call of them (or several, `parallel`); or a
    `regex`; or a `lark` grammar."""

    schema: dict[str, Any] | None = None
    functions: tuple[dict[str, Any], ...] = ()
    parallel: bool = True
    regex: str | None = None
    lark: str | None = None
