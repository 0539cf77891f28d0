"""Which host and which run each artifact comes from, as REPORT.md names them.

Every artifact's `meta` (provenance.meta_block) says where it was made: the CPU
(`machine.cpu_model`), the llama.cpp kernels the process ran (`machine.kernels`), the load, and
when (`created`). A results directory may hold runs of several hosts and days, and the same
measurement under two tags (a verify curve with specdec's kernels and with ggml's), so the report
opens with one table of hosts and heads each artifact's section with its tag and host:
"Verify curve — ctx512 — Intel Xeon @ 2.60GHz, 2026-12-02".

A host is the CPU model with its compiled-in features, core count, memory and GPU: the same VM
type on another day is the same host when all of these match. Artifacts made before
`cpu_model` was recorded still read; their host says "CPU not recorded".
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any

from specdec.study.present import fmt

#: Vendor marks and filler words left out of a CPU's short name.
_NOISE = re.compile(r"\((?:R|TM|tm|r)\)|\bProcessor\b|\bCPU\b")


def _machine(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    m = meta.get("machine")
    return m if isinstance(m, Mapping) else {}


def _kernels(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    k = _machine(meta).get("kernels")
    return k if isinstance(k, Mapping) else None


def short_cpu(cpu_model: str | None) -> str:
    """'Intel(R) Xeon(R) Processor @ 2.60GHz' -> 'Intel Xeon @ 2.60GHz'."""
    if not cpu_model:
        return "CPU not recorded"
    return " ".join(_NOISE.sub(" ", cpu_model).split())


def host_key(meta: Mapping[str, Any]) -> str:
    """What makes two artifacts' hosts the same (see the module docstring)."""
    m, k = _machine(meta), _kernels(meta) or {}
    parts = [m.get(x) for x in ("cpu_model", "cpu_count", "ram_gb", "cuda")]
    return json.dumps([*parts, sorted(k.get("features") or [])])


def date(meta: Mapping[str, Any]) -> str:
    """The day an artifact was made (UTC), 'date not recorded' without one."""
    return str(meta.get("created") or "")[:10] or "date not recorded"


def tag(meta: Mapping[str, Any]) -> str | None:
    """The run's `--tag`, read from the command that made it (None: not tagged)."""
    try:
        words = shlex.split(str(meta.get("command") or ""))
    except ValueError:
        return None
    for i, w in enumerate(words):
        if w == "--tag" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--tag="):
            return w.split("=", 1)[1]
    return None


def kernels_text(meta: Mapping[str, Any]) -> str:
    """Which matmul and attention kernels the process ran: specdec's (sdmm, sdfa, with their
    paths), or ggml's and why (turned off, or a build without them)."""
    k = _kernels(meta)
    if k is None:
        return "kernels not recorded (no llama.cpp in the process, or before they were)"
    amx = ", AMX" if "AMX_INT8" in (k.get("features") or []) else ""
    if k.get("sdmm") or k.get("sdfa"):
        paths = fmt.join(*(f"{n} {k[n]}" for n in ("sdmm", "sdfa") if k.get(n)))
        return f"specdec's ({paths}){amx}"
    if any("sdmm" in p for p in k.get("patches") or []):
        return f"ggml's (sdmm and sdfa off){amx}"
    return f"ggml's (a build without sdmm and sdfa){amx}"


def load_text(meta: Mapping[str, Any]) -> str:
    load = _machine(meta).get("load_avg")
    return "load not recorded" if not load else f"load {load[0]:.2f} (1 min)"


def _versions(meta: Mapping[str, Any]) -> str:
    vers = (meta.get("versions") or {}).items()
    return ", ".join(f"{n} {'not recorded' if v is None else v}" for n, v in vers)


class Hosts:
    """The hosts of a study's artifacts, each with a name unique in the report."""

    def __init__(self, metas: Mapping[str, Mapping[str, Any]]) -> None:
        self.metas = metas
        self.members: dict[str, list[str]] = {}  # host key -> srcs, in src order
        for src in sorted(metas):
            self.members.setdefault(host_key(metas[src]), []).append(src)
        self.names: dict[str, str] = {}
        seen: dict[str, int] = {}  # short name -> hosts named so far
        for key, srcs in self.members.items():
            machine = _machine(metas[srcs[0]])
            name = short_cpu(machine.get("cpu_model"))
            name += f" + {machine['cuda']}" if machine.get("cuda") else ""
            seen[name] = seen.get(name, 0) + 1
            self.names[key] = name if seen[name] == 1 else f"{name} (host {seen[name]})"

    def name(self, src: str) -> str:
        return self.names[host_key(self.metas[src])]

    def where(self, src: str) -> str:
        """'Intel Xeon @ 2.60GHz, 2026-12-02': an artifact's host and day."""
        return f"{self.name(src)}, {date(self.metas[src])}"

    def heading(self, what: str, src: str) -> str:
        """A section heading: what, the run's tag (else its file), the host and day."""
        meta = self.metas[src]
        return f"### {what} — {tag(meta) or src} — {self.where(src)}"

    def provenance(self, src: str) -> str:
        """'Kernels: …; load ….' for the line under a heading."""
        meta = self.metas[src]
        return f"Kernels: {kernels_text(meta)}; {load_text(meta)}."

    def table(self) -> list[str]:
        """One row per host: the CPU, its features, cores and memory, the days and files."""
        rows = []
        for key, srcs in self.members.items():
            meta = self.metas[srcs[0]]
            m, k = _machine(meta), _kernels(meta) or {}
            days = sorted({date(self.metas[s]) for s in srcs})
            versions = sorted({_versions(self.metas[s]) for s in srcs})
            rows.append(
                [
                    self.names[key],
                    str(m.get("cpu_model") or "not recorded"),
                    " ".join(k.get("features") or []) or "not recorded",
                    f"{m.get('cpu_count', '?')} / {m.get('ram_gb', '?')}",
                    " – ".join(dict.fromkeys([days[0], days[-1]])),
                    str(len(srcs)),
                    "; ".join(versions) or "not recorded",
                ]
            )
        header = ["Host", "CPU model", "ggml features", "Cores / RAM (GB)", "Made", "Artifacts"]
        return fmt.md_table([*header, "Versions"], rows)
