"""The Python client. Every call goes through `_call`, which owns the deadline, retries and error mapping.

All operations are idempotent (a put of the same key and bytes leaves the same state), so UNAVAILABLE is retried
for every call, with a short exponential backoff inside the call's deadline.

Three data paths, chosen per client: on the server's host, payloads are copied in place into the server's
shared-memory arena (client.shared_arena; gRPC carries only control); elsewhere, or when the arena cannot be mapped,
they go over the server's data channel (client.data_channel: a plain socket beside gRPC, same token and TLS), or,
when the server has none, are streamed in 1 MiB gRPC frames. `same_host=None` (the default) picks by trying to map
the arena the server names; `data_channel=None` uses the data channel whenever the server announces one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence, TypeVar

import grpc

from tiercache.client.breaker import BreakerPolicy, CircuitBreaker
from tiercache.client.data_channel import ConnectFailed, DataChannel
from tiercache.client.retry import RetryPolicy
from tiercache.client.shared_arena import SharedArena
from tiercache.client.transport import Security, data_tls_context, open_channel, parse_url
from tiercache.config import DEFAULT_FRAME_BYTES, DEFAULT_MAX_CHUNK_BYTES
from tiercache.errors import CapacityExceeded, InvalidArgument, NotFound, TierCacheError, Unavailable
from tiercache.prefix.objects import ChainShape
from tiercache.protocol.data import Busy, ConnectionBroken
from tiercache.protocol.wire import (ANSWERED_BY_SERVER, error_for, frames, lookup_request, max_message_bytes, pb,
                                     pb_grpc, stats_dict)
from tiercache.record.encoding import ChunkMeta
from tiercache.record.keys import validate_key, validate_namespace

log = logging.getLogger(__name__)
T = TypeVar("T")
DATA_CHANNEL_RETRY_S = 60


class Chunk(NamedTuple):
    """One chunk to put: its key, its bytes, and how the store should value it (KV by default)."""

    key: bytes
    data: object  # any bytes-like object
    meta: ChunkMeta = ChunkMeta()


class LookupAnswer(NamedTuple):
    hit_tokens: int
    tiers: list[str]  # where each object of the hit lies, in tiercache.prefix.hit.required_objects order
    unverified: tuple[int, ...]  # ask again with these positions' hashes
    chain_chunks: int  # kv chunks every attention group holds from the prompt's start


class Fetched(NamedTuple):
    data: bytes | memoryview  # new bytes, or a view of the caller's buffer it was copied into (get_into, get(out=))
    tier: str  # the tier it was read from


class Client:
    def __init__(self, target: str, *, timeout_s: float = 30.0, retry: RetryPolicy = RetryPolicy(),
                 frame_bytes: int = DEFAULT_FRAME_BYTES, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 same_host: bool | None = None, tls: bool = False, security: Security | None = None,
                 breaker: BreakerPolicy | None = None, data_channel: bool | None = None) -> None:
        """`target` is a gRPC target (host:port, unix:/path); most callers want `Client.from_url`.

        `breaker`: fail calls at once while the server is unreachable, probing it in the background (see
        tiercache.client.breaker; the vLLM connector's clients use one). Without one, every call waits out its
        retries. `data_channel=False`: stream remote payloads over gRPC even when the server has a data channel."""
        limit = max_message_bytes(max_chunk_bytes)
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        if breaker is not None:  # gRPC's own reconnect backoff grows to 120 s: a probe must be able to reconnect
            options += [("grpc.initial_reconnect_backoff_ms", 50),
                        ("grpc.max_reconnect_backoff_ms", max(int(breaker.max_probe_interval_s * 1000), 100))]
        self._security = security or Security.from_env()
        self._tls = tls
        self._channel = open_channel(target, tls=tls, security=self._security, options=options)
        self._stub = pb_grpc.TierCacheStub(self._channel)
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry
        self.frame_bytes = frame_bytes
        self._same_host = same_host
        self._shared: SharedArena | None = None
        self._use_data_channel = data_channel
        self._data_retry_at = 0.0  # while the data channel is unreachable or absent: stream over gRPC until then
        self._max_chunk_bytes = max_chunk_bytes
        self._data: DataChannel | None = None
        self._attached: pb.AttachResponse | None = None  # the server's Attach answer, asked once (and after a restart)
        self._attach_lock = threading.Lock()
        self._lease_ttl_s = 0.0  # the server's, once attached: reads copied well inside it release in the background
        self._releases: _BackgroundReleases | None = None
        self.breaker = CircuitBreaker(self._serving, breaker, target) if breaker is not None else None

    @classmethod
    def from_url(cls, url: str, *, token: str | None = None, tls_ca_file: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 tls_server_name: str | None = None, **options) -> "Client":
        """`grpc://host:port` (or plain `host:port`), `grpcs://host:port` (TLS), or `grpc+unix:///path/to/socket`.

        Token and TLS files not given here come from the environment (see tiercache.client.transport).
        """
        target, tls = parse_url(url)
        security = Security.from_env(token=token, tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                                     tls_key_file=tls_key_file, tls_server_name=tls_server_name)
        return cls(target, tls=tls, security=security, **options)

    @property
    def same_host(self) -> bool:
        """Whether payloads go through the server's shared-memory arena (attaching on first use)."""
        return self._arena() is not None

    # -- the API ----------------------------------------------------------------------------------------------------

    def put(self, namespace: str, key: bytes, data, meta: ChunkMeta = ChunkMeta()) -> str:
        """Store `data` (any bytes-like object) under (namespace, key); returns the tier that holds it."""
        return self.put_many(namespace, [Chunk(key, data, meta)])[0]

    def put_many(self, namespace: str, chunks: Sequence[Chunk]) -> list[str]:
        """Store several chunks in one stream; returns, per chunk, the tier that holds it. A chunk is a `Chunk`
        or a (key, data[, meta]) tuple."""
        validate_namespace(namespace)
        chunks = [c if isinstance(c, Chunk) else Chunk(*c) for c in chunks]
        views = [(validate_key(c.key), memoryview(c.data).cast("B"), c.meta) for c in chunks]
        if not views:
            return []
        arena = self._arena()
        if arena is not None:
            try:
                return [tier for batch in _batches(views, arena.batch_bytes)
                        for tier in self._put_shared(namespace, batch, arena)]
            except (CapacityExceeded, NotFound):
                pass  # the arena is full or a lease expired: the remote path places chunks in any tier
        return self._call(lambda timeout: self._remote(
            timeout, lambda channel, t: channel.put(namespace, views, t),
            lambda t: self._put_streamed(namespace, views, t)))

    def _put_shared(self, namespace: str, views, arena: "SharedArena") -> list[str]:
        headers = [pb.ChunkHeader(namespace=namespace, key=key, size_bytes=len(payload),
                                  object_class=meta.object_class, prefix_tokens=meta.prefix_tokens,
                                  parent=meta.parent)
                   for key, payload, meta in views]
        request = pb.ReserveRequest(namespace=namespace, chunks=headers)
        reservations = self._call(lambda timeout: self._stub.Reserve(request, timeout=timeout)).reservations
        ids = pb.LeaseIds(lease_ids=[r.lease_id for r in reservations])
        try:
            for (_, payload, _), reservation in zip(views, reservations):
                arena.write([(r.offset, r.length) for r in reservation.payload], payload)
        except BaseException:
            self._call(lambda timeout: self._stub.Abort(ids, timeout=timeout), gated=False)
            raise
        return list(self._call(lambda timeout: self._stub.Commit(ids, timeout=timeout), gated=False).stored_in)

    def _put_streamed(self, namespace: str, views, timeout: float) -> list[str]:
        def stream() -> Iterator[pb.PutFrame]:
            for key, payload, meta in views:
                yield pb.PutFrame(header=pb.ChunkHeader(
                    namespace=namespace, key=key, size_bytes=len(payload), object_class=meta.object_class,
                    prefix_tokens=meta.prefix_tokens, parent=meta.parent))
                for frame in frames(payload, self.frame_bytes):
                    yield pb.PutFrame(data=frame)

        return list(self._stub.Put(stream(), timeout=timeout).stored_in)

    def get(self, namespace: str, key: bytes, out=None):
        """The chunk's bytes, or None for a miss.

        `out`: a writable buffer to fill instead (e.g. one reused for every call: no allocation, no page faults). The
        result is then a memoryview of `out`'s first bytes: it is valid until the caller writes `out` again, and
        reading the next chunk into the same buffer overwrites it."""
        if out is None:
            return self.get_many(namespace, [key])[0]
        view = memoryview(out).cast("B")
        fetched = self._read(namespace, [key], lambda index: view)[0]
        return None if fetched is None else fetched.data

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """One result per key, in order: the bytes, or None for a miss."""
        return [f.data if f is not None else None for f in self.fetch_many(namespace, keys)]

    def fetch_many(self, namespace: str, keys: Sequence[bytes]) -> list[Fetched | None]:
        """Like get_many, with the tier each chunk was read from."""
        return self._read(namespace, keys, lambda index: None)

    def get_into(self, namespace: str, keys: Sequence[bytes], buffers: Sequence) -> list[str | None]:
        """Copy chunks into caller-owned buffers (e.g. pinned staging buffers, reused across calls: no allocation,
        no page faults); returns per key the tier it came from, or None for a miss. A buffer must hold its chunk."""
        return [f.tier if f is not None else None for f in self.fetch_into(namespace, keys, buffers)]

    def fetch_into(self, namespace: str, keys: Sequence[bytes], buffers: Sequence) -> list[Fetched | None]:
        """Like get_into, with each chunk's bytes as a view of its buffer (its length is the chunk's size)."""
        outs = [memoryview(b).cast("B") for b in buffers]
        if len(outs) != len(keys):
            raise InvalidArgument("get_into needs one buffer per key")
        return self._read(namespace, keys, lambda index: outs[index])

    def _read(self, namespace: str, keys: Sequence[bytes], out_for) -> list[Fetched | None]:
        """Read through the arena when attached (leased ranges copied out, then released), else over gRPC.
        `out_for(index)` gives a buffer to fill for key `index`, or None to return new bytes."""
        checked = self._checked(namespace, keys)
        arena = self._arena()
        results: list[Fetched | None] = [None] * len(keys)
        remote = list(range(len(keys)))
        if arena is not None and keys:
            request = pb.KeysRequest(namespace=namespace, keys=checked)
            asked = time.monotonic()  # every lease below started after this
            leases = self._call(lambda timeout: self._stub.Acquire(request, timeout=timeout)).leases
            ids = [lease.lease_id for lease in leases if lease.leased]
            try:
                remote = []
                for index, lease in enumerate(leases):
                    if lease.found and lease.leased:
                        ranges = [(r.offset, r.length) for r in lease.payload]
                        results[index] = Fetched(arena.read(ranges, lease.size_bytes, out_for(index)), lease.tier)
                    elif lease.found:
                        remote.append(index)
            except BaseException:
                if ids:
                    self._release(ids)
                raise
            expired: set[int] = set()
            if ids and time.monotonic() - asked < self._lease_ttl_s / 2:
                # Copied well inside the leases (the server's clock is this host's monotonic clock, and each lease
                # began after `asked`): the bytes are valid whatever Release says, so it need not be waited for.
                self._background_releases().add(ids)
            elif ids:
                expired = set(self._release(ids))
            for index, lease in enumerate(leases):  # copied after the pin lapsed: the pages may have been reused
                if lease.leased and lease.lease_id in expired:
                    results[index] = None
                    remote.append(index)
        if remote:
            keys_below = [checked[i] for i in remote]
            outs = [out_for(i) for i in remote]
            fetched = self._call(lambda timeout: self._remote(
                timeout, lambda channel, t: channel.get(namespace, keys_below, outs, t),
                lambda t: self._get_streamed(namespace, keys_below, outs, t)))
            for index, item in zip(remote, fetched):
                results[index] = None if item is None else Fetched(item.data, item.tier)
        return results

    def _get_streamed(self, namespace: str, keys: list[bytes], outs: list, timeout: float) -> list[Fetched | None]:
        request = pb.GetRequest(namespace=namespace, keys=keys)
        streamed = _collect(self._stub.Get(request, timeout=timeout), len(keys))
        return [None if item is None else Fetched(_deliver(item.data, out), item.tier)
                for item, out in zip(streamed, outs)]

    def _remote(self, timeout: float, over_channel: Callable[[DataChannel, float], T],
                over_grpc: Callable[[float], T]) -> T:
        """One try of a remote put or get: over the data channel when the server has one, else streamed over gRPC.

        A data port that cannot be reached right after the server named it, while its gRPC port answers, is a
        deployment that does not expose it (a Service or firewall): this client streams over gRPC for the next
        DATA_CHANNEL_RETRY_S, and says so. A channel that worked before and fails to connect is asked for again (the
        server may have restarted on another port). A server at its data-connection limits answers Busy: that call
        goes over gRPC."""
        channel, fresh = self._data_channel(timeout)
        if channel is None:
            return over_grpc(timeout)
        try:
            return over_channel(channel, timeout)
        except ConnectFailed as exc:
            self._forget_data_channel(channel)
            if not fresh:
                raise
            result = over_grpc(timeout)  # raises when the server is down: then nothing is concluded
            log.warning("%s; its gRPC port answers: streaming payloads over gRPC for %d s (expose the server's data "
                        "port, or set server.data_channel: false)", exc, DATA_CHANNEL_RETRY_S)
            self._data_retry_at = time.monotonic() + DATA_CHANNEL_RETRY_S
            return result
        except Busy as exc:  # at the data channel's limits (a quota or a full store is no Busy: gRPC would fail too)
            log.debug("data channel at its limits (%s): this call goes over gRPC", exc)
            return over_grpc(timeout)

    def _release(self, ids: Sequence[int]) -> list[int]:
        """Release read leases now; returns those that had already lapsed (what was copied under them is suspect)."""
        request = pb.LeaseIds(lease_ids=ids)
        return list(self._call(lambda timeout: self._stub.Release(request, timeout=timeout), gated=False).expired)

    def _background_releases(self) -> "_BackgroundReleases":
        with self._attach_lock:
            if self._releases is None:
                self._releases = _BackgroundReleases(self._release)
            return self._releases

    def exists(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        return [tier is not None for tier in self.locate(namespace, keys)]

    def locate(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the name of the highest tier holding it ("host", "disk", "redis"), or None."""
        request = pb.KeysRequest(namespace=namespace, keys=self._checked(namespace, keys))
        response = self._call(lambda timeout: self._stub.Exists(request, timeout=timeout))
        return [t or None for t in response.tier]

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many existed."""
        request = pb.KeysRequest(namespace=namespace, keys=self._checked(namespace, keys))
        return self._call(lambda timeout: self._stub.Delete(request, timeout=timeout)).deleted

    def lookup(self, namespace: str, shape: ChainShape, prompt_tokens: int, boundaries: bytes,
               positions: Mapping[int, bytes], *, rank_namespaces: Sequence[str] = (), report: bool = True,
               last_chunk_tokens: bytes = b"", match_unit: int = 0) -> "LookupAnswer":
        """The server's hit for a prompt under the hybrid hit rule (see tiercache.prefix.lookup; PrefixCache is the
        usual caller): `boundaries` = h(0), h(N), ... h(KN) concatenated, `positions` other hashes it may check,
        `last_chunk_tokens` the token bytes of [KN, L-1) with u (the server hashes positions there itself)."""
        request = lookup_request(validate_namespace(namespace), shape, prompt_tokens, boundaries, positions,
                                 rank_namespaces, report, last_chunk_tokens, match_unit)
        response = self._call(lambda timeout: self._stub.Lookup(request, timeout=timeout))
        names = list(response.tier_names)
        return LookupAnswer(response.hit_tokens, [names[i] for i in response.tiers], tuple(response.unverified),
                            response.chain_chunks)

    def report_lookup(self, namespace: str, requested_tokens: int, hit_tokens_by_tier: Mapping[str, int]) -> None:
        """Tell the server how a prefix lookup went, for its metrics (`tiercache_lookup_*`) and stats."""
        request = pb.LookupReport(namespace=validate_namespace(namespace), requested_tokens=requested_tokens,
                                  hit_tokens_by_tier=dict(hit_tokens_by_tier))
        self._call(lambda timeout: self._stub.ReportLookup(request, timeout=timeout))

    def stats(self) -> dict:
        return stats_dict(self._call(lambda timeout: self._stub.Stats(pb.StatsRequest(), timeout=timeout)))

    def server_max_chunk_bytes(self) -> int:
        """The largest chunk the server takes (its server.max_chunk_bytes, from its Attach answer: asked once); 0
        when the server is too old to say. Connectors check their largest object against it at startup."""
        with self._attach_lock:
            return self._attach().max_chunk_bytes

    def close(self) -> None:
        if self._releases is not None:
            self._releases.close()  # sends what is pending while the channel is still open
        if self._data is not None:
            self._data.close()
        if self.breaker is not None:
            self.breaker.close()
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one path for every call ------------------------------------------------------------------------------------

    def _attach(self, timeout: float | None = None) -> pb.AttachResponse:
        """The server's Attach answer (the arena, the data channel), asked on first use. Under _attach_lock. With a
        timeout: one try, inside a `_call` of the caller's (which retries it)."""
        if self._attached is None:
            if timeout is not None:
                self._attached = self._stub.Attach(pb.AttachRequest(), timeout=timeout)
            else:
                self._attached = self._call(lambda t: self._stub.Attach(pb.AttachRequest(), timeout=t))
        return self._attached

    def _data_channel(self, timeout: float) -> tuple[DataChannel | None, bool]:
        """The server's data channel (None: stream over gRPC), and whether the server named it just now. A server
        that named none, or one that could not be reached, is asked again after DATA_CHANNEL_RETRY_S."""
        if self._use_data_channel is False or time.monotonic() < self._data_retry_at:
            return None, False
        with self._attach_lock:
            if self._data is not None:
                return self._data, False
            if self._data_retry_at:  # the wait is over: ask the server afresh
                self._attached, self._data_retry_at = None, 0.0
            reply = self._attach(timeout)
            if self._target_is_unix():  # plaintext, like the gRPC unix socket
                address, tls = reply.data_unix_socket or None, None
            else:
                address = (_host_of(self.target), reply.data_port) if reply.data_port else None
                tls = data_tls_context(self._security) if self._tls else None
            if address is None:
                self._data_retry_at = time.monotonic() + DATA_CHANNEL_RETRY_S
                return None, False
            # The server's own limit where it is larger than ours: reads of its largest chunks must not be refused.
            self._data = DataChannel(address, token=self._security.token, tls=tls,
                                     server_name=self._security.tls_server_name,
                                     max_chunk_bytes=max(self._max_chunk_bytes, reply.max_chunk_bytes))
            return self._data, True

    def _forget_data_channel(self, channel: DataChannel) -> None:
        with self._attach_lock:
            if self._data is channel:
                self._data, self._attached = None, None
        channel.close()

    def _target_is_unix(self) -> bool:
        return self.target.startswith("unix:")

    def _arena(self) -> "SharedArena | None":
        """The server's shared-memory arena, mapped on first use; None when not on its host (or same_host=False)."""
        if self._same_host is False:
            return None
        with self._attach_lock:
            if self._shared is None and self._same_host is not False:
                reply = self._attach()
                try:
                    if not reply.available:
                        raise OSError("the server has no shared-memory arena")
                    self._shared = SharedArena(reply.path, reply.size_bytes, reply.inode)
                    self._lease_ttl_s = reply.lease_ttl_s
                except OSError as exc:
                    if self._same_host:
                        raise Unavailable(f"same_host=True but the server's arena cannot be mapped: {exc}") from None
                    self._same_host = False  # another host: stream payloads over gRPC from now on
        return self._shared

    @staticmethod
    def _checked(namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        validate_namespace(namespace)
        return [validate_key(k) for k in keys]

    def _call(self, invoke: Callable[[float], T], gated: bool = True) -> T:
        """`gated=False`: a call that ends what an earlier one began (Commit, Abort, Release of leases it holds) is
        tried even while the breaker is open: refusing it would strand the leases until they expire."""
        if gated and self.breaker is not None:
            self.breaker.refuse()
        deadline = time.monotonic() + self.timeout_s
        delays = self.retry.delays()
        while True:
            try:
                return invoke(max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                error = error_for(exc.code(), exc.details() or "")
                retry, reached = exc.code() == grpc.StatusCode.UNAVAILABLE, _answered(exc)
            except ConnectionBroken as exc:  # the data channel's connection failed: not reached
                error, retry, reached = exc, True, False
            except Unavailable as exc:  # the data channel's server answered UNAVAILABLE
                error, retry, reached = exc, True, True
            delay = next(delays, None) if retry else None
            if delay is None or time.monotonic() + delay >= deadline:
                if self.breaker is not None and isinstance(error, Unavailable) and not reached:
                    self.breaker.trip(error)
                raise error from None
            time.sleep(delay)

    def _serving(self, timeout_s: float) -> bool:
        """The breaker's probe: does the server answer a call that goes through its store within timeout_s? (Its
        health service answers on the event loop even when every store thread is stuck, so it is not asked.)"""
        try:
            self._stub.Stats(pb.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return True


class _BackgroundReleases:
    """Read leases released off the caller's path, in batches, by one daemon thread. A failed Release is harmless:
    the leases lapse on their own after the server's TTL. `close()` sends what is pending."""

    def __init__(self, release: Callable[[Sequence[int]], list[int]]) -> None:
        self._release = release
        self._pending: list[int] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiercache-release", daemon=True)
        self._thread.start()

    def add(self, ids: Sequence[int]) -> None:
        with self._changed:
            self._pending.extend(ids)
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if not self._pending:
                    return
                ids, self._pending = self._pending, []
            try:
                self._release(ids)
            except TierCacheError as exc:
                log.debug("releasing %d read leases failed (they lapse on their own): %s", len(ids), exc)


def _answered(error: grpc.RpcError) -> bool:
    """Whether the server itself answered with this status (a tier it needed is down, a stream went idle): it is
    reachable, so the breaker stays closed."""
    try:
        return any(key == ANSWERED_BY_SERVER for key, _ in error.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - errors raised before any call existed carry no metadata
        return False


def _host_of(target: str) -> str:
    """The host of a gRPC target 'host:port' or '[v6]:port'."""
    return target.rsplit(":", 1)[0].strip("[]")


def _collect(responses: Iterator[pb.GetFrame], count: int) -> list[Fetched | None]:
    results: list[Fetched | None] = [None] * count
    parts: list[bytes] = []
    header = None
    for frame in responses:
        if frame.WhichOneof("part") == "header":
            if header is not None:
                results[header.index] = Fetched(_joined(parts, header.size_bytes), header.tier)
            header, parts = (frame.header if frame.header.found else None), []
        elif header is not None:
            parts.append(frame.data)
    if header is not None:
        results[header.index] = Fetched(_joined(parts, header.size_bytes), header.tier)
    return results


def _batches(views, limit: int):
    """Split a put into batches of at most `limit` payload bytes (always at least one chunk per batch)."""
    batch, size = [], 0
    for item in views:
        if batch and size + len(item[1]) > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item[1])
    if batch:
        yield batch


def _deliver(data: bytes, out: memoryview | None):
    if out is None:
        return data
    if len(out) < len(data):
        raise InvalidArgument(f"a {len(out)}-byte buffer cannot hold a {len(data)}-byte chunk")
    out[:len(data)] = data
    return out[:len(data)]


def _joined(parts: list[bytes], size: int) -> bytes:
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) != size:
        raise Unavailable(f"server sent {len(data)} bytes of a {size}-byte chunk")
    return data


__all__ = ["Chunk", "ChunkMeta", "Client", "Fetched", "RetryPolicy", "TierCacheError"]
