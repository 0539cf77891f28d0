"""ik_llama.cpp from its upstream source: where a tree came from, and its copy for the build.

`anchor_build.build(peer="ik", src=DIR)` builds ik_llama.cpp from an upstream tree (a checkout or an
export of https://github.com/ikawrakow/ik_llama.cpp) instead of its Python package's sdist,
whose 0.1.5 aborts with `-np 4` and flash attention (GGML_ASSERT(S > 0), fixed upstream).

- `identify(DIR, commit)`: the tree's source_id, which goes into the build key: "git-<commit>"
  (`commit` as passed, else DIR's HEAD when DIR is the top of a git checkout), plus
  "-dirty-<digest of its changes>" when that checkout has any; without a commit,
  "tree-<digest of every file's name and size>". So a sdist build and an upstream build, or two
  commits, never share a directory.
- `copy(origin, dest, build_info)`: the tree without .git and without any CMake build directory
  in it (DIR is never written to), with common/build-info.cpp written from its commit: without
  .git its CMake would write "unknown" (or, inside another checkout, that one's commit), and
  with the file newer than its template the generating command never runs.
- `selected(anchors)` / `select(anchors, origin)`: SELECTED in the anchors directory names the
  tree the ik peer was last built from (or found built); none (a sdist build removes it) means
  the pinned sdist. anchor_build.anchor_dir("ik") is the directory of that source's key on this CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

#: Names the upstream tree the ik peer was last built from, in $SPECDEC_HOME/anchors/.
SELECTED = "ik-source.json"
#: What must be there for a directory to be taken for an ik_llama.cpp tree.
MARKERS = ("CMakeLists.txt", "common/build-info.cpp.in", "examples/server", "ggml/src/iqk")


class SourceError(ValueError):
    """DIR is not an ik_llama.cpp tree, or the commit given for it is not a commit id."""


def files(src: Path) -> list[Path]:
    """The files of a tree, relative and sorted; no .git, no directory holding a
    CMakeCache.txt (`cmake -B build` inside it); symlinks listed, never followed."""
    out: list[Path] = []
    for root, dirs, names in os.walk(src):
        here = Path(root)
        links = [d for d in dirs if (here / d).is_symlink()]
        dirs[:] = sorted(
            d
            for d in dirs
            if d != ".git" and d not in links and not (here / d / "CMakeCache.txt").exists()
        )
        out += [(here / f).relative_to(src) for f in (*names, *links)]
    return sorted(out)


def _git(src: Path, *args: str) -> str | None:
    """`git -C src args` stdout, stripped; None where there is no git or it fails."""
    if shutil.which("git") is None:
        return None
    res = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def check_tree(src: Path) -> Path:
    """`src`, resolved, if it is an ik_llama.cpp tree; SourceError otherwise."""
    src = Path(src).expanduser().resolve()
    missing = [n for n in MARKERS if not (src / n).exists()]
    if missing:
        raise SourceError(
            f"{src} is not an ik_llama.cpp source tree (no {', '.join(missing)}); pass the "
            "top of a checkout of https://github.com/ikawrakow/ik_llama.cpp"
        )
    return src


def identify(src: Path, commit: str | None = None) -> dict:
    """{"source_id", "src", "commit", "dirty"} of the tree `src` (module docstring)."""
    src = check_tree(src)
    dirty = None
    top = _git(src, "rev-parse", "--show-toplevel") if (src / ".git").exists() else None
    if commit is None and top and Path(top).resolve() == src:  # not a checkout around it
        commit = _git(src, "rev-parse", "HEAD")
        diff = _git(src, "diff", "HEAD", "--binary") if commit else None
        untracked = _git(src, "ls-files", "--others", "--exclude-standard") if commit else None
        if diff or untracked:
            dirty = hashlib.sha256(f"{diff}\0{untracked}".encode()).hexdigest()[:12]
    if commit:
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", commit):
            raise SourceError(f"--commit must be a git commit id (hex), got {commit!r}")
        sid = f"git-{commit.lower()}" + (f"-dirty-{dirty}" if dirty else "")
    else:
        h = hashlib.sha256()
        for rel in files(src):
            h.update(f"{rel}\0{(src / rel).lstat().st_size}\0".encode())
        sid = f"tree-{h.hexdigest()[:16]}"
    return {"source_id": sid, "src": str(src), "commit": commit and commit.lower(), "dirty": dirty}


def copy(origin: dict, dest: Path, build_info: str) -> Path:
    """The tree `origin` (identify) copied to `dest`, with common/build-info.cpp written from
    `build_info` ({commit}: its first 12 hex, or the source_id's)."""
    src = Path(origin["src"])
    for rel in files(src):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel, follow_symlinks=False)
    commit = (origin.get("commit") or origin["source_id"])[:12]
    (dest / "common" / "build-info.cpp").write_text(build_info.format(commit=commit))
    return dest


def selected(anchors: Path) -> dict | None:
    """What SELECTED in `anchors` records (identify's dict), or None: the pinned sdist."""
    try:
        info = json.loads((anchors / SELECTED).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("source_id") else None


def select(anchors: Path, origin: dict | None) -> None:
    """Make `origin` (None: the pinned sdist) the ik build the ik modes run on."""
    path = anchors / SELECTED
    if origin is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{SELECTED}.{os.getpid()}")
    tmp.write_text(json.dumps(origin, indent=2) + "\n")
    os.replace(tmp, path)
