"""argparse flags that several `specdec` subcommands share, declared once, and their readers.

Each `add_*` function adds a group of flags to a parser with the canonical name, type, default and
help text (the help states type, range and default). Where a subcommand has always described a
flag in its own words or with its own default, it passes that text or default in; the flag's
parsing and validation stay the ones defined here. Values that several commands read the same
way are read here too (`spec_options`, `warp_options`, `load_pair`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from specdec.backends import DETERMINISTIC_HELP, DEVICE_HELP, THREADS_HELP, draft_spec
from specdec.core.config import DRAFTERS, WARP_FIELDS, Warp, parse_k

if TYPE_CHECKING:
    from specdec.core.model import SpecModel
    from specdec.study.artifacts import Model

# ------------------------------------------------------------------------------ exit codes
EXIT_FAILED = 1  # the command ran and found a failure: a gate verdict, a missing model, bad JSON
EXIT_ERROR = 2  # bad input (argparse's code for usage errors too)
EXIT_INTERRUPTED = 130  # shell convention: 128 + SIGINT


def error(msg: str, code: int = EXIT_ERROR) -> int:
    """Print `error: msg` to stderr and return the exit code."""
    print(f"error: {msg}", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------ help texts
K_HELP = (
    "draft tokens per round: an int >= 1, 'auto' (K in 0..--k-max from measured costs) "
    "or 'schedule' (transformers' +2/-1) (default 4)"
)
K_MAX_HELP = (
    "largest K for -k auto|schedule (int >= 1; default 8 with a draft model, 64 for the "
    "model-free drafters lookup and prediction)"
)
DRAFTER_HELP = (
    "model (needs --draft), lookup (prompt lookup, no draft model), composite (lookup, "
    "else the draft model) or prediction (the --prediction, else lookup) (default: model "
    "when --draft is given, else none; a --prediction is drafted from first in any case)"
)
P_MIN_HELP = (
    "stop drafting when the draft's top probability is below this, in [0, 1) (float; default off)"
)
SEED_HELP = "random seed (int; default 0)"
MAX_NEW_TOKENS_HELP = "generation budget >= 1 (int; default 128)"
NO_PROGRESS_HELP = "hide the progress bar (flag; default off)"
TARGET_HELP = "target model, BACKEND:NAME_OR_PATH (str; required)"
DRAFT_HELP = "draft model SPEC, or 'none' for target-only decoding (str; default none)"
TAG_HELP = "suffix for the artifact name (str; default none)"
PREFIX_HELP = "tokens cached before each probe, >= 1 (int; default 100)"


# ------------------------------------------------------------------------------ types / checks
def k_value(text: str) -> int | str:
    """argparse type for -k: core.config.parse_k, its error as argparse's."""
    try:
        return parse_k(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_threads(threads: int | None) -> None:
    """--threads is None (the cores other work leaves free) or >= 1; ValueError otherwise (the
    CLI prints it)."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


# ------------------------------------------------------------------------------ flag groups
def add_model_args(
    p: argparse.ArgumentParser,
    target_default: str | None = None,
    target_help: str = TARGET_HELP,
    draft_default: str | None = "none",
    draft_help: str = DRAFT_HELP,
) -> None:
    """--target SPEC (required unless given a default) and --draft SPEC, where 'none' (any case)
    means no draft model (`draft_spec`; `load_pair` loads both)."""
    p.add_argument(
        "--target",
        required=target_default is None,
        default=target_default,
        metavar="SPEC",
        help=target_help,
    )
    p.add_argument("--draft", default=draft_default, metavar="SPEC", help=draft_help)


def add_device_args(
    p: argparse.ArgumentParser,
    threads: bool = True,
    device_help: str = DEVICE_HELP,
    threads_help: str = THREADS_HELP,
) -> None:
    """--device (str; None = best available) and, with `threads`, --threads (int; None = the
    cores other work leaves free; check it with `check_threads`)."""
    p.add_argument("--device", default=None, help=device_help)
    if threads:
        p.add_argument("--threads", type=int, default=None, help=threads_help)


def add_spec_args(
    p: argparse.ArgumentParser,
    k_default: int | str | None = 4,
    k_help: str = K_HELP,
    k_max_default: int | None = None,
    k_max_help: str = K_MAX_HELP,
    drafter_default: str | None = None,
    drafter_help: str = DRAFTER_HELP,
    p_min_help: str = P_MIN_HELP,
) -> None:
    """The speculative method: -k/--k (`k_value`), --k-max, --drafter (one of DRAFTERS) and
    --p-min. A None default means "not given" (the consumer applies its own default)."""
    p.add_argument("-k", "--k", type=k_value, default=k_default, help=k_help)
    p.add_argument("--k-max", type=int, default=k_max_default, help=k_max_help)
    p.add_argument("--drafter", choices=DRAFTERS, default=drafter_default, help=drafter_help)
    p.add_argument("--p-min", type=float, default=None, help=p_min_help)


def add_sampling_args(
    p: argparse.ArgumentParser,
    seed: bool = True,
    max_new_tokens: bool = True,
) -> None:
    """One flag per core.config.Warp field, named after it (-t/--temperature, --top-k, --top-p,
    --min-p, --typical-p), with its type, help and default, and optionally --seed (default 0)
    and --max-new-tokens (default 128). Ranges are checked by the consumer (Warp)."""
    for f in fields(Warp):
        flag = "--" + f.name.replace("_", "-")
        names = ("-t", flag) if f.name == "temperature" else (flag,)
        p.add_argument(*names, type=f.metadata["type"], default=f.default, help=f.metadata["help"])
    if seed:
        p.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    if max_new_tokens:
        p.add_argument("--max-new-tokens", type=int, default=128, help=MAX_NEW_TOKENS_HELP)


def add_deterministic_arg(p: argparse.ArgumentParser, help: str = DETERMINISTIC_HELP) -> None:
    """--deterministic (flag): load llama.cpp models batch-invariant (backends.load_model)."""
    p.add_argument("--deterministic", action="store_true", help=help)


def add_no_progress_arg(p: argparse.ArgumentParser, help: str = NO_PROGRESS_HELP) -> None:
    p.add_argument("--no-progress", action="store_true", help=help)


def add_prefix_arg(p: argparse.ArgumentParser, help: str = PREFIX_HELP) -> None:
    """--prefix (int, default 100): the context a cost probe runs on (microbench, doctor), so
    that their step times compare; the consumer checks it is >= 1."""
    p.add_argument("--prefix", type=int, default=100, help=help)


def add_out_arg(p: argparse.ArgumentParser, artifact: str) -> None:
    """--out DIR (default results/): the directory the command writes `artifact` into."""
    p.add_argument(
        "--out",
        default="results",
        metavar="DIR",
        help=f"directory for {artifact} (path; default results/)",
    )


def add_tag_arg(p: argparse._ActionsContainer, help: str = TAG_HELP) -> None:
    """--tag (str; None: no suffix) for the artifact's file name;
    study.run.bench_settings.tag_suffix checks it is safe in a file name."""
    p.add_argument("--tag", default=None, help=help)


# ------------------------------------------------------------------------------ reading flags
def spec_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `add_spec_args` as core.config.SpecConfig's keywords (None: not given)."""
    return {"drafter": args.drafter, "k": args.k, "k_max": args.k_max, "p_min": args.p_min}


def warp_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of `add_sampling_args` as core.config.Warp's keywords (None: not given)."""
    return {name: getattr(args, name) for name in WARP_FIELDS}


def load_pair(
    args: argparse.Namespace, target: str, draft: str | None
) -> tuple[SpecModel, SpecModel | None]:
    """The target and the draft (`draft_spec`: None for none) loaded with the flags of
    `add_device_args` and `add_deterministic_arg`; --threads is checked before any loading."""
    from specdec.backends import load_model

    check_threads(args.threads)
    kw = {"device": args.device, "n_threads": args.threads, "deterministic": args.deterministic}
    draft_model = draft_spec(draft)
    return load_model(target, **kw), None if draft_model is None else load_model(draft_model, **kw)


def model_blocks(
    args: argparse.Namespace, target: SpecModel, draft: SpecModel | None
) -> dict[str, Model | None]:
    """The artifact's `models` block of --target and --draft as `load_pair` loaded them."""
    from specdec.study.artifacts.provenance import model_block

    return {
        "target": model_block(args.target, target),
        "draft": model_block(args.draft, draft) if draft is not None else None,
    }
