"""The server's settings: `ServeConfig`, one field per `specdec serve` flag, each declared once
(`setting`: its flag, help and check; its type and default are the field's), with the rules that
derive what they leave open (each key's share of the queue and of the slots, the draft pools,
the default speculation, the prompt cache, the Host names served).

cli.serve derives the parser from the declarations; serve.engine, serve.cycle, serve.app,
serve.launch and serve.cluster read the one record.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from specdec.backends import DETERMINISTIC_HELP, DEVICE_HELP, THREADS_HELP, draft_spec
from specdec.core.config import DRAFTERS, SpecConfig, parse_k
from specdec.serve.connections import DEFAULT_WRITE_TIMEOUT_S
from specdec.serve.draft_pools import (
    DEFAULT_POOL_SCOPES,
    DEFAULT_POOL_TOKENS,
    MAX_POOL_TOKENS,
    MIN_POOL_TOKENS,
    POOL_MODES,
    PoolConfig,
    pool_memory_bytes,
)
from specdec.serve.job_queue import DEFAULT_MAX_QUEUE
from specdec.serve.prompt_store import DEFAULT_CACHE_RAM_MIB, PromptStore
from specdec.serve.scheduler import PREFILL_SHARE
from specdec.serve.speculation import DEFAULT_K

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 32k-token context is ~130 KB of text
DEFAULT_REQUEST_TIMEOUT_S = 600.0
#: A slow client may take this long to send a request's body (408 after; its headers get
#: serve.connections.HEADER_TIMEOUT_S).
DEFAULT_BODY_TIMEOUT_S = 10.0
#: Connections open at once (uvicorn's limit_concurrency): past it, new ones get 503, so stalled
#: clients cannot exhaust memory or descriptors.
DEFAULT_MAX_CONNECTIONS = 256
#: Host names served when bound to loopback and no --allowed-host is given.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: The environment variable read for the API key when neither flag gives one (cli.serve).
API_KEY_ENV = "SPECDEC_API_KEY"
_POOL_MIB = pool_memory_bytes(DEFAULT_POOL_TOKENS) / (1 << 20)


@dataclass(frozen=True)
class Setting:
    """How a ServeConfig field is given on the command line and checked (ServeConfig checks
    every field on construction, so a config built in code is held to the flags' rules)."""

    help: str
    flags: tuple[str, ...] = ()  # the flag's names; () for --field-name
    metavar: str | None = None
    # a command-line string's value (ValueError: not one); None: the field's type's
    parse: Callable[[str], Any] | None = None
    low: int | None = None  # a number must be >= low
    high: int | None = None  # ... and <= high
    positive: bool = False  # a number must be > 0
    choices: tuple[str, ...] = ()
    cli: bool = True  # False: set from flags of another shape (the key files: cli.serve)

    def flag(self, name: str) -> str:
        """The flag's long name, as error messages say it."""
        return next((f for f in self.flags if f.startswith("--")), "--" + name.replace("_", "-"))

    def check(self, name: str, value: Any) -> None:
        """ValueError naming the flag when `value` breaks this setting's rule (None: not set)."""
        if value is None:
            return
        flag = self.flag(name)
        if self.choices and value not in self.choices:
            raise ValueError(f"{flag} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.low is not None and value < self.low:
            raise ValueError(f"{flag} must be >= {self.low}, got {value}")
        if self.high is not None and value > self.high:
            raise ValueError(f"{flag} must be <= {self.high}, got {value}")
        if self.positive and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")


def setting(default: Any = MISSING, *, secret: bool = False, **declared: Any) -> Any:
    """A ServeConfig field declared once: `declared` is its Setting (help, flags, check); a
    `secret` stays out of the repr (a config is printed in logs and tracebacks)."""
    return field(default=default, repr=not secret, metadata={"setting": Setting(**declared)})


def settings() -> list[tuple[Field[Any], Setting]]:
    """ServeConfig's fields with their declarations, in order."""
    return [(f, f.metadata["setting"]) for f in fields(ServeConfig)]


@dataclass(frozen=True)
class ServeConfig:
    """`specdec serve` flags, one to one."""

    target: str = setting(
        metavar="SPEC",
        help="target model, BACKEND:NAME_OR_PATH (str; e.g. llamacpp:smollm2-135m); also the "
        "model id clients send",
    )
    draft: str | None = setting(
        None,
        metavar="SPEC",
        parse=draft_spec,
        help="draft model SPEC, or none (str; default none: target-only unless --drafter lookup)",
    )
    # None: "model" with a draft; without one a request's prediction (else prompt lookup), and
    # the target alone for a request with no prediction
    drafter: str | None = setting(
        None,
        choices=DRAFTERS,
        help="default drafter: model (needs --draft), lookup (prompt lookup), composite (lookup, "
        "else the draft model; needs --draft) or prediction (a request's `prediction`, else "
        "lookup) (default: model when --draft is given; else a request's `prediction` when it "
        "has one, and none otherwise). A request's speculation.drafter overrides it (none, "
        "lookup, prediction; model and composite with --draft); a request's `prediction` is "
        "drafted from first with any drafter but none",
    )
    k: int | str = setting(
        DEFAULT_K,
        flags=("-k", "--k"),
        parse=parse_k,
        help="default draft tokens per round: an int >= 1, 'auto' (K in 0..--k-max from measured "
        "costs; 0 where drafting cannot pay) or 'schedule' (default auto; a request's "
        "speculation.k overrides it)",
    )
    k_max: int | None = setting(
        None,
        help="default largest K for -k auto|schedule (int >= 1; default 8 with a draft model, 64 "
        "for lookup and prediction; a request's speculation.k_max overrides it)",
    )
    p_min: float | None = setting(
        None, help="stop drafting below this draft top probability, in [0, 1) (float; default off)"
    )
    device: str | None = setting(None, help=DEVICE_HELP)
    threads: int | None = setting(None, low=1, help=THREADS_HELP)
    deterministic: bool = setting(False, help=DETERMINISTIC_HELP)  # backends.load_model
    # keep the KV of the prefix shared with the previous request; None: only where the output
    # cannot depend on it (`prompt_cache_on`)
    prompt_cache: bool | None = setting(
        None,
        help="keep the KV of the prefix shared with the previous request, in whole blocks of 16 "
        "tokens, as llama-server's cache_prompt; --no-prompt-cache prefills every prompt from "
        "scratch (default: on only where the output cannot depend on it: a batch-invariant "
        "target, as the default models are with specdec's kernels; see docs/serving.md)",
    )
    # MiB of slots' caches kept in RAM for later requests of their scope (serve.prompt_store)
    cache_ram: int = setting(
        DEFAULT_CACHE_RAM_MIB,
        low=0,
        metavar="MiB",
        help="keep slots' caches in RAM, up to this many MiB, and restore the one that shares the "
        "longest prefix with a later request of its API key, as llama-server's --cache-ram (int "
        f">= 0, 0: off; default {DEFAULT_CACHE_RAM_MIB}, llama-server's)",
    )
    host: str = setting("127.0.0.1", help="address to bind (str; default 127.0.0.1, loopback only)")
    port: int = setting(8000, low=0, high=65535, help="port (int; default 8000)")
    # /v1's and /metrics' key (Bearer), more keys (a tenant each), the operator's for /metrics:
    # read from files or the environment by cli.serve
    api_key: str | None = setting(None, secret=True, cli=False, help="the API key")
    api_keys: tuple[str, ...] = setting((), secret=True, cli=False, help="more API keys")
    metrics_key: str | None = setting(None, secret=True, cli=False, help="the operator's key")
    # empty: loopback names when bound to loopback, else any
    allowed_hosts: tuple[str, ...] = setting(
        (),
        flags=("--allowed-host",),
        metavar="NAME",
        help="a Host header name to serve, repeatable; '*' for any (str; default: localhost, "
        "127.0.0.1 and ::1 when bound to loopback, else any). Guards against DNS rebinding",
    )
    max_queue: int = setting(
        DEFAULT_MAX_QUEUE,
        low=1,
        help=f"requests waiting for the engine before 429 (int >= 1; default {DEFAULT_MAX_QUEUE})",
    )
    # requests generated at once, a slot (KV cache) each: serve.engine
    parallel: int = setting(
        1,
        flags=("--parallel", "-np"),
        low=1,
        metavar="N",
        help="requests generated at once, each in a slot with a KV cache of its own, one target "
        "pass a round for all of them (llama-server's -np; int >= 1; default 1; llamacpp: and "
        "mock: models)",
    )
    # a cycle's prefill, at most, per its round: serve.scheduler
    prefill_share: float = setting(
        PREFILL_SHARE,
        positive=True,
        metavar="S",
        help="with --parallel: a cycle's prompt prefill may cost S times its round of the running "
        "requests; lower keeps their streams smoother, higher starts new prompts sooner (float "
        f"> 0; default {PREFILL_SHARE:g}: a stream waits about two rounds)",
    )
    # context per request (n_ctx); None: the backend's default
    ctx_size: int | None = setting(
        None,
        flags=("--ctx-size", "-c"),
        low=16,
        metavar="N",
        help="tokens of context per request (llama-server's -c per slot; int >= 16; default: the "
        "backend's, 4096 for llama.cpp): a prompt plus max_tokens must fit; each --parallel slot "
        "holds a KV cache this long",
    )
    # None: all slots with one key, half with several (`running_per_key`)
    max_running_per_key: int | None = setting(
        None,
        low=1,
        metavar="N",
        help="requests of one API key generated at once, of the --parallel slots (int >= 1; "
        "default: every slot with one key, half of them with several)",
    )
    # None: all of max_queue with one key, half of it with several (`queue_per_key`)
    max_queue_per_key: int | None = setting(
        None,
        low=1,
        metavar="N",
        help="requests of one API key waiting before 429; the keys' requests then take turns "
        "(int >= 1; default: --max-queue with one key, half of it with several)",
    )
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        low=1,
        help=f"largest request body, else 413 (int; default {DEFAULT_MAX_BODY_BYTES})",
    )
    request_timeout: float = setting(
        DEFAULT_REQUEST_TIMEOUT_S,
        positive=True,
        help="seconds from arrival (queue wait included) before a request fails with 504 (float "
        f"> 0; default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    body_timeout: float = setting(
        DEFAULT_BODY_TIMEOUT_S,
        positive=True,
        help="seconds a client may take to send a request's body, else 408 (float > 0; default "
        f"{DEFAULT_BODY_TIMEOUT_S:g})",
    )
    # uvicorn's limit
    max_connections: int = setting(
        DEFAULT_MAX_CONNECTIONS,
        low=1,
        help=f"connections open at once, else 503 (int >= 1; default {DEFAULT_MAX_CONNECTIONS})",
    )
    # serve.connections; None: half of max_connections (`connections_per_client`)
    max_connections_per_client: int | None = setting(
        None,
        low=1,
        metavar="N",
        help="connections open at once from one client address, else 503 (int >= 1; default "
        "half of --max-connections). Behind a reverse proxy every client has its address: set "
        "it to --max-connections there",
    )
    write_timeout: float = setting(
        DEFAULT_WRITE_TIMEOUT_S,
        positive=True,
        help="seconds a response may wait for its client to read any of it before the "
        f"connection is reset (float > 0; default {DEFAULT_WRITE_TIMEOUT_S:g})",
    )
    # whose earlier requests prompt lookup drafts from (serve.draft_pools, which checks the
    # three --draft-pool* values: `pool_config`)
    draft_pool: str = setting(
        "key",
        choices=POOL_MODES,
        help="prompt lookup also drafts from earlier requests' prompts and outputs, kept in a "
        "bounded pool: key, one pool per API key (requests without a key, on a server without "
        "keys, share one); shared, one pool for all (a client can then learn through speed "
        "whether its text matches another key's); off (default key; docs/api-extensions.md)",
    )
    draft_pool_tokens: int = setting(
        DEFAULT_POOL_TOKENS,
        metavar="N",
        help=f"tokens each pool holds, the oldest evicted first (int in [{MIN_POOL_TOKENS}, "
        f"{MAX_POOL_TOKENS}]; default {DEFAULT_POOL_TOKENS}). A pool allocates 36 bytes a token "
        f"at a power of two, up to 68 just above one: {_POOL_MIB:g} MiB at the default, all of "
        "it when its key sends its first request",
    )
    draft_pool_scopes: int = setting(
        DEFAULT_POOL_SCOPES,
        metavar="N",
        help="pools held at once with --draft-pool key, the least recently used dropped first "
        f"(int in [1, 65536]; default {DEFAULT_POOL_SCOPES}, and never more than the API keys): "
        f"at most N x a pool's memory, {DEFAULT_POOL_SCOPES * _POOL_MIB:g} MiB with the defaults",
    )
    # engines, each a Ray Serve replica when > 1 (serve.cluster)
    replicas: int = setting(
        1,
        low=1,
        metavar="N",
        help="engines serving at once, each a Ray Serve replica with its own slots, prompt cache "
        "and draft pools (--threads each); a request goes to the replica that served its API key "
        "and prompt prefix last (int >= 1; default 1: one process, no Ray; needs "
        "specdec[cluster]; docs/serving.md)",
    )
    # None: start a Ray cluster on this machine
    ray_address: str | None = setting(
        None,
        metavar="ADDR",
        help="join this Ray cluster (ray start --head's address) instead of starting one on this "
        "machine; its replicas may run on any of its nodes",
    )

    def __post_init__(self) -> None:
        for f, s in settings():
            s.check(f.name, getattr(self, f.name))
        # the rules of several values, each in its own place, before any model loads
        self.spec_config()
        self.pool_config()
        if self.metrics_key is not None and self.metrics_key in self.keys():
            raise ValueError(
                "the --metrics-key-file key is also an API key: give the operator a key of "
                "their own, or the tenant that holds it reads every key's metrics"
            )

    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: no key is required)."""
        return tuple(dict.fromkeys(([self.api_key] if self.api_key else []) + list(self.api_keys)))

    def queue_per_key(self) -> int:
        """Waiting requests one key may hold: --max-queue-per-key, else all of --max-queue on a
        server with one tenant and half of it (at least 1) with several, so that one key never
        takes every place."""
        if self.max_queue_per_key is not None:
            return min(self.max_queue_per_key, self.max_queue)
        return self.max_queue if len(self.keys()) <= 1 else max(1, self.max_queue // 2)

    def running_per_key(self) -> int:
        """Requests of one key generated at once: --max-running-per-key, else every slot on a
        server with one tenant and half of them (at least 1) with several, as queue_per_key."""
        if self.max_running_per_key is not None:
            return min(self.max_running_per_key, self.parallel)
        return self.parallel if len(self.keys()) <= 1 else max(1, self.parallel // 2)

    def connections_per_client(self) -> int:
        """Connections one address may hold open: --max-connections-per-client, else half of
        --max-connections (at least 1)."""
        if self.max_connections_per_client is not None:
            return min(self.max_connections_per_client, self.max_connections)
        return max(1, self.max_connections // 2)

    def pool_config(self) -> PoolConfig:
        """The draft pools' settings, with no more pools than this server has tenants."""
        cfg = PoolConfig(self.draft_pool, self.draft_pool_tokens, self.draft_pool_scopes)
        return cfg.for_tenants(len(self.keys()))

    def spec_config(self) -> SpecConfig:
        """The server's default speculation, which requests may override (it checks the four
        values)."""
        return SpecConfig(drafter=self.drafter, k=self.k, k_max=self.k_max, p_min=self.p_min)

    def prompt_cache_on(self, target_batch_invariant: bool) -> bool:
        """Whether to keep the KV of the prefix shared with the previous request, in whole
        blocks (an editor re-sends the file, a chat the conversation): --prompt-cache, else on
        only where it cannot change the output, since kept rows were computed in another batch
        shape than a fresh prefill would use."""
        return target_batch_invariant if self.prompt_cache is None else self.prompt_cache

    def prompt_store(self) -> PromptStore | None:
        """The RAM cache of slots' caches (--cache-ram MiB; None: 0)."""
        return PromptStore(self.cache_ram << 20) if self.cache_ram else None

    def host_names(self) -> frozenset[str] | None:
        """The Host header names served; None for any."""
        if self.allowed_hosts:
            return None if "*" in self.allowed_hosts else frozenset(self.allowed_hosts)
        return frozenset(LOOPBACK_HOSTS) if is_loopback(self.host) else None


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (no name lookup: nothing leaves the machine)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
