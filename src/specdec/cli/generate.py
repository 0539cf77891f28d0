"""`specdec generate`: one generation, streamed, then its stats."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from specdec.cli import args as cli_args

if TYPE_CHECKING:
    from specdec.core.metrics import GenerationStats


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text, streaming it, then print stats")
    cli_args.add_model_args(
        p, target_help="target model, BACKEND:NAME_OR_PATH (str; e.g. llamacpp:qwen2.5-coder-1.5b)"
    )
    cli_args.add_device_args(p)
    cli_args.add_deterministic_arg(p)
    cli_args.add_spec_args(p)
    cli_args.add_sampling_args(p)
    p.add_argument(
        "--no-chat",
        action="store_true",
        help="feed PROMPT raw instead of as a chat user turn (flag; default off)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (tokens, text, stats) instead of streaming (flag)",
    )
    p.add_argument(
        "--prediction",
        default=None,
        metavar="FILE",
        help="text the answer is expected to mostly repeat (e.g. the file an edit re-emits), "
        "drafted from first; '-' reads stdin (path; default none)",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the user message (str)")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import json
    import time

    from specdec.backends import chat as prompting
    from specdec.backends.costs import CurveFiles
    from specdec.core.config import SpecConfig, Warp
    from specdec.core.generate import stream
    from specdec.core.policy import AutoPolicies
    from specdec.core.prediction import PredictionDrafter, PredictionIndex

    cli_args.check_threads(args.threads)
    prediction_text = _read_prediction(args.prediction)  # before minutes of model loading
    spec = SpecConfig(**cli_args.spec_options(args))  # checked before the loading too
    warp = Warp(**cli_args.warp_options(args))
    target, draft = cli_args.load_pair(args, args.target, args.draft)
    tok = target.tokenizer if target.tokenizer is not None else getattr(draft, "tokenizer", None)
    prompt_ids = prompting.encode(tok, args.prompt, chat=not args.no_chat)
    prediction = None
    if prediction_text is not None:
        ids = prompting.encode_prediction(tok, prediction_text)
        # with the rewrites the prompt names ("rename `X` to `Y`") drafted from the start
        hints = prompting.prediction_hints(tok, args.prompt)
        prediction = PredictionIndex(ids, PredictionDrafter.N_MAX, hints)
    t0 = time.perf_counter()
    s = stream(
        target,
        prompt_ids,
        draft=draft,
        spec=spec,
        warp=warp,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop_ids=prompting.stop_ids(tok),
        prediction=prediction,
        # k=auto starts from the curve earlier processes learned, and leaves this one's
        policies=AutoPolicies(CurveFiles()),
    )
    out: list[int] = []
    shown = ""
    for chunk in s:
        out += chunk
        if not args.json:
            text = prompting.decode(tok, out)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text[len(shown) :], end="", flush=True)
                shown = text
    wall = time.perf_counter() - t0
    assert s.result is not None
    st = s.result.stats
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_tokens": len(prompt_ids),
                    "tokens": out,
                    "text": prompting.decode(tok, out),
                    "stop_reason": s.result.stop_reason,
                    "wall_s": wall,
                    "stats": st.to_dict(),
                }
            )
        )
        return 0
    print(prompting.decode(tok, out)[len(shown) :])
    print(_stats_line(st, prediction is not None), file=sys.stderr)
    return 0


def _stats_line(st: GenerationStats, with_prediction: bool) -> str:
    """The line printed after the text: speed, TTFT, and what speculation did."""
    line = (
        f"-- {st.generated} tokens in {st.wall_s:.2f} s ({st.tokens_per_s:.1f} tok/s), "
        f"TTFT {st.ttft_s:.3f} s"
    )
    if not st.drafted:
        return line
    pos = " ".join(f"{a:.0%}" for a in st.positional_acceptance)
    line += (
        f" | accepted {st.accepted}/{st.drafted} ({st.acceptance_rate:.1%}), by position "
        f"[{pos}], {st.tokens_per_round:.2f} tokens/round"
    )
    if with_prediction:
        line += (
            f", prediction tokens accepted {st.accepted_prediction_tokens} / rejected "
            f"{st.rejected_prediction_tokens}"
        )
    return line


def _read_prediction(path: str | None) -> str | None:
    """The --prediction text: a file, or stdin for '-'; a clear error for a missing file."""
    if path is None:
        return None
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --prediction {path}: {e}") from e
