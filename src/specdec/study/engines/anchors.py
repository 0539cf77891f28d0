"""llama.cpp's own tools as the peer, run: its server and its lookup tool (built by
anchor_build.py: stock llama.cpp as its users build it, the "same kernels" twin, ik_llama.cpp),
and `specdec serve` in a process of its own beside them.

`LlamaServer` starts llama-server on a loopback port with a fresh API key, waits for /health,
proves the server is its own (401 without the key, 200 with it) and stops it; `SpecdecServer`
and `PromptCachingServer` do the same for `specdec serve`; `LlamaLookup` runs llama-lookup once
per prompt (it has no server). `check_modes`, `server_for` and `servers_for` turn the bench's and
the gate's mode names (peers.py, re-exported here with the build's AnchorError) into those.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.backends import parse_spec
from specdec.backends.registry import resolve
from specdec.study.engines.anchor_build import AnchorError as AnchorError
from specdec.study.engines.anchor_build import binary, ik_source, manifest
from specdec.study.engines.endpoint import Endpoint
from specdec.study.engines.peers import DEFAULT_MODES as DEFAULT_MODES
from specdec.study.engines.peers import (
    NEUTRAL_SAMPLING,
    PEERS,
    SAME_NUMERICS,
    TOOL_MODES,
    method_name,
    split_peer,
)
from specdec.study.engines.peers import SERVER_MODES as SERVER_MODES
from specdec.study.engines.peers import TARGETS as TARGETS
from specdec.study.engines.peers import plain_mode as plain_mode


# ------------------------------------------------------------------------------ modes
def check_modes(
    modes: Sequence[str], target: str, draft: str, tools: bool = False, built: bool = True
) -> None:
    """ValueError naming the fix for an unknown mode or a pair llama-server cannot load;
    `tools`: TOOL_MODES are allowed too (the bench runs them, the gate does not); `built`:
    the modes are about to run, so an upstream-only mode needs that build here (False: a
    recorded config read back, which names modes without running them)."""
    known = [p.prefix + m for p in PEERS.values() for m in p.modes]
    known += list(TOOL_MODES) if tools else []
    unknown = [m for m in modes if m not in known]
    if unknown:
        where = "" if tools else f" ({', '.join(TOOL_MODES)}: `specdec bench` only)"
        raise ValueError(
            f"unknown llama-server mode(s) {', '.join(unknown)}; choose from "
            f"{', '.join(known)}{where}"
        )
    upstream = [m for m in modes if split_peer(m)[0] in PEERS[split_peer(m)[1]].src_modes]
    if upstream and built and ik_source() is None:
        raise ValueError(
            f"{', '.join(upstream)} need(s) ik_llama.cpp built from its upstream source (the "
            f"ik-llama-cpp-python {PEERS['ik'].version} sdist has no such --spec-type): run "
            "`specdec anchors build --peer ik --src DIR` on a checkout of "
            "https://github.com/ikawrakow/ik_llama.cpp"
        )
    drafted = any(split_peer(m)[0] == "draft" for m in modes)
    need = [("target", target)] + ([("draft", draft)] if drafted else [])
    for role, model_spec in need:
        if not model_spec.startswith("llamacpp:"):
            raise ValueError(
                f"llama-server loads GGUF files: the {role} must be a llamacpp: model, "
                f"got {model_spec}"
            )


def server_for(mode: str, target: Path, draft: Path | None) -> LlamaServer:
    """The LlamaServer that runs `mode` on these GGUF files (all cores, as specdec's backend)."""
    base, peer = split_peer(mode)
    flags = tuple(a.replace("{draft}", str(draft)) for a in PEERS[peer].mode_args(base))
    return LlamaServer(target, (*SAME_NUMERICS, *PEERS[peer].flags, *flags), mode=mode, peer=peer)


def servers_for(
    modes: Sequence[str], target: str, draft: str, tools: bool = False
) -> list[LlamaServer | LlamaLookup]:
    """One LlamaServer per mode (a LlamaLookup per tool mode, with `tools`) on the GGUF files
    of the `target` and `draft` specs (fetched if missing; the draft only when a mode needs
    it), after check_modes; [] for no modes."""
    if not modes:
        return []
    check_modes(modes, target, draft, tools)
    target_path = resolve(parse_spec(target)[1])
    drafted = any(split_peer(m)[0] == "draft" for m in modes)
    draft_path = resolve(parse_spec(draft)[1]) if drafted else None
    return [
        LlamaLookup(target_path) if m in TOOL_MODES else server_for(m, target_path, draft_path)
        for m in modes
    ]


# ------------------------------------------------------------------------------ running
PORT_ATTEMPTS = 3
_BIND_FAILED = re.compile(r"address already in use|couldn't bind|could not bind|errno 98", re.I)


class _PortTaken(Exception):
    pass


def _status(url: str, key: str | None = None) -> int | None:
    """The HTTP status of GET `url` (with `key` as a Bearer token), None when nothing answers."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama-server on 127.0.0.1, as a context manager: started, healthy, then stopped.

    `args` are llama-server flags after the model (e.g. ("--spec-type", "ngram-mod")).
    """

    model: Path
    args: tuple[str, ...] = ()
    mode: str = "none"  # the SERVER_MODES entry `args` came from, for labels
    threads: int | None = None
    ctx: int = 4096
    parallel: int = 1  # -np: requests served at once (study.run.together)
    startup_s: float = 180.0
    exe: Path | None = None
    peer: str = "stock"  # the build it runs (PEERS): stock, the "same kernels" twin, or ik
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None
    #: a fresh API key per start: the server proves it is ours (401 without it, 200 with it)
    key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    kind = "llama-server"  # what the messages call it
    key_env = "LLAMA_API_KEY"  # how the key reaches the process (never on its command line)
    key_file: Path | None = None  # where it does for ik_llama.cpp (mode 0600, removed at stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self) -> Endpoint:
        """How the harness addresses this server: the chat API (the file's own template,
        --jinja, as our bench templates prompts), sampling as specdec does."""
        return Endpoint(
            self.url,
            "target",
            "chat",
            api_key=self.key,
            label=method_name(self.mode),
            extra=NEUTRAL_SAMPLING,
        )

    def describe(self) -> dict:
        """What an artifact records of it: the command (the binary by name) and the build."""
        cmd = self.command()
        return {"command": [Path(cmd[0]).name, *cmd[1:]], "build": manifest(self.peer)}

    def command(self) -> list[str]:
        threads = self.threads or os.cpu_count() or 1
        return [
            str(self.exe or binary("llama-server", self.peer)),
            *("-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(threads), "-tb", str(threads), "-c", str(self.ctx)),
            *("-np", str(self.parallel)),
            "--jinja",  # the GGUF's own chat template, rendered as transformers renders it
            *self._peer_flags(),
            *self.args,
        ]

    def _peer_flags(self) -> tuple[str, ...]:
        """No web UI, and the key's file where the build reads no key from the environment."""
        key = ("--api-key-file", str(self.key_file)) if self.key_file else ()
        return (*PEERS[self.peer].no_ui, *key)

    def __enter__(self) -> LlamaServer:
        # free_port() frees the port before the server binds it, so another process can take
        # it in between: then the server exits (or an impostor answers) and a new port is tried.
        speculative = split_peer(self.mode)[0] != "none"
        if PEERS[self.peer].spec_one_slot and speculative and self.parallel > 1:
            raise AnchorError(
                f"{method_name(self.mode)}: {self.peer}'s llama-server serves speculative "
                f"decoding on one slot only (-np 1), not -np {self.parallel}; run "
                f"{PEERS[self.peer].prefix}none for requests at once"
            )
        fixed = bool(self.port)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = self.port if fixed else free_port()
            self._start()
            try:
                self._wait_healthy()
                return self
            except _PortTaken as e:
                self.stop()
                if fixed or attempt == PORT_ATTEMPTS:
                    raise AnchorError(f"{self.kind}: {e}") from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log = Path(name)
        logf = os.fdopen(fd, "w")
        env = {**os.environ, **dict(PEERS[self.peer].env), self.key_env: self.key}
        if PEERS[self.peer].key_in_file:
            kfd, kname = tempfile.mkstemp(prefix="llama-server-key-")  # created 0600
            with os.fdopen(kfd, "w") as kf:
                kf.write(self.key + "\n")
            self.key_file = Path(kname)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
        logf.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.tail()
                if _BIND_FAILED.search(tail):
                    raise _PortTaken(f"port {self.port} was taken before it could bind")
                raise AnchorError(
                    f"{self.kind} exited ({self.proc.returncode}) while starting:\n{tail}"
                )
            if _status(f"{self.url}/health") == 200:
                # Whatever answers must be this process: it refuses a request without our key
                # and serves one with it (on its peer's probe: PEERS).
                probe = self.url + PEERS[self.peer].probe
                if _status(probe) == 401 and _status(probe, self.key) == 200:
                    return
                raise _PortTaken(f"another process answers on port {self.port}")
            time.sleep(0.25)
        raise AnchorError(f"{self.kind} not healthy after {self.startup_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for path in (self.log, self.key_file):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()


@dataclass
class SpecdecServer(LlamaServer):
    """`specdec serve` in a process of its own, as a user runs it: the bench's served baseline
    and speculative methods, measured like the llama-servers beside them (warm, over HTTP, its
    prompt cache off as theirs is). `model` is the target spec; `args` the serve flags that
    choose the drafter (e.g. ("--drafter", "lookup", "-k", "auto"))."""

    target: str = ""
    name: str = "served"
    kind = "specdec serve"
    key_env = "SPECDEC_API_KEY"

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.target, "chat", api_key=self.key, label=self.name)

    def describe(self) -> dict:
        return {"command": ["specdec", *self.command()[3:]]}

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "specdec.cli.main", "serve", "--target", self.target]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--no-prompt-cache"]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return [*cmd, *self.args]


@dataclass
class PromptCachingServer(SpecdecServer):
    """`specdec serve` with its prompt cache on, as an editor's server runs between the turns
    of a conversation (the bench's served methods otherwise run with it off, as llama-server's
    is there)."""

    def command(self) -> list[str]:
        return ["--prompt-cache" if a == "--no-prompt-cache" else a for a in super().command()]


#: llama-lookup's closing report (examples/lookup/lookup.cpp, on stderr)
_LOOKUP_STATS = {
    "prompt_tokens": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "generated": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


@dataclass
class LlamaLookup:
    """llama.cpp's `llama-lookup` example, one process per prompt (it has no server): the
    prompt, already rendered with the chat template, goes in a file; its own timers give the
    prefill ("encoded") and decode ("decoded") seconds, so model loading is left out as it is
    for every other method. Same numerics as the servers (SAME_NUMERICS), all cores.

    It stops once it has sampled more than -n tokens (accepted drafts run past the limit), so
    it is asked for max_tokens - 1; rates, not lengths, are compared.
    """

    model: Path
    args: tuple[str, ...] = ()
    mode: str = "lookup"
    threads: int | None = None
    ctx: int = 4096
    timeout_s: float = 1800.0
    exe: Path | None = None

    def __enter__(self) -> LlamaLookup:
        self.exe = self.exe or binary(TOOL_MODES["lookup"])  # AnchorError names the build
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def describe(self) -> dict:
        """The command with placeholders for what changes per prompt, and the build."""
        cmd = self.command("PROMPT_FILE", "MAX_TOKENS-1", "TEMPERATURE", "SEED")
        return {"command": [Path(cmd[0]).name, *cmd[1:]], "build": manifest()}

    def command(self, prompt_file: object, n: object, temperature: object, seed: object) -> list:
        """The tool's command line; `n` is its -n (it samples one token more)."""
        threads = self.threads or os.cpu_count() or 1
        return [
            str(self.exe or binary(TOOL_MODES["lookup"])),
            *("-m", str(self.model), "-f", str(prompt_file), "-c", str(self.ctx)),
            *("-t", str(threads), "-tb", str(threads), "-n", str(n)),
            *("--temp", str(temperature), "--seed", str(seed)),
            *("--top-k", "0", "--top-p", "1", "--min-p", "0"),  # temperature alone, as specdec
            *SAME_NUMERICS,
            *self.args,
        ]

    def run(self, prompt: str, max_tokens: int, temperature: float, seed: int) -> dict:
        """One generation: {text, prompt_tokens, generated, prefill_s, decode_s, drafted,
        accepted, process_s}; AnchorError with the tool's last lines if it fails."""
        with tempfile.TemporaryDirectory(prefix="llama-lookup-") as tmp:
            pf = Path(tmp) / "prompt.txt"
            # -f drops one trailing newline (common/arg.cpp); the templated prompt ends in one
            pf.write_text(prompt + "\n", encoding="utf-8")
            t0 = time.perf_counter()
            try:
                res = subprocess.run(
                    self.command(pf, max(1, max_tokens - 1), temperature, seed),
                    capture_output=True,
                    timeout=self.timeout_s,
                    cwd=tmp,  # it saves an (empty) n-gram cache file where it runs
                    preexec_fn=_die_with_parent,
                )
            except subprocess.TimeoutExpired:
                raise AnchorError(f"llama-lookup ran past {self.timeout_s:.0f} s") from None
            process_s = time.perf_counter() - t0
        out = res.stdout.decode("utf-8", "replace")
        err = res.stderr.decode("utf-8", "replace")
        if res.returncode != 0:
            tail = "\n".join(err.splitlines()[-15:])
            raise AnchorError(f"llama-lookup exited ({res.returncode}):\n{tail}")
        return {
            **parse_lookup_report(err),
            "text": _after_prompt(out, prompt),
            "process_s": process_s,
        }


def parse_lookup_report(stderr: str) -> dict:
    """The counts and seconds of llama-lookup's closing report; AnchorError if it is missing."""
    found = {k: rx.search(stderr) for k, rx in _LOOKUP_STATS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        tail = "\n".join(stderr.splitlines()[-15:])
        raise AnchorError(f"llama-lookup printed no {', '.join(missing)} line:\n{tail}")
    enc, dec = found["prompt_tokens"], found["generated"]
    return {
        "prompt_tokens": int(enc[1]),
        "prefill_s": float(enc[2]),
        "generated": int(dec[1]),
        "decode_s": float(dec[2]),
        "drafted": int(found["drafted"][1]),
        "accepted": int(found["accepted"][1]),
    }


def _after_prompt(stdout: str, prompt: str) -> str:
    """The generated text: llama-lookup echoes the prompt (special tokens as text), then the
    answer, between blank lines."""
    at = stdout.find(prompt)
    text = stdout[at + len(prompt) :] if at >= 0 else stdout.lstrip("\n")
    return text[:-2] if text.endswith("\n\n") else text


def _die_with_parent() -> None:
    """In the child before exec: on Linux, ask for SIGTERM when the parent dies, so a bench
    killed without cleanup (SIGKILL, an unhandled SIGTERM) leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def servers(specs: Sequence[LlamaServer]) -> Iterator[list[LlamaServer]]:
    """Start every server (one at a time, so they do not compete while loading); stop all."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(s) for s in specs]
