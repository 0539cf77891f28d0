"""The package layout's one rule, enforced: imports run one way (the style guide, principle 13).

    core      torch and the standard library only, nothing that reads or writes files or talks
              to the network, and no import cycle; nothing else of specdec
    backends  core
    study     core, backends; inside it four rooms, each importing only the rooms listed:
                artifacts  no other room (the schema is read by everyone, reads no one)
                engines    artifacts
                present    artifacts (figures and the report are drawn from files alone)
                run        artifacts, engines, present
              and no module of its own outside the rooms
    serve     core, backends
    cli       anything, imported lazily per subcommand

Every import is read from the source (module level and inside functions alike), so a lazy import
that breaks the rule fails here too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import specdec

SRC = Path(specdec.__file__).parent
ALLOWED = {
    "core": {"core"},
    "backends": {"core", "backends"},
    "study": {"core", "backends", "study"},
    "serve": {"core", "backends", "serve"},
    "cli": {"core", "backends", "study", "serve", "cli"},
}
#: The study's rooms and the rooms each may import besides itself (the docstring's table).
STUDY_ROOMS = {
    "artifacts": set(),
    "engines": {"artifacts"},
    "present": {"artifacts"},
    "run": {"artifacts", "engines", "present"},
}
#: What the core may import from outside the standard library.
CORE_THIRD_PARTY = {"torch"}
#: The standard library the core may import: none of it reads or writes files or opens a socket.
#: `os` only for its environment (core.device reads $SPECDEC_DEVICE): see CORE_OS_NAMES.
CORE_STDLIB = {
    "__future__",
    "abc",
    "array",
    "bisect",
    "collections",
    "contextlib",
    "dataclasses",
    "enum",
    "functools",
    "itertools",
    "math",
    "numbers",
    "operator",
    "os",
    "re",
    "statistics",
    "time",
    "typing",
    "weakref",
}
#: The names of `os` the core may use.
CORE_OS_NAMES = {"environ"}
#: torch's own file and network entry points, which the core must not call.
TORCH_IO_NAMES = {"load", "save", "hub", "from_file", "jit", "onnx", "distributed", "package"}


def _imports(
    path: Path,
    *,
    typing_only: bool = True,
    package: list[str] | None = None,
    names: bool = False,
) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved
    (against `package`, by default the file's own); without `typing_only`, leaving out those
    under `if TYPE_CHECKING:` (they never run); with `names`, `from P import x` also as P.x
    (x may be a module: the caller knows which names are)."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = ["specdec", *path.relative_to(SRC).parent.parts]
    skip = set() if typing_only else {id(n) for n in _type_checking_blocks(tree)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if mod == "specdec" or names:  # `from specdec import x`: x is the module imported
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _type_checking_blocks(tree: ast.AST) -> list[ast.AST]:
    """Every node inside an `if TYPE_CHECKING:` block."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            for stmt in node.body:
                out += ast.walk(stmt)
    return out


def _package(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else ""


MODULES = sorted(p for p in SRC.rglob("*.py") if _package(p))


def test_every_module_is_in_a_package_of_the_rule() -> None:
    assert {_package(p) for p in MODULES} == set(ALLOWED)
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert top == ["__init__.py"], f"modules outside the packages: {top}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_run_one_way(path: Path) -> None:
    pkg = _package(path)
    bad = []
    for line, mod in _imports(path):
        parts = mod.split(".")
        if parts[0] != "specdec":
            if pkg == "core" and parts[0] not in sys.stdlib_module_names | CORE_THIRD_PARTY:
                bad.append(f"line {line}: {mod} (core depends on torch alone)")
            continue
        if len(parts) < 2 or parts[1] not in ALLOWED:
            bad.append(f"line {line}: {mod} (not a package of the layout)")
        elif parts[1] not in ALLOWED[pkg]:
            bad.append(f"line {line}: {mod} ({pkg} may import {sorted(ALLOWED[pkg])})")
        elif pkg == "study" and parts[1] == "study":
            bad += _study_room_breach(path, line, parts)
    assert not bad, f"{path.relative_to(SRC)}:\n  " + "\n  ".join(bad)


def _room(path: Path) -> str | None:
    """The study room a module is in ("run" for study/run/bench.py); None outside the rooms."""
    parts = path.relative_to(SRC).parts
    return parts[1] if parts[0] == "study" and len(parts) > 2 else None


def _study_room_breach(path: Path, line: int, parts: list[str]) -> list[str]:
    """What is wrong with a study module importing specdec.study.<parts[2:]>: a room it may not
    import, or the study package itself (which hides the room)."""
    mod = ".".join(parts)
    if len(parts) < 3 or parts[2] not in STUDY_ROOMS:
        return [f"line {line}: {mod} (import from a study room: {sorted(STUDY_ROOMS)})"]
    room, other = _room(path), parts[2]
    if room is None or other == room or other in STUDY_ROOMS[room]:
        return []
    return [f"line {line}: {mod} (study/{room} may import {sorted(STUDY_ROOMS[room])})"]


STUDY = sorted((SRC / "study").rglob("*.py"))


def test_every_study_module_is_in_a_room() -> None:
    loose = [str(p.relative_to(SRC)) for p in STUDY if _room(p) is None]
    assert loose == ["study/__init__.py"], f"study modules outside the rooms: {loose}"
    assert {_room(p) for p in STUDY} - {None} == set(STUDY_ROOMS)


def test_the_room_check_catches_a_backward_import() -> None:
    """The room rule can fail: present/ importing run/, artifacts/ importing anything."""
    present = SRC / "study" / "present" / "figures.py"
    schema = SRC / "study" / "artifacts" / "base.py"
    run = SRC / "study" / "run" / "bench.py"
    assert _study_room_breach(present, 1, "specdec.study.run.bench".split("."))
    assert _study_room_breach(schema, 1, "specdec.study.present.fmt".split("."))
    assert _study_room_breach(run, 1, "specdec.study".split("."))  # which room?
    assert not _study_room_breach(run, 1, "specdec.study.engines.anchors".split("."))
    assert not _study_room_breach(present, 1, "specdec.study.artifacts.bench".split("."))


def test_the_walker_resolves_relative_and_lazy_imports() -> None:
    """The walker resolves relative and lazy imports (else the rule test could not fail)."""
    f = SRC / "core" / "decode.py"
    mods = {m for _, m in _imports(f)}
    assert "specdec.core.sampling" in mods and "torch" in mods
    lazy = [m for _, m in _imports(SRC / "backends" / "__init__.py")]
    assert "specdec.backends.mock" in lazy  # imported inside a function


def test_public_api_resolves() -> None:
    for name in specdec.__all__:
        assert getattr(specdec, name) is not None


def test_models_list_loads_neither_torch_nor_fastapi() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from specdec.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['models', 'list']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'fastapi', 'transformers', 'numpy') "
        "if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"`specdec models list` imported {out.stdout.strip()}"


# ------------------------------------------------------------------------------ the core
CORE = sorted((SRC / "core").glob("*.py"))


def _io_uses(path: Path) -> list[str]:
    """What in a module could touch files or the network: imports outside torch, CORE_STDLIB
    and specdec.core; the builtin open(); os beyond CORE_OS_NAMES; torch's TORCH_IO_NAMES."""
    bad = []
    for line, mod in _imports(path, package=["specdec", "core"]):
        top = mod.split(".")[0]
        core = mod == "specdec.core" or mod.startswith("specdec.core.")
        if not core and top not in CORE_STDLIB | CORE_THIRD_PARTY:
            bad.append(f"line {line}: imports {mod}")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("open", "exec", "eval", "__import__"):
                bad.append(f"line {node.lineno}: calls {node.func.id}()")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, name = node.value.id, node.attr
            if (owner == "os" and name not in CORE_OS_NAMES) or (
                owner == "torch" and name in TORCH_IO_NAMES
            ):
                bad.append(f"line {node.lineno}: uses {owner}.{name}")
    return bad


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_core_touches_no_file_and_no_network(path: Path) -> None:
    """The core is the algorithm: files (cost curves, caches) and sockets belong to backends
    and to the callers that own the process (serve, cli, study)."""
    bad = _io_uses(path)
    assert not bad, f"core/{path.name}:\n  " + "\n  ".join(bad)


def test_the_io_check_catches_files_and_sockets(tmp_path: Path) -> None:
    """The check above can fail: each of these is reported."""
    f = tmp_path / "probe.py"
    f.write_text(
        "import json\nfrom pathlib import Path\nimport socket\nimport os\nimport torch\n"
        "from . import model\n"
        "def f(p):\n    os.remove(p)\n    torch.save({}, p)\n    return open(p).read()\n"
    )
    found = " ".join(_io_uses(f))
    assert "model" not in found  # a relative import of the core is the core's
    for what in ("json", "pathlib", "socket", "os.remove", "torch.save", "open()"):
        assert what in found, what


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


ROOT = SRC.parent.parent
#: Every tree of Python the repository holds, for the rules that hold everywhere (no import cycle,
#: the size rule): the library, its tests and its scripts.
TREES = {
    "src": sorted(SRC.rglob("*.py")),
    "tests": sorted((ROOT / "tests").rglob("*.py")),
    "scripts": sorted((ROOT / "scripts").rglob("*.py")),
}


def _module_name(path: Path) -> str:
    """specdec.backends.hf for src/specdec/backends/hf.py (a package by its own name); a test or
    script module by its file's stem, as its neighbours import it."""
    if not path.is_relative_to(SRC):
        return path.stem
    parts = ["specdec", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph(paths: list[Path]) -> dict[str, set[str]]:
    """module -> the modules of `paths` it imports (lazy and annotation-only imports included: a
    type a module only names still ties the two together); `from P import m` counts P.m where
    that is one of them. A module's own packages are left out: Python runs them first whatever
    the module imports."""
    known = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        me = _module_name(path)
        package = None if path.is_relative_to(SRC) else []  # tests and scripts: no packages
        deps = {m for _, m in _imports(path, package=package, names=True)}
        graph[me] = {d for d in deps & known if d != me and not me.startswith(d + ".")}
    return graph


@pytest.mark.parametrize("tree", sorted(TREES))
def test_no_import_cycle_anywhere(tree: str) -> None:
    """Each module can be read (and imported) after the ones it imports, in the library, the
    tests and the scripts alike: a cycle would mean two modules that only make sense together.
    An import under `if TYPE_CHECKING:` counts: a protocol both sides name goes to a module of
    its own (core.protocols)."""
    cycle = _cycle(_module_graph(TREES[tree]))
    assert cycle is None, f"{tree}: " + " -> ".join(cycle or ())


def test_the_module_graph_resolves_submodules_and_skips_parents(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from b import helper\n")
    (tmp_path / "b.py").write_text("def helper():\n    import a\n")
    graph = _module_graph([tmp_path / "a.py", tmp_path / "b.py"])
    assert graph == {"a": {"b"}, "b": {"a"}} and _cycle(graph) == ["a", "b", "a"]
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
    )
    assert _module_graph([tmp_path / "a.py", tmp_path / "c.py"])["c"] == {"a"}  # annotations count
    hf, backends = SRC / "backends" / "hf.py", SRC / "backends" / "__init__.py"
    graph = _module_graph([hf, backends, SRC / "backends" / "llamacpp.py", *CORE])
    assert "specdec.backends" not in graph["specdec.backends.llamacpp"]  # its own package
    assert "specdec.backends.hf" in graph["specdec.backends"]  # a lazy import counts
    assert "specdec.core.model" in graph["specdec.backends.hf"]


def test_the_cycle_check_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"config": {"sampling"}, "sampling": {"config"}}) == [
        "config",
        "sampling",
        "config",
    ]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    core = _module_graph(CORE)
    assert "specdec.core.sampling" in core["specdec.core.decode"]


#: The size rule: a module a reader can hold in mind, a function that fits on a screen or two.
#: The one exception is a subcommand's argparse builder (cli/<name>.py `add`): a flat list of
#: options, read as a table, longer when the command has more flags.
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    if len(text.splitlines()) > MAX_MODULE_LINES:
        found.append(f"{len(text.splitlines())} lines (at most {MAX_MODULE_LINES})")
    builder = path.parent.name == "cli" and path.name != "args.py"
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = node.end_lineno - node.lineno + 1
        if n > MAX_FUNCTION_LINES and not (builder and node.name == "add"):
            found.append(f"{node.name} (line {node.lineno}): {n} lines")
    return found


@pytest.mark.parametrize(
    "path", [p for paths in TREES.values() for p in paths], ids=lambda p: str(p.relative_to(ROOT))
)
def test_modules_and_functions_stay_small(path: Path) -> None:
    bad = _oversized(path)
    assert not bad, f"{path.relative_to(ROOT)}: split it:\n  " + "\n  ".join(bad)


#: core/ is what a reader reads to understand speculative decoding, serve/ where new endpoints
#: land: their modules are held tighter, so the loop (core/decode.py) stays readable as one piece,
#: a drafter gets a module of its own, and a module of serve/ keeps one job.
MAX_CORE_MODULE_LINES = 500


@pytest.mark.parametrize("package", ["core", "serve"])
def test_core_and_serve_modules_stay_smaller(package: str) -> None:
    long = {p.name: len(p.read_text().splitlines()) for p in (SRC / package).glob("*.py")}
    long = {name: n for name, n in long.items() if n > MAX_CORE_MODULE_LINES}
    assert not long, f"{package} modules over {MAX_CORE_MODULE_LINES} lines, split them: {long}"


def test_the_size_check_catches_a_long_module_and_function(tmp_path: Path) -> None:
    long_fn = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    f = tmp_path / "probe.py"
    f.write_text(long_fn + "\n" * MAX_MODULE_LINES)
    found = " ".join(_oversized(f))
    assert "f (line 1)" in found and "lines (at most" in found
    cli = tmp_path / "cli"
    cli.mkdir()
    (cli / "probe.py").write_text(long_fn.replace("def f", "def add"))
    assert _oversized(cli / "probe.py") == []  # a subcommand's argparse builder


#: The test modules that belong to no one package: the public API as a user calls it, and the
#: checks of the repository itself (docs, this layout, the suite's scheduler).
CROSS_CUTTING_TESTS = {"test_api.py", "test_docs.py", "test_layout.py", "test_schedule.py"}


def test_tests_mirror_the_packages() -> None:
    """tests/<package>/test_*.py tests src/specdec/<package>/, so a change to a package has its
    tests in one place; the helpers shared by several (support, serverkit, ...) sit beside
    conftest.py."""
    tests = ROOT / "tests"
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    stray = [
        str(p.relative_to(tests))
        for p in tests.rglob("test_*.py")
        if p.parent.name not in packages
        and not (p.parent == tests and p.name in CROSS_CUTTING_TESTS)
    ]
    assert not stray, f"move these under tests/<package>/: {stray}"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test modules share a name (pytest imports by name)"
