"""The server's settings: `ServeConfig`, the `specdec serve` flags one to one, with the rules that
derive what they leave open (each key's share of the queue and of the slots, the draft pools,
the default speculation, the Host names served) and the defaults the flags start from.

serve.app builds the app from it, serve.engine the engine (`Engine.from_config`), serve.launch
the process, and cli.serve the flags.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from specdec.core.config import SpecConfig
from specdec.serve.connections import DEFAULT_WRITE_TIMEOUT_S
from specdec.serve.draft_pools import DEFAULT_POOL_SCOPES, DEFAULT_POOL_TOKENS, PoolConfig
from specdec.serve.job_queue import DEFAULT_MAX_QUEUE
from specdec.serve.prompt_store import DEFAULT_CACHE_RAM_MIB
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


@dataclass(frozen=True)
class ServeConfig:
    """`specdec serve` flags, one to one."""

    target: str
    draft: str | None = None
    # None: "model" with a draft; without one a request's prediction (else prompt lookup), and
    # the target alone for a request with no prediction
    drafter: str | None = None
    k: int | str | None = None  # None: serve.speculation.DEFAULT_K
    k_max: int | None = None
    p_min: float | None = None
    device: str | None = None
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # the keys stay out of the repr: a config is printed in logs and tracebacks
    api_key: str | None = field(default=None, repr=False)  # /v1's and /metrics' key (Bearer)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # more keys, a tenant each
    metrics_key: str | None = field(default=None, repr=False)  # the operator's, for /metrics
    allowed_hosts: tuple[str, ...] = ()  # empty: loopback names when bound to loopback, else any
    max_queue: int = DEFAULT_MAX_QUEUE
    parallel: int = 1  # requests generated at once, a slot (KV cache) each: serve.engine
    prefill_share: float = PREFILL_SHARE  # a cycle's prefill, at most, per its round: scheduler
    ctx_size: int | None = None  # context per request (n_ctx); None: the backend's default
    # one key's requests generated at once; None: all slots with one key, half with several
    max_running_per_key: int | None = None
    # one key's waiting requests, at most; None: half of max_queue with several keys (queue_per_key)
    max_queue_per_key: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    deterministic: bool = False  # batch-invariant llama.cpp numerics (backends.load_model)
    # keep the KV of the prefix shared with the previous request; None: only where the output
    # cannot depend on it (a batch-invariant target: serve.engine)
    prompt_cache: bool | None = None
    # MiB of slots' caches kept in RAM for later requests of their scope (serve.prompt_store)
    cache_ram: int = DEFAULT_CACHE_RAM_MIB
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # seconds to receive a request's body
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once; 503 beyond (uvicorn's limit)
    # open at once from one address (serve.connections); None: half of max_connections
    max_connections_per_client: int | None = None
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S  # s a response may wait for its client to read
    draft_pool: str = "key"  # whose earlier requests prompt lookup drafts from: key, shared, off
    draft_pool_tokens: int = DEFAULT_POOL_TOKENS  # each scope's pool, in tokens
    draft_pool_scopes: int = DEFAULT_POOL_SCOPES  # pools held at once, at most
    replicas: int = 1  # engines, each a Ray Serve replica when > 1 (serve.cluster)
    ray_address: str | None = None  # a Ray cluster to join; None: start one on this machine

    def __post_init__(self) -> None:
        self.pool_config()  # a bad --draft-pool* value fails here, before any model loads
        if self.cache_ram < 0:
            raise ValueError(f"--cache-ram must be >= 0 MiB (0: off), got {self.cache_ram}")
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
        """The server's default speculation, which requests may override: SpecConfig's
        defaults where none was set, but K = DEFAULT_K."""
        k = DEFAULT_K if self.k is None else self.k
        opts = {"drafter": self.drafter, "k_max": self.k_max, "p_min": self.p_min}
        return SpecConfig(k=k, **{key: v for key, v in opts.items() if v is not None})

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
