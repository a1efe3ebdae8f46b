"""Which payload path carries a call (client.payload), and what to do when it cannot: the one place that asks the
server's Attach and falls back from one path to another.

- On the server's host (its arena maps here: same inode), payloads are copied in place through the arena. A chunk the
  arena cannot take (full) or bring (not leasable, a lease that lapsed) goes by a remote path. A call that moves less
  than ARENA_MIN_BYTES goes over the data channel instead when the server has one: for small payloads one round trip
  on a local socket costs less CPU, on both sides, than the arena's two gRPC calls (same_host=True: always the arena).
- Elsewhere, over the data channel the server announces, when `data_channel` is not False.
- Else, or when the data channel cannot carry this call, over gRPC streams.

Fallbacks, from the data channel to gRPC streams:
- a data port that cannot be reached right after the server named it, while its gRPC port answers, is a deployment
  that does not expose it (a Service or a firewall): streams for the next DATA_CHANNEL_RETRY_S, said once;
- a channel that worked before and cannot be reached is forgotten and the error raised (the call path retries: the
  server may have restarted on another port, which Attach names again);
- a server at its data-connection limits answers Busy: that call goes over streams.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence, TypeVar

from tiercache.client.arena_path import ArenaPath
from tiercache.client.data_channel import DataChannelPath
from tiercache.client.payload import ELSEWHERE, Chunk, Fetched, PayloadPath
from tiercache.client.settings import ConnectionSettings
from tiercache.client.shared_arena import SharedArena
from tiercache.client.streams import StreamsPath
from tiercache.client.transport import call, data_tls_context
from tiercache.errors import Busy, CapacityExceeded, ConnectFailed, NotFound, Unavailable
from tiercache.protocol.wire import pb, pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
DATA_CHANNEL_RETRY_S = 60
# Same-host calls that move fewer payload bytes than this go over the data channel (when the server has one), larger
# ones through the arena: measured by benchmarks/path_cost.py (docs/benchmarks.md).
ARENA_MIN_BYTES = 4 << 20


class PathChooser:
    """`same_host`: True insists on the arena, False never maps it, None maps it when it can. `data_channel`: False
    streams remote payloads over gRPC even when the server has a data channel. `put` and `get` are one try each, by
    the PayloadPath contract; the lock guards which paths exist, never an RPC or a copy."""

    def __init__(self, stub: pb_grpc.TierCacheStub, settings: ConnectionSettings, client_id: str, *,
                 same_host: bool | None,
                 data_channel: bool | None, frame_bytes: int, max_chunk_bytes: int, timeout_s: float,
                 arena_min_bytes: int = ARENA_MIN_BYTES) -> None:
        self._stub = stub
        self._settings = settings
        self._client_id = client_id
        self._same_host = same_host
        self._use_data_channel = data_channel
        self._max_chunk_bytes = max_chunk_bytes
        self._timeout_s = timeout_s
        self.streams = StreamsPath(stub, frame_bytes)
        self._lock = threading.Lock()
        self._mapping = threading.Lock()  # held while the arena is mapped (once): others wait, not map it again
        self._attached: pb.AttachResponse | None = None  # the server's Attach answer, asked once (and after a restart)
        self._arena: ArenaPath | None = None
        self._data: DataChannelPath | None = None
        self._data_retry_at = 0.0  # while the data channel is unreachable or absent: streams until then
        self._arena_min_bytes = arena_min_bytes
        self._local_retry_at = 0.0  # while the data channel refuses same-host calls: the arena carries them all
        self.clock: Callable[[], float] = time.monotonic  # what DATA_CHANNEL_RETRY_S is measured by (tests set it)

    # -- the payload path of each try -------------------------------------------------------------------------------

    def put(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]:
        arena = self.arena(deadline)
        if arena is not None and self._small(sum(len(payload) for _, payload, _ in chunks)):
            channel = self._local_data_channel(deadline)
            if channel is not None:
                try:
                    return channel.put(namespace, chunks, deadline)
                except (ConnectFailed, Busy) as exc:
                    self._refuse_local(channel, exc)
        if arena is not None:
            try:
                return arena.put(namespace, chunks, deadline)
            except (CapacityExceeded, NotFound):
                pass  # the arena is full or a reservation lapsed: a remote path places chunks in any tier
        return self._remote(deadline, lambda path: path.put(namespace, chunks, deadline))

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            deadline: float) -> list[Fetched | None]:
        arena = self.arena(deadline)
        if arena is not None and all(out is not None for out in outs) and self._small(sum(len(o) for o in outs)):
            channel = self._local_data_channel(deadline)
            if channel is not None:
                try:
                    return channel.get(namespace, keys, outs, deadline)
                except (ConnectFailed, Busy) as exc:
                    self._refuse_local(channel, exc)
        if arena is None:
            return self._remote(deadline, lambda path: path.get(namespace, keys, outs, deadline))
        results = arena.get(namespace, keys, outs, deadline)
        elsewhere = [i for i, result in enumerate(results) if result is ELSEWHERE]
        if elsewhere:
            fetched = self._remote(deadline, lambda path: path.get(
                namespace, [keys[i] for i in elsewhere], [outs[i] for i in elsewhere], deadline))
            for index, item in zip(elsewhere, fetched):
                results[index] = item
        return results

    def _remote(self, deadline: float, send: Callable[[PayloadPath], T]) -> T:
        """One try over the data channel when there is one, else (or when it cannot carry this call) over streams."""
        channel, fresh = self._data_channel(deadline)
        if channel is None:
            return send(self.streams)
        try:
            return send(channel)
        except ConnectFailed as exc:
            self._forget(channel)
            if not fresh:
                raise
            result = send(self.streams)  # raises when the server is down: then nothing is concluded
            log.warning("%s; its gRPC port answers: streaming payloads over gRPC for %d s (expose the server's data "
                        "port, or set server.data_channel: false)", exc, DATA_CHANNEL_RETRY_S)
            self._data_retry_at = self.clock() + DATA_CHANNEL_RETRY_S
            return result
        except Busy as exc:  # at the data channel's limits (a quota or a full store is no Busy: gRPC would fail too)
            log.debug("data channel at its limits (%s): this call goes over gRPC", exc)
            return send(self.streams)

    def _small(self, size: int) -> bool:
        """A same-host call this small costs less CPU (the client's and the server's) and time as one round trip over
        the data channel than through the arena, whose two gRPC calls (Reserve and Commit, Acquire and Release) cost
        more than the socket's copies below ARENA_MIN_BYTES. same_host=True insists on the arena for every call."""
        return self._same_host is None and size < self._arena_min_bytes

    def _local_data_channel(self, deadline: float) -> DataChannelPath | None:
        """The data channel for a same-host call, when the server has one and it has not been refused lately."""
        if self.clock() < self._local_retry_at:
            return None
        channel, _ = self._data_channel(deadline)
        return channel

    def _refuse_local(self, channel: DataChannelPath, exc: Exception) -> None:
        """The data channel cannot carry same-host calls now (unreachable on this host, or at its limits): the arena
        carries them until DATA_CHANNEL_RETRY_S has passed."""
        log.debug("same-host calls go through the arena for %d s: the data channel answered %s",
                  DATA_CHANNEL_RETRY_S, exc)
        if isinstance(exc, ConnectFailed):
            self._forget(channel)
        self._local_retry_at = self.clock() + DATA_CHANNEL_RETRY_S

    # -- Attach, and the paths it opens -----------------------------------------------------------------------------

    def attach(self, deadline: float) -> pb.AttachResponse:
        """The server's Attach answer (its arena, its data channel, its chunk limit), asked on first use. Asked
        without the lock: two threads that start together may both ask, and the first answer is kept."""
        with self._lock:
            if self._attached is not None:
                return self._attached
        reply = call(self._stub.Attach, pb.AttachRequest(), deadline)
        with self._lock:
            if self._attached is None:
                self._attached = reply
            return self._attached

    def arena(self, deadline: float) -> ArenaPath | None:
        """The same-host path, its arena mapped on first use; None when not on the server's host (or same_host=False).
        same_host=True and an arena that cannot be mapped is Unavailable."""
        if self._same_host is False or self._arena is not None:
            return self._arena
        reply = self.attach(deadline)
        with self._mapping:
            if self._arena is None and self._same_host is not False:
                try:
                    if not reply.available:
                        raise OSError("the server has no shared-memory arena")
                    arena = SharedArena(reply.path, reply.size_bytes, reply.inode)
                except OSError as exc:
                    if self._same_host:
                        raise Unavailable(f"same_host=True but the server's arena cannot be mapped: {exc}") from None
                    self._same_host = False  # another host: remote paths from now on
                    return None
                self._arena = ArenaPath(self._stub, arena, reply.lease_ttl_s, self._timeout_s)
        return self._arena

    @property
    def data_channel(self) -> DataChannelPath | None:
        """The data channel in use now (None: none yet, or streams)."""
        return self._data

    def _data_channel(self, deadline: float) -> tuple[DataChannelPath | None, bool]:
        """The server's data channel (None: stream over gRPC), and whether the server named it just now. A server
        that named none, or one that could not be reached, is asked again after DATA_CHANNEL_RETRY_S."""
        if self._use_data_channel is False or self.clock() < self._data_retry_at:
            return None, False
        with self._lock:
            if self._data is not None:
                return self._data, False
            if self._data_retry_at:  # the wait is over: ask the server afresh
                self._attached, self._data_retry_at = None, 0.0
        reply = self.attach(deadline)
        address = self._data_address(reply)
        settings = self._settings
        tls = data_tls_context(settings) if address is not None and settings.uses_tls else None  # reads files
        with self._lock:
            if self._data is not None:  # another thread opened it meanwhile
                return self._data, False
            if address is None:
                self._data_retry_at = self.clock() + DATA_CHANNEL_RETRY_S
                return None, False
            # The server's own limit where it is larger than ours: reads of its largest chunks must not be refused.
            self._data = DataChannelPath(address, token=settings.token, client_id=self._client_id, tls=tls,
                                     server_name=settings.tls_server_name,
                                     max_chunk_bytes=max(self._max_chunk_bytes, reply.max_chunk_bytes),
                                     engine_blocks=reply.engine_blocks)
            return self._data, True

    def _data_address(self, reply: pb.AttachResponse) -> str | tuple[str, int] | None:
        if self._settings.unix_socket:  # plaintext, like the gRPC unix socket (uses_tls is False there)
            return reply.data_unix_socket or None
        return (self._settings.host, reply.data_port) if reply.data_port else None

    def _forget(self, channel: DataChannelPath) -> None:
        """A data channel that failed to connect: ask Attach again next time (a restart moves the port)."""
        with self._lock:
            if self._data is channel:
                self._data, self._attached = None, None
        channel.close()

    def close(self) -> None:
        with self._lock:
            arena, self._arena = self._arena, None
            channel, self._data = self._data, None
        if arena is not None:
            arena.close()
        if channel is not None:
            channel.close()
