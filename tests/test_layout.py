"""The package layout's one rule, enforced: imports run one way (STYLE.md, principle 13).

    core      torch and the standard library only; nothing else of specdec
    backends  core
    study     core, backends
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
#: What the core may import from outside the standard library.
CORE_THIRD_PARTY = {"torch"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ["specdec", *path.relative_to(SRC).parent.parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if mod == "specdec":  # `from specdec import x`: x is the module imported
                out += [(node.lineno, f"specdec.{a.name}") for a in node.names]
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
    assert not bad, f"{path.relative_to(SRC)}:\n  " + "\n  ".join(bad)


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
