"""The server's one intake: what every transport asks before it moves a chunk's payload in or out of the store.

Three transports carry payloads — gRPC streams (Put / Get), the same-host path's leases (Reserve / Commit, Acquire /
Release) and the data channel (server.data_channel) — and they only frame bytes. The rules are written here, once:
- who is calling: `tenant(token)`, the one lookup of a bearer token;
- how many at once: `in_flight(peer, tenant, client_id)`, one count of requests in flight per client, per peer host
  and per tenant whatever carries them (server.limits; the data channel once kept counters of its own, so a host
  could have twice its limit in flight);
- a put: `admit` applies the one size / meta / namespace / quota rule to a whole request (one quota point per
  request: the quota is a store call), then `receive` (or `reserve`, for a same-host writer) gives each chunk its
  room and `Incoming.store` places it;
- a get: `checked_keys` once per request, then `serve(keys)` for each batch of at most SERVE_BATCH keys (`batches`):
  where each payload lies and how to let it go.

`serve` is the one read path: a chunk any tier holds is served to every transport alike, pinned in the arena when it
is there (or promoted there), else from the store's copy, whatever room the arena has. (A chunk was once read over
gRPC and missed a moment later through the data channel and the same-host path while stalled puts held the arena;
the miss was every path's, a chunk evicted and not yet placed below: tiers/indexed.py `release`. The test is
`test_a_stored_chunk_is_served_by_every_path_while_stalled_puts_take_the_arena` in tests/server/test_data_channel.py.)
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from tiercache.config import format_size
from tiercache.errors import CapacityExceeded, InvalidArgument
from tiercache.protocol.data_channel import PutEntry
from tiercache.protocol.wire import checked_meta
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey
from tiercache.server.auth import Tenant, TenantTable
from tiercache.server.limits import StreamLimits
from tiercache.store.same_host import ReadGrant, SameHostPath, WriteGrant
from tiercache.store.tiered import TieredStore

# A record received outside the arena grows as its payload arrives: its first step, then as much again as has come
# (at most twice what was received, or one step): a client that announces 64 MiB and sends a byte commits 1 MiB of
# this process's memory, not 64. Hostile clients on the data channel declare large puts and trickle a byte at a time
# (`test_hostile_clients_...` in tests/server/test_data_channel.py).
FIRST_STEP_BYTES = 1 << 20
# It grows with PyByteArray_Resize (documented C API), which leaves the new bytes unwritten until the payload lands on
# them: `+= bytes(n)` zero-fills them first, a pass over every byte that halved the rate of receiving a 4 MiB record
# here (4.5 against 12.8 GB/s, memcpy standing in for the socket; bytearray(n) of the whole size: 8.4 GB/s). The
# unwritten bytes are never read: a record is stored only once its payload is complete.
_resize = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_ssize_t)(("PyByteArray_Resize", ctypes.pythonapi))


# Keys a read asks the store for at once: what lies below the arena comes in one call per tier (one round trip to Redis
# for the batch, not one per key), and the store's copies of a batch are held together until sent.
SERVE_BATCH = 16


def batches(keys: Sequence[ChunkKey]) -> Iterable[Sequence[ChunkKey]]:
    """A get request's keys, SERVE_BATCH at a time (what `Intake.serve` takes)."""
    for start in range(0, len(keys), SERVE_BATCH):
        yield keys[start:start + SERVE_BATCH]


def check_chunk_size(size_bytes: int, max_chunk_bytes: int) -> None:
    """InvalidArgument for a chunk past server.max_chunk_bytes, saying how to raise the limit: a model's state can be
    larger than the default (a Qwen3.6-27B state is 147 MiB), and the bare numbers did not say where the limit is
    set."""
    if size_bytes > max_chunk_bytes:
        raise InvalidArgument(f"chunk of {size_bytes} bytes ({format_size(size_bytes)}) exceeds the server's maximum "
                              f"of {max_chunk_bytes} ({format_size(max_chunk_bytes)}): raise it with `tiercache serve "
                              f"--max-chunk-size` (server.max_chunk_bytes)")


@dataclass(frozen=True)
class Admitted:
    """A chunk a put may send: its key checked, within the size limit, its meta valid, its tenant's quota asked."""

    key: ChunkKey
    size_bytes: int
    meta: encoding.ChunkMeta


class Incoming:
    """One admitted chunk's payload on its way in: filled front to back (`fill` from a socket, `write` from frames),
    then `store`d or `abort`ed. Subclasses say where the bytes go (`_space`) and how the record is placed."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.received_bytes = 0

    @property
    def complete(self) -> bool:
        return self.received_bytes == self.size_bytes

    def fill(self, receive: Callable[[memoryview], None]) -> None:
        """Receive the rest of the payload: `receive(view)` fills each view it is given completely (a socket read
        with its deadline). No view outlives its call: the buffer behind it may grow between calls."""
        while not self.complete:
            with self._space() as view:
                receive(view)
                self.received_bytes += len(view)

    def write(self, data) -> None:
        """Copy the next part of the payload (a gRPC frame) in; InvalidArgument past the announced size."""
        data = memoryview(data).cast("B")
        if len(data) > self.size_bytes - self.received_bytes:
            raise InvalidArgument(f"frames exceed the announced size of {self.size_bytes} bytes")
        while data:
            with self._space() as view:
                n = min(len(view), len(data))
                view[:n] = data[:n]
                self.received_bytes += n
            data = data[n:]

    def store(self) -> str:
        """Place the complete record in the store; returns the tier that holds it."""
        raise NotImplementedError

    def abort(self) -> None:
        """Give back what the chunk held (called on every path that does not store it)."""

    def _space(self) -> memoryview:
        """A non-empty view where the next payload bytes go (the caller releases it)."""
        raise NotImplementedError


class InArena(Incoming):
    """Received straight into pages reserved in the arena (no copy after the socket's), visible once committed."""

    def __init__(self, same_host: SameHostPath, grant: WriteGrant, size_bytes: int) -> None:
        super().__init__(size_bytes)
        self.grant = grant
        self._same_host = same_host
        self._views = same_host.views(grant.payload)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The reserved payload's (offset, length) in the arena file (where a same-host writer copies to)."""
        return self.grant.payload

    def _space(self) -> memoryview:
        at = self.received_bytes
        for view in self._views:
            if at < len(view):
                return view[at:]
            at -= len(view)
        raise AssertionError("the reservation is full")

    def store(self) -> str:
        self._let_go()
        return self._same_host.commit(self.grant)

    def abort(self) -> None:
        self._let_go()
        self._same_host.abort(self.grant)

    def _let_go(self) -> None:
        """Drop the views of the arena's pages (a view alive at shutdown keeps the arena from closing: an exception's
        traceback can keep this object alive long after its request ended)."""
        for view in self._views:
            view.release()
        self._views = []


class OwnRecord(Incoming):
    """Received into a record buffer of its own, which the store places in any tier. It grows as bytes arrive
    (FIRST_STEP_BYTES, then doubling), never to the announced size before they come."""

    def __init__(self, store: TieredStore, chunk: Admitted) -> None:
        super().__init__(chunk.size_bytes)
        self._store = store
        self._key, self._meta = chunk.key, chunk.meta
        self._start = encoding.header_bytes(chunk.key, chunk.meta)
        self._record = bytearray(self._start)

    def _space(self) -> memoryview:
        end = self._start + self.received_bytes
        if end == len(self._record):
            grow = min(self.size_bytes - self.received_bytes, max(FIRST_STEP_BYTES, self.received_bytes))
            _resize(self._record, end + grow)
        return memoryview(self._record)[end:]

    def store(self) -> str:
        record, self._record = self._record, bytearray()
        encoding.seal(record, self._key, self._meta)
        return self._store.put_record(self._key, record)


class Served:
    """A chunk found for a reader: where its payload lies — pinned arena pages (`pinned`: sent or leased in place) or
    the copy the store read — and `release`, which every reader calls once it is done with the bytes."""

    def __init__(self, grant: ReadGrant, same_host: SameHostPath | None) -> None:
        self.tier = grant.tier
        self.size_bytes = grant.size_bytes
        self._grant = grant
        self._same_host = same_host
        self._views: list[memoryview] = []
        self._released = False

    @property
    def pinned(self) -> bool:
        return self._grant.pinned

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The pinned payload's (offset, length) in the arena file (what a same-host reader copies from)."""
        return self._grant.payload

    def views(self) -> list[memoryview]:
        """The payload, in order: views of the arena's pages while pinned (valid until `release`), else the store's
        copy."""
        if not self.pinned:
            return [self._grant.copy]
        if not self._views:
            self._views = self._same_host.views(self._grant.payload)
        return self._views

    def release(self) -> None:
        """Let the chunk go; idempotent (a reader releases what it sent, and a whole batch when it stops)."""
        for view in self._views:  # see InArena._let_go
            view.release()
        self._views = []
        if self.pinned and not self._released:
            self._same_host.unpin(self._grant)
        self._released = True

    @staticmethod
    def release_all(served: Sequence["Served | None"]) -> None:
        for item in served:
            if item is not None:
                item.release()


class Intake:
    """The rules every transport applies (see the module docstring). Thread-safe: gRPC handlers call it from the
    event loop and its worker pool, the data channel's listener from its connection threads."""

    def __init__(self, store: TieredStore, tenants: TenantTable, limits: StreamLimits, max_chunk_bytes: int,
                 engine_blocks: bool = False, same_host: SameHostPath | None = None) -> None:
        """`same_host`: the store's same-host path (SameHostPath.over), None without an arena clients can map."""
        self.store = store
        self.same_host = same_host
        self.limits = limits
        self.max_chunk_bytes = max_chunk_bytes
        # Keep what chunks say of the engine's blocks (token ids, block hash): only a server that publishes KV events
        # needs them, and they are 4 bytes per token in every tier's index and record (2 GiB of RAM per million
        # 544-token chunks on disk); without events they are dropped at the door.
        self.engine_blocks = engine_blocks
        self._tenants = tenants

    # -- who, and how many at once ----------------------------------------------------------------------------------

    def tenant(self, token: str | None) -> Tenant:
        """The tenant a bearer token belongs to (Unauthenticated when none does; every caller is `open` without a
        tenants file)."""
        return self._tenants.tenant(token)

    def in_flight(self, peer: str, tenant: Tenant, client_id: str = "") -> contextlib.AbstractContextManager:
        """Count one request (a stream, a data-channel request) against its client's, peer host's and tenant's limits
        while it runs; CapacityExceeded over any (server.limits: `client_id` is what the client calls itself)."""
        return self.limits.stream(peer, tenant.name, client_id)

    # -- puts -------------------------------------------------------------------------------------------------------

    def admit(self, tenant: Tenant, namespace: object, entries: Sequence[PutEntry]) -> list[Admitted]:
        """The chunks of one put request, checked: sizes first (a transport that refuses an oversized chunk does not
        read what follows: the announced bytes could be anything), then the namespace (once), keys and metas, then
        the tenant's quota for all of them at once. Raises the first failure."""
        for entry in entries:
            check_chunk_size(entry.size, self.max_chunk_bytes)
        keys = tenant.checked_keys(namespace, [entry.key for entry in entries])
        admitted = [Admitted(key, entry.size, self._kept(checked_meta(entry.meta)))
                    for key, entry in zip(keys, entries)]
        tenant.check_room(self.store, sum(entry.size for entry in entries))
        return admitted

    def _kept(self, meta: encoding.ChunkMeta) -> encoding.ChunkMeta:
        if self.engine_blocks or not (meta.tokens or meta.engine_hash):
            return meta
        return meta._replace(tokens=b"", engine_hash=0)

    def receive(self, chunk: Admitted) -> Incoming:
        """Room for a chunk's payload: pages reserved in the arena when it takes them (received in place), else a
        record of its own, growing as the bytes arrive.

        With a GPU tier above the arena, the chunk gets a record of its own, which the store places from the top (GPU
        first, what it evicts demoted to the arena): received in place, every put would land in the arena and the GPU
        tier would never fill. Only same-host writers (`reserve`: they need pages they can map) write the arena."""
        if self.same_host is not None and self.same_host.on_top:
            try:
                return self.reserve(chunk)
            except CapacityExceeded:
                pass
        return OwnRecord(self.store, chunk)

    def reserve(self, chunk: Admitted) -> InArena:
        """Pages in the arena for a same-host writer; CapacityExceeded when the arena cannot take the chunk now."""
        same_host = self.same_host
        if same_host is None:
            raise CapacityExceeded("this server has no shared-memory arena")
        return InArena(same_host, same_host.reserve(chunk.key, chunk.size_bytes, chunk.meta), chunk.size_bytes)

    # -- gets -------------------------------------------------------------------------------------------------------

    @staticmethod
    def checked_keys(tenant: Tenant, namespace: object, keys: Iterable[object]) -> list[ChunkKey]:
        """The keys of one get request: the namespace valid and the tenant's (checked once), every key valid."""
        return tenant.checked_keys(namespace, keys)

    def serve(self, keys: Sequence[ChunkKey]) -> list[Served | None]:
        """Chunks for any reader, from whichever tier holds each (promoted on the way, as every hit is): pinned in the
        arena when it is there, else the store's copy; None for a miss. One batch of at most SERVE_BATCH keys
        (`batches`); the reader releases each."""
        same_host = self.same_host
        if same_host is None:
            return [None if found is None else Served(ReadGrant(found.tier, (), len(found.payload), None,
                                                                found.payload), None)
                    for found in self.store.get_many(keys)]
        return [None if read is None else Served(read, same_host) for read in same_host.pin(keys)]
