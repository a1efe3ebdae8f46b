"""The Redis tier: one Redis string per chunk, the tier that several tiercache servers share.

With `redis.cluster` the same tier runs over redis-py's cluster client (keys spread over the hash slots; multi-key
calls are split per slot by the client); only the client object differs.

Redis bounds itself (maxmemory and its eviction policy, optional TTL), so this tier evicts nothing on its own.
When Redis cannot be reached the tier is *down*: every call raises TierDown at once, without touching the network,
until a backoff delay passes (a tiercache.backoff schedule: doubling from 0.1 s up to `max_backoff_s`); then the next
call tries again, and a success marks it up. The store turns TierDown into a miss (reads) or a skipped copy (writes),
so clients see no errors for chunks the local tiers hold.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError
from redis.retry import Retry

from tiercache.backoff import Backoff
from tiercache.config import RedisTierConfig
from tiercache.errors import ConfigError, TierDown
from tiercache.record.codec import codec_id
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import ChunkKey
from tiercache.tiers.base import NeededAbove, Room, Tier, TierUsage

T = TypeVar("T")
_FIRST_BACKOFF_S = 0.1


def _connect(config: RedisTierConfig):
    """No retries inside redis-py: a dead Redis must cost one failed attempt, then the tier's own backoff."""
    options = dict(socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.socket_timeout_s,
                   **_credentials(config))
    if config.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(config.url, require_full_coverage=False, retry=Retry(NoBackoff(), 0), **options)
    return redis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 0), **options)


def _credentials(config: RedisTierConfig) -> dict:
    """AUTH and TLS options for redis-py. The password is read from its file here and kept nowhere else."""
    options: dict = {}
    if config.username:
        options["username"] = config.username
    if config.password_file:
        try:
            options["password"] = Path(config.password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read redis.password_file {config.password_file}: {exc.strerror}") from None
    if config.tls_ca_file:
        options["ssl_ca_certs"] = config.tls_ca_file
    if config.tls_cert_file:
        options.update(ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file)
    return options


class RedisTier(Tier):
    """A Tier only: no ChainDirectory (checkpoints other servers saved are found at the positions clients send; Redis
    evicts by its own policy), no arena."""

    name = "redis"
    checksum_on_read = True
    shared_by_nodes = True

    def __init__(self, config: RedisTierConfig, client: redis.Redis | None = None) -> None:
        assert config.url, "RedisTier needs redis.url"
        self._prefix = config.key_prefix.encode()
        self.codec = codec_id(config.codec)
        self._ttl_ms = int(config.ttl_s * 1000) if config.ttl_s else None
        self._backoff = Backoff(min(_FIRST_BACKOFF_S, config.max_backoff_s), config.max_backoff_s)
        self._redis = client or _connect(config)
        self._cluster = config.cluster
        self._lock = threading.Lock()
        self._up = True
        self._waits: Iterator[float] = iter(())  # while down: the backoff's waits, one per failed attempt
        self._next_attempt = 0.0
        self.errors = 0

    # -- contract ---------------------------------------------------------------------------------------------------

    def make_room(self, key: ChunkKey, meta: ChunkMeta, size_bytes: int, *, read_victims: bool,
                  needed_above: NeededAbove | None = None) -> Room:
        """Ready at once: Redis makes its own room (its maxmemory policy) and hands nothing down."""
        return Room(key, meta, size_bytes, claim=True)

    def put(self, room: Room, record) -> None:
        self._call(lambda r: r.set(self._name(room.key), memoryview(record), px=self._ttl_ms))
        room.claim = None

    def release(self, room: Room) -> None:
        room.claim = None

    def get(self, key: ChunkKey) -> bytes | None:
        return self._call(lambda r: r.get(self._name(key)))

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """One round trip for the batch (MGET; a cluster client splits it per hash slot)."""
        if not keys:
            return []
        names = [self._name(k) for k in keys]
        if self._cluster:
            return self._call(lambda r: r.mget_nonatomic(names))
        return self._call(lambda r: r.mget(names))

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        def exists(r: redis.Redis) -> list[bool]:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]
        return self._call(exists) if keys else []

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self._call(lambda r: r.unlink(*(self._name(k) for k in keys))) if keys else 0

    def usage(self) -> TierUsage:
        # A cluster client asks every primary (replicas would count data twice) and answers per node.
        nodes = {"target_nodes": self._redis.PRIMARIES} if self._cluster else {}
        try:
            info = self._call(lambda r: r.info("memory", **nodes))
            keys = self._call(lambda r: r.dbsize(**nodes))
        except TierDown:
            return TierUsage(0, 0, 0, up=False)
        per_node = list(info.values()) if self._cluster else [info]
        return TierUsage(keys, sum(n.get("used_memory", 0) for n in per_node),
                         sum(n.get("maxmemory", 0) for n in per_node))

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        pass  # Redis keeps its own recency

    def close(self) -> None:
        self._redis.close()

    @property
    def up(self) -> bool:
        return self._up

    # -- one path for every call ------------------------------------------------------------------------------------

    def _name(self, key: ChunkKey) -> bytes:
        return self._prefix + key.digest.encode()

    def _call(self, operation: Callable[[redis.Redis], T]) -> T:
        with self._lock:
            if not self._up and time.monotonic() < self._next_attempt:
                raise TierDown("redis tier is down")
            probing = not self._up
        try:
            if probing and self._cluster:
                # After a failover the cached slot map still points at the dead primary: ask the live nodes.
                self._redis.nodes_manager.initialize()
            result = operation(self._redis)
        except (redis.ConnectionError, redis.TimeoutError, ClusterError, OSError) as exc:
            self._mark_down()
            raise TierDown(f"redis unreachable: {exc}") from exc
        except redis.RedisError as exc:  # e.g. OOM under maxmemory: this call fails, the tier stays up
            with self._lock:
                self.errors += 1
            raise TierDown(f"redis error: {exc}") from exc
        with self._lock:
            self._up = True
        return result

    def _mark_down(self) -> None:
        with self._lock:
            self.errors += 1
            if self._up:
                self._up, self._waits = False, self._backoff.delays()
            self._next_attempt = time.monotonic() + next(self._waits)
