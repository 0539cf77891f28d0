"""The hostile soak's structured requests (issue 53): well-formed ones, each answer compared with
the same request sent alone after the soak, and what a hostile client sends to the grammar,
tool, logit_bias, penalty and logprob surfaces (scripts/loadtest_hostile.py sends them)."""

from __future__ import annotations

from typing import Any

#: Well-formed structured requests (issue 43's surfaces): each answer is compared with the same
#: request sent alone after the soak (loadtest_hostile._solo): its neighbours must not change it.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
STRUCTURED: tuple[dict[str, Any], ...] = (
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    {"guided_choice": ["yes", "no", "maybe"]},
    {"guided_regex": "[0-9]{3}-[0-9]{4}"},
    {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    {"logit_bias": {"30": -100, "31": 5}, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"logprobs": True, "top_logprobs": 5},
    {"n": 2, "response_format": {"type": "json_object"}, "stream": False},
)


def _nested(depth: int) -> str:
    """A JSON schema `depth` objects deep, as text (json.dumps itself stops near 1,000)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def _tools(n: int) -> list[dict[str, Any]]:
    props = {f"field_{j}": {"type": "string", "enum": [f"v{j}_{k}" for k in range(8)]}
             for j in range(20)}  # fmt: skip
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": props, "required": list(props)},
            },
        }
        for i in range(n)
    ]


#: What a hostile client sends to the structured surfaces (the review of issue 53): (name, the
#: body's fields, the statuses it may get, the field a 400 must name). Never streamed: the
#: status says what the server made of it.
HOSTILE_STRUCTURED: tuple[tuple[str, dict[str, Any], tuple[int, ...], str | None], ...] = (
    # thousands of forced tokens: capped per round, answered within max_tokens
    (
        "long_choice",
        {"guided_choice": [" ".join(f"w{j}" for j in range(12_000))], "max_tokens": 64},
        (200,),
        None,
    ),
    ("deep_json", {"guided_json": _nested(5000)}, (400,), "guided_json"),
    ("bias_flood", {"logit_bias": {str(j): 1 for j in range(40_000)}}, (400,), "logit_bias"),
    ("bias_huge", {"logit_bias": {"5": 1e9}}, (400,), "logit_bias"),
    ("tool_flood", {"tools": _tools(200), "tool_choice": "required"}, (200, 400), "tools"),
    # a lexer that blows up: llguidance's limits end it with a 400 naming the grammar
    ("lexer_bomb", {"guided_regex": "(a|b)*a(a|b){24}c"}, (200, 400), "guided_regex"),
    (
        "n_logprobs",
        {"n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 256},
        (200, 429),  # its 16 samples take 16 places of the queue: a 429 with Retry-After
        None,
    ),
    (
        "bad_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 12}},
            }
        },
        (400,),
        "response_format",
    ),
    (
        "unknown_tool",
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        (400,),
        "tool_choice",
    ),
    (
        "penalties",
        {
            "presence_penalty": 2.0,
            "frequency_penalty": -2.0,
            "repetition_penalty": 2.0,
            "max_tokens": 64,
        },
        (200,),
        None,
    ),
)
