"""`specdec` command line.

Each subcommand lives in a module of this package with `add(subparsers)`, which declares it and
sets `func`; `func(args) -> int` runs it. Modules are imported only for the subcommand being run
(all of them for the top-level --help), so `specdec models list` loads neither torch nor fastapi.
Add a subcommand to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specdec.backends.registry import ModelFetchError
from specdec.cli.args import EXIT_ERROR, EXIT_INTERRUPTED, error

#: subcommand -> the module that declares it (one module may declare several)
COMMANDS = {
    "models": "specdec.cli.models",
    "generate": "specdec.cli.generate",
    "bench": "specdec.cli.bench",
    "sweep": "specdec.cli.bench",
    "microbench": "specdec.cli.microbench",
    "doctor": "specdec.cli.doctor",
    "gate": "specdec.cli.gate",
    "invariance": "specdec.cli.invariance",
    "profile": "specdec.cli.profile",
    "figures": "specdec.cli.figures",
    "report": "specdec.cli.figures",
    "serve": "specdec.cli.serve",
    "anchors": "specdec.cli.anchors",
    "replay": "specdec.cli.replay",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for `command` alone, or for every subcommand when it is None or unknown."""
    parser = argparse.ArgumentParser(
        prog="specdec", description="Lossless speculative decoding and its measurement harness."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [COMMANDS[command]] if command in COMMANDS else list(COMMANDS.values())
    for module in dict.fromkeys(wanted):
        importlib.import_module(module).add(subparsers)
    return parser


#: llama.cpp's system-info switches that are not instruction sets
_NOT_ISA = {"LLAMAFILE", "OPENMP", "REPACK", "KLEIDIAI"}


def version_line() -> str:
    """`specdec --version`: the versions and the CPU kernels llama.cpp runs here."""
    from importlib.metadata import version

    parts = [f"specdec {version('specdec')}"]
    try:
        from specdec.backends.llamacpp_kernels import kernels

        k = kernels()
    except Exception as e:  # no llama-cpp-python, or a build that does not load: say so
        parts.append(f"llama.cpp unavailable ({type(e).__name__}: {e})")
    else:
        parts.append(f"llama-cpp-python {k['llama_cpp_python']}")
        isa = [f for f in k["features"] if f not in _NOT_ISA]
        parts.append(f"CPU kernels: {k['build']} ({' '.join(isa)}) on {k['cpu_model']}")
        sdmm, sdfa = k.get("sdmm"), k.get("sdfa")
        parts.append(f"verify matmul: sdmm {sdmm}" if sdmm else "verify matmul: ggml's (sdmm off)")
        parts.append(f"attention: sdfa {sdfa}" if sdfa else "attention: ggml's (sdfa off)")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:
        print(version_line())
        return 0
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and usage errors; callers want a code
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return args.func(args)
    except (ModelFetchError, ValueError) as e:  # bad input: name it, no traceback
        return error(str(e))
    except KeyboardInterrupt:
        return error("interrupted", EXIT_INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(main())
