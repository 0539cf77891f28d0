"""llama-cpp-python's ctypes bindings and the native libraries beside them, loaded once: the
one place that imports llama_cpp, initializes llama.cpp's backend, tames its logging and finds
libggml-cpu (where specdec's sdmm and sdfa live). backends.llamacpp and backends.llamacpp_ops
both read them from here, so neither imports the other's privates.

    bindings()        llama_cpp.llama_cpp, the backend initialized (once)
    ggml_lib(name)    libggml-NAME beside libllama, as a ctypes library
    package_dir()     where the llama_cpp package is, found without importing it
    package_with_cpu_backend(flavor, dest)
                      a copy of it that runs another flavor of ggml-cpu (tests, benchmarks)
    load_log()        collects llama.cpp's info lines while a model loads
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specdec.core.model import SpecModelError

log = logging.getLogger("specdec.backends.llamacpp")

_GGML_LOG_LEVEL_WARN, _GGML_LOG_LEVEL_ERROR = 3, 4  # ggml_log_level; 5 continues a line

_backend_ready = False
_log_callback: Any = None  # keeps the ctypes callback alive for as long as llama.cpp may call it
_log_sink: list[str] | None = None  # collects llama.cpp's INFO lines while a model loads


def bindings() -> Any:
    """The ctypes bindings, with the backend initialized and llama.cpp's logging tamed (once)."""
    global _backend_ready, _log_callback
    if not _backend_ready:
        _check_build()
    try:
        import llama_cpp.llama_cpp as llama
    except ImportError as e:
        raise SpecModelError(
            "the llamacpp backend needs llama-cpp-python (pip install llama-cpp-python); "
            "or load the model with the hf: backend"
        ) from e
    if not _backend_ready:

        @llama.llama_log_callback
        def forward_errors(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            # llama.cpp prints hundreds of info lines per model load; keep its warnings and
            # errors, and hand the rest to a load that asked for them (buffer types).
            line = text.decode("utf-8", "replace").rstrip()
            if level in (_GGML_LOG_LEVEL_WARN, _GGML_LOG_LEVEL_ERROR):
                log.warning("llama.cpp: %s", line)
            elif _log_sink is not None:
                _log_sink.append(line)

        _log_callback = forward_errors
        llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama.llama_backend_init()
        _backend_ready = True
    return llama


def package_dir() -> Path | None:
    """Where the llama_cpp package is, found without importing it (importing loads libllama)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def package_with_cpu_backend(flavor: str, dest: Path, log=print) -> Path:
    """A copy of the installed llama_cpp package under `dest` whose libggml-cpu is `flavor`'s
    (llamacpp_build.build_cpu_backend): with `dest` first on PYTHONPATH, a process runs that
    flavor's kernels. Returns `dest`."""
    from specdec.backends import llamacpp_build

    src = package_dir()
    if src is None:
        raise llamacpp_build.BuildError("llama_cpp is not installed here (make venv)")
    lib = llamacpp_build.build_cpu_backend(flavor, log=log)
    shutil.copytree(src, dest / "llama_cpp")
    for name in (dest / "llama_cpp" / "lib").glob("libggml-cpu.so*"):
        shutil.copy2(lib, name)
    return dest


def _check_build() -> None:
    """Refuse, with the fix, a native build made for instructions this CPU lacks."""
    from specdec.backends import llamacpp_build

    where = package_dir()
    if where is not None:
        try:
            llamacpp_build.check_build(where)
        except llamacpp_build.BuildError as e:
            raise SpecModelError(str(e)) from None


@functools.cache
def ggml_lib(name: str) -> Any:
    """libggml-NAME ("cpu": sdmm's and sdfa's C functions live there in specdec's build; "base":
    ggml's tensor accessors) from the package's lib/ folder, as a ctypes library, looked up once
    per process. libllama is loaded first (`bindings`), so this is the copy it already runs: the
    loader hands back the same file's handle."""
    bindings()
    where = package_dir()
    path = where / "lib" / f"libggml-{name}.so" if where is not None else None
    if path is None or not path.exists():
        raise SpecModelError(f"llama-cpp-python has no libggml-{name}.so; rebuild it: make venv")
    return ctypes.CDLL(str(path))


@contextmanager
def load_log() -> Iterator[list[str]]:
    """The info lines llama.cpp logs inside the block (a model load's buffer report); its
    warnings and errors go to the log as always."""
    global _log_sink
    lines: list[str] = []
    _log_sink = lines
    try:
        yield lines
    finally:
        _log_sink = None
