"""The configuration tree: one frozen dataclass per section (server, the tiers gpu -> host -> disk -> redis,
security, events) under `Config`, and the defaults a client shares with the server. Every value is validated on
construction, with an error that names the key; each component receives its own section only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.config.sizes import GiB, KiB, MiB
from tiercache.errors import ConfigError

# Defaults the client shares with the server (a client talks to servers on their defaults unless told otherwise).
# The largest chunk a server takes (server.max_chunk_bytes). It must hold the largest object of every model the docs
# name (docs/deploy.md, "Sizing"): a Qwen3.5-397B-A17B state is 183.2 MiB on one rank, Qwen3.5/3.6-27B's 146.8 MiB;
# 64 MiB refused both. A Put stream holds up to this much while it assembles a chunk (server.limits).
DEFAULT_MAX_CHUNK_BYTES = 256 * MiB
DEFAULT_FRAME_BYTES = MiB  # gRPC data frames: grpcio streams 1 MiB frames ~10x faster than one large message
DEFAULT_LEASE_TTL_S = 30.0  # same-host reservations and read pins not committed / released by then are taken back


def cache_dir() -> Path:
    """Where tiercache keeps files of its own on a machine: $XDG_CACHE_HOME/tiercache, else ~/.cache/tiercache (the
    disk tier's default directory, the vLLM connector's memo of weight fingerprints)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiercache"


def default_disk_dir() -> str:
    return str(cache_dir() / "chunks")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_state_budget(tier: str, capacity: int, budget: int | None, weight: float) -> None:
    _require(budget is None or 0 <= budget <= capacity,
             f"{tier}.state_budget_bytes must be between 0 and {tier}.capacity_bytes")
    _require(0.0 <= weight <= 1.0, f"{tier}.state_value_weight must be within 0..1")


def _check_codec(tier: str, name: str) -> None:
    from tiercache.record.codec import NAMES

    _require(name in NAMES, f"{tier}.codec must be one of {', '.join(NAMES)}, got {name!r}")


def state_budget(capacity: int, budget: int | None) -> int:
    """The state budget in force: the configured one, or half the tier's capacity."""
    return capacity // 2 if budget is None else budget


@dataclass(frozen=True)
class HostTierConfig:
    """The in-memory tier: one preallocated arena carved into fixed-size pages."""

    capacity_bytes: int = 1 * GiB
    page_bytes: int = 64 * KiB
    state_budget_bytes: int | None = None  # most bytes of recurrent states held; default half the capacity
    state_value_weight: float = 0.5  # weight of tokens-saved-per-byte against recency when evicting states
    shared_memory: bool = True  # arena in /dev/shm, so same-host clients copy chunks in place (no gRPC payload)

    def __post_init__(self) -> None:
        _check_state_budget("host", self.capacity_bytes, self.state_budget_bytes, self.state_value_weight)
        _require(self.capacity_bytes >= 0, "host.capacity_bytes must be >= 0 (0 disables the host tier)")
        _require(self.page_bytes >= 4 * KiB and self.page_bytes % 4096 == 0,
                 "host.page_bytes must be a multiple of 4096")
        _require(self.capacity_bytes == 0 or self.capacity_bytes >= self.page_bytes,
                 "host.capacity_bytes must hold at least one page")


@dataclass(frozen=True)
class GpuTierConfig:
    """The device-memory tier, above the host tier. Off unless capacity_bytes is set (needs CUDA)."""

    capacity_bytes: int = 0
    device: str = "cuda:0"
    page_bytes: int = 1 * MiB  # device copies are one DMA per extent: larger pages than the host arena
    state_budget_bytes: int | None = None
    state_value_weight: float = 0.5

    def __post_init__(self) -> None:
        _check_state_budget("gpu", self.capacity_bytes, self.state_budget_bytes, self.state_value_weight)
        _require(self.capacity_bytes >= 0, "gpu.capacity_bytes must be >= 0 (0 disables the GPU tier)")
        _require(self.page_bytes >= 4 * KiB and self.page_bytes % 4096 == 0,
                 "gpu.page_bytes must be a multiple of 4096")
        _require(self.device.startswith("cuda"), f"gpu.device must name a CUDA device, got {self.device!r}")


@dataclass(frozen=True)
class DiskTierConfig:
    """The local-disk tier: one file per chunk under `path`, never more than `capacity_bytes` of records."""

    path: str = field(default_factory=default_disk_dir)
    capacity_bytes: int = 4 * GiB
    fsync: bool = False  # fsync each file before it becomes visible: survives power loss, costs write bandwidth
    codec: str = "none"  # none | lz4 | lz4-shuffle2 | lz4-shuffle4 (see tiercache.record.codec: off unless it pays)
    state_budget_bytes: int | None = None  # most bytes of recurrent states held; default half the capacity
    state_value_weight: float = 0.5

    def __post_init__(self) -> None:
        _check_state_budget("disk", self.capacity_bytes, self.state_budget_bytes, self.state_value_weight)
        _check_codec("disk", self.codec)
        _require(self.capacity_bytes >= 0, "disk.capacity_bytes must be >= 0 (0 disables the disk tier)")
        _require(bool(self.path), "disk.path must not be empty")


@dataclass(frozen=True)
class RedisTierConfig:
    """The shared tier. Disabled unless `url` is set (redis://, rediss://, with user:password@ when needed)."""

    url: str | None = field(default=None, repr=False)  # may carry user:password@: kept out of reprs and logs
    cluster: bool = False  # the URL names one node of a Redis Cluster: use redis-py's cluster client
    key_prefix: str = "tiercache:"
    ttl_s: float | None = None
    write_through: bool = False  # also write every put to Redis, so other nodes see new chunks at once
    socket_timeout_s: float = 2.0
    max_backoff_s: float = 2.0  # longest wait between reconnection attempts while Redis is down
    codec: str = "none"  # none | lz4 | lz4-shuffle2 | lz4-shuffle4: buys Redis memory, costs CPU
    username: str | None = None  # Redis ACL user (AUTH username password); default user when unset
    password_file: str | None = None  # file holding the password (a mounted Secret), never the password itself
    tls_ca_file: str | None = None  # rediss:// only: CA that signed the Redis server's certificate
    tls_cert_file: str | None = None  # rediss:// only: client certificate, when Redis requires one
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        _require((self.tls_cert_file is None) == (self.tls_key_file is None),
                 "redis.tls_cert_file and redis.tls_key_file must be given together")
        if self.url is not None:
            _require(not (self.tls_ca_file or self.tls_cert_file) or self.url.startswith("rediss://"),
                     "redis.tls_* files need a rediss:// URL")
            _require(self.url.startswith(("redis://", "rediss://", "unix://")),
                     f"redis.url must start with redis://, rediss:// or unix://, got {self.url!r}")
        _require(self.ttl_s is None or self.ttl_s > 0, "redis.ttl_s must be positive when set")
        _require(self.socket_timeout_s > 0, "redis.socket_timeout_s must be positive")
        _require(self.max_backoff_s > 0, "redis.max_backoff_s must be positive")
        _check_codec("redis", self.codec)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    frame_bytes: int = DEFAULT_FRAME_BYTES
    workers: int = 16  # threads for the store's blocking work (copies, disk, Redis); streams waiting on the network
    #                    hold none (the server is asyncio): a client that stops reading or writing costs a connection
    stream_idle_timeout_s: float = 10.0  # a stream that moves no frame for this long is ended (UNAVAILABLE)
    # Requests in flight (Put/Get streams, data-channel requests); more are RESOURCE_EXHAUSTED (server.limits):
    max_streams_per_client: int = 64  # from one client (a Client: an engine's worker, a CLI)
    max_streams_per_peer: int = 512  # from one host, all its clients together (several engines per node)
    max_streams_per_tenant: int = 1024  # of one tenant (all its hosts); without tenants, of the whole server
    metrics_port: int | None = None  # Prometheus endpoint; off unless set
    metrics_host: str = "127.0.0.1"
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    unix_socket: str | None = None  # also listen on this unix socket (clients: grpc+unix:///path)
    # The data channel: remote clients' payloads over a plain TCP socket beside the gRPC port (same tokens, same TLS;
    # tiercache.protocol.data_channel), ~2-4x faster than gRPC streams. Port 0 picks a free one; clients learn it from
    # the server (Attach), so only deployments behind a Service or firewall need to fix it. With unix_socket, also at
    # <unix_socket>.data.
    data_channel: bool = True
    data_port: int = 0
    max_data_connections: int = 512  # data connections open at once, all clients together (a thread and a file each)
    max_data_connections_per_peer: int = 128  # from one host (clients pool a few each: 4 per client by default)
    stats_log_interval_s: float = 60.0  # an INFO line with lookups and hit % this often when there was traffic; 0: off

    def __post_init__(self) -> None:
        _require(self.lease_ttl_s > 0, "server.lease_ttl_s must be positive")
        _require(0 <= self.stats_log_interval_s < float("inf"),
                 "server.stats_log_interval_s must be 0 (off) or a positive number of seconds")
        _require(0 <= self.port <= 65535, f"server.port must be 0..65535, got {self.port}")
        _require(0 <= self.data_port <= 65535, f"server.data_port must be 0..65535, got {self.data_port}")
        _require(self.max_data_connections >= 1, "server.max_data_connections must be >= 1")
        _require(self.max_data_connections_per_peer >= 1, "server.max_data_connections_per_peer must be >= 1")
        _require(self.max_chunk_bytes >= 1, "server.max_chunk_bytes must be positive")
        _require(64 * KiB <= self.frame_bytes <= 16 * MiB, "server.frame_bytes must be 64KiB..16MiB")
        _require(self.workers >= 1, "server.workers must be >= 1")
        _require(self.stream_idle_timeout_s > 0, "server.stream_idle_timeout_s must be positive")
        _require(self.max_streams_per_client >= 1, "server.max_streams_per_client must be >= 1")
        _require(self.max_streams_per_peer >= self.max_streams_per_client,
                 "server.max_streams_per_peer must be >= server.max_streams_per_client (a host holds its clients)")
        _require(self.max_streams_per_tenant >= 1, "server.max_streams_per_tenant must be >= 1")
        _require(self.metrics_port is None or 0 <= self.metrics_port <= 65535,
                 f"server.metrics_port must be 0..65535, got {self.metrics_port}")


@dataclass(frozen=True)
class SecurityConfig:
    """TLS for the gRPC port, and the tenants file that turns on bearer-token authentication (tiercache.server.auth)."""

    tls_cert_file: str | None = None  # PEM certificate chain; with tls_key_file, the gRPC port speaks TLS only
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # also require client certificates signed by this CA (mutual TLS)
    tenants_file: str | None = None  # YAML of tokens -> tenants; unset means every caller is trusted
    health_port: int | None = None  # plaintext grpc.health.v1 only (kubelet probes cannot speak TLS or send tokens)

    def __post_init__(self) -> None:
        _require((self.tls_cert_file is None) == (self.tls_key_file is None),
                 "security.tls_cert_file and security.tls_key_file must be given together")
        _require(self.tls_client_ca_file is None or self.tls_cert_file is not None,
                 "security.tls_client_ca_file (mutual TLS) needs security.tls_cert_file and tls_key_file")
        _require(self.health_port is None or 0 <= self.health_port <= 65535,
                 f"security.health_port must be 0..65535, got {self.health_port}")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


@dataclass(frozen=True)
class EventsConfig:
    """KV events for routers (tiercache.events, docs/events.md): per registered engine instance (a pod) a ZMQ PUB of
    vLLM-format KV events and a ROUTER answering replays with the pod's whole inventory. Off unless enabled."""

    enabled: bool = False
    host: str = "127.0.0.1"  # where the pods' PUB and ROUTER sockets listen (ZMQ has no auth: keep it pod-facing)
    base_port: int = 0  # pod i's PUB on base_port + 2i, its ROUTER on base_port + 2i + 1; 0: free ports
    flush_interval_s: float = 0.1  # the store's changes become one batch per pod at most this often
    heartbeat_s: float = 1.0  # an empty batch when a pod's stream was silent this long (Dynamo replays on traffic)
    query_port: int | None = None  # the pod query over HTTP (POST /query, /query_by_hash) on `host`; off unless set
    encoding: str = "map"  # events as maps tagged "type" (vLLM >= #42892), or "array": positional (older vLLMs)
    # What a pod's blocks are labelled: "" the tier's honest medium (CPU, STORAGE), or e.g. "GPU" for routers that
    # score only device blocks (Dynamo 1.6.1's standalone indexer): a pod beside its tiercache is in effect its cache.
    medium_override: str = ""
    # "restorable": blocks a checkpoint at or after them makes restorable (the Lookup rule); "attention": every saved
    # attention block with its chain, regardless of checkpoints (what an engine's own events would say; for
    # comparisons, never for routing a hybrid model).
    advertise: str = "restorable"

    def __post_init__(self) -> None:
        _require(self.base_port == 0 or 1024 <= self.base_port <= 65_000,
                 f"events.base_port must be 0 or 1024..65000, got {self.base_port}")
        _require(0 < self.flush_interval_s <= 10, f"events.flush_interval_s must be in (0, 10], got "
                 f"{self.flush_interval_s}")
        _require(self.heartbeat_s >= self.flush_interval_s,
                 "events.heartbeat_s must be at least events.flush_interval_s")
        _require(self.query_port is None or 0 <= self.query_port <= 65535,
                 f"events.query_port must be 0..65535, got {self.query_port}")
        _require(self.query_port is None or self.enabled,
                 "events.query_port needs events.enabled (the query answers for the pods registered for events)")
        _require(self.encoding in ("map", "array"), f"events.encoding must be map or array, got {self.encoding!r}")
        _require(self.advertise in ("restorable", "attention"),
                 f"events.advertise must be restorable or attention, got {self.advertise!r}")
        _require(self.medium_override == "" or self.medium_override.isalnum() and len(self.medium_override) <= 32,
                 f"events.medium_override must be empty or a medium name such as GPU, got {self.medium_override!r}")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    host: HostTierConfig = field(default_factory=HostTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
