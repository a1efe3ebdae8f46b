"""The gRPC cache server: each RPC decodes its request, makes one store call, and encodes the answer.

Errors are turned into status codes by one wrapper (server.rpc) using protocol.wire's mapping; an unexpected exception
becomes INTERNAL with a log line, never a dead server. The process around it is server.app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from concurrent.futures import Executor
from typing import AsyncIterator, Callable, TypeVar

from tiercache import __version__
from tiercache.config import Config
from tiercache.errors import InvalidArgument, Unavailable
from tiercache.events.pods import Known, PodRegistry
from tiercache.events.blocks import Pod
from tiercache.prefix.lookup import find_hit
from tiercache.protocol.data_channel import PutEntry
from tiercache.protocol.wire import (chain_shape, chunk_meta, delivered, delivery_totals, frames, lookup_query, pb,
                                     pb_grpc)
from tiercache.record.keys import ChunkKey
from tiercache.server.auth import Tenant
from tiercache.server.intake import InArena, Incoming, Intake, Served, batches
from tiercache.server.leases import LeaseTable
from tiercache.server.metrics import Metrics
from tiercache.server.rpc import rpc
from tiercache.store.chain import StoreChain
from tiercache.store.stats import StoreStats

T = TypeVar("T")
_KNOWN = {Known.UNSPECIFIED: pb.POD_REGISTRATION_UNSPECIFIED, Known.REGISTERED: pb.POD_REGISTRATION_REGISTERED,
          Known.NOT_REGISTERED: pb.POD_REGISTRATION_NOT_REGISTERED}


def _stats_message(stats: StoreStats, *, version: str, uptime_s: float, max_chunk_bytes: int) -> pb.StatsResponse:
    return pb.StatsResponse(
        version=version, uptime_s=uptime_s, max_chunk_bytes=max_chunk_bytes,
        tiers=[pb.TierStats(**vars(t)) for t in stats.tiers],
        namespaces=[pb.NamespaceStats(namespace=n.namespace, used_bytes=n.used_bytes, chunks=n.chunks)
                    for n in stats.namespaces],
        lookups=stats.lookups.lookups, requested_tokens=stats.lookups.requested_tokens,
        found_tokens_by_tier=stats.lookups.found_tokens_by_tier, delivered=delivery_totals(stats.delivered))


class TierCacheServicer(pb_grpc.TierCacheServicer):
    """The handlers. They run on the server's event loop; every store call runs on the `blocking` pool (copies, disk,
    Redis), so a stream waiting on its client holds no thread, and the loop never waits on a tier."""

    def __init__(self, intake: Intake, config: Config, metrics: Metrics, leases: LeaseTable, blocking: Executor,
                 pods: PodRegistry, data_channel: Callable[[], tuple[int, str]] = lambda: (0, "")) -> None:
        self.intake = intake
        self.store = intake.store
        self.metrics = metrics
        self.leases = leases
        self._blocking = blocking
        self._data_channel = data_channel  # (port, unix socket) of the data channel, announced by Attach
        self._max_chunk_bytes = config.server.max_chunk_bytes
        self._frame_bytes = config.server.frame_bytes
        self._idle_s = config.server.stream_idle_timeout_s
        self._started = time.monotonic()
        self.pods = pods  # KV events' pods (tiercache.events.pods)

    async def _run(self, call, *args):
        """A blocking call on the pool, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._blocking, functools.partial(call, *args))

    async def _within_idle(self, step, stalled: str):
        """Await one read or write of a stream; Unavailable when it does not finish within the idle time."""
        try:
            return await asyncio.wait_for(step, self._idle_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"{stalled} for {self._idle_s:g} s: the stream is closed "
                              f"(server.stream_idle_timeout_s)") from None

    async def _next_frame(self, frames: AsyncIterator[pb.PutFrame]) -> pb.PutFrame | None:
        """The stream's next frame, None at its end."""
        try:
            return await self._within_idle(anext(frames), "the client sent no frame")
        except StopAsyncIteration:
            return None

    async def _send(self, context, frame: pb.GetFrame) -> None:
        """Write one frame (a client that reads nothing keeps its window full and the write waiting)."""
        await self._within_idle(context.write(frame), "the client read nothing")

    @rpc(stream=True)
    async def Put(self, request_iterator: AsyncIterator[pb.PutFrame], context, tenant: Tenant) -> pb.PutResponse:
        stored_in = []
        current: Incoming | None = None
        try:
            while (frame := await self._next_frame(request_iterator)) is not None:
                part = frame.WhichOneof("part")
                if part == "header":
                    if current is not None:
                        raise InvalidArgument("a chunk header arrived before the previous chunk's data was complete")
                    current = await self._receive(tenant, frame.header)
                elif part == "data":
                    if current is None:
                        raise InvalidArgument("a data frame arrived before any chunk header")
                    current.write(frame.data)
                else:
                    raise InvalidArgument("empty Put frame")
                if current is not None and current.complete:
                    chunk, current = current, None
                    stored_in.append(await self._run(chunk.store))
            if current is not None:
                raise InvalidArgument(f"stream ended after {current.received_bytes} of {current.size_bytes} "
                                      "announced bytes")
        finally:
            if current is not None:  # not stored: give back its room (quick, no I/O: on the loop)
                current.abort()
        return pb.PutResponse(stored_in=stored_in)

    async def _receive(self, tenant: Tenant, header: pb.ChunkHeader) -> Incoming:
        """Room for the chunk a Put header announces (the stream announces its chunks one at a time: each is a
        request of one chunk to the intake)."""
        def receive() -> Incoming:
            entry = PutEntry(header.key, header.size_bytes, chunk_meta(header))
            (chunk,) = self.intake.admit(tenant, header.namespace, [entry])
            return self.intake.receive(chunk)
        return await self._run_holding(receive, Incoming.abort)

    async def _run_holding(self, make: Callable[[], T], give_back: Callable[[T], None]) -> T:
        """`make()` on the pool, for what must be given back (a reservation may evict and demote to disk; a read may
        promote): if the stream is cancelled while it runs, what it made is given back once made."""
        made = asyncio.get_running_loop().run_in_executor(self._blocking, make)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(functools.partial(_give_back, give_back))
            raise

    @rpc(stream=True)
    async def Get(self, request: pb.GetRequest, context, tenant: Tenant) -> None:
        keys = self.intake.checked_keys(tenant, request.namespace, request.keys)
        index = 0
        for batch in batches(keys):
            served = await self._run_holding(functools.partial(self.intake.serve, batch), Served.release_all)
            try:  # sent from the arena's pages while pinned: a reader that stops holds the pins until its idle timeout
                for item in served:
                    await self._send_item(context, index, item)
                    index += 1
            finally:
                Served.release_all(served)

    async def _send_item(self, context, index: int, served: Served | None) -> None:
        if served is None:
            await self._send(context, pb.GetFrame(header=pb.GetHeader(index=index, found=False)))
            return
        try:
            await self._send(context, pb.GetFrame(header=pb.GetHeader(index=index, found=True,
                                                                      size_bytes=served.size_bytes,
                                                                      tier=served.tier)))
            for view in served.views():
                for data in frames(view, self._frame_bytes):
                    await self._send(context, pb.GetFrame(data=data))
        finally:
            served.release()

    @rpc
    async def Exists(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.ExistsResponse:
        where = await self._run(self.store.locate, tenant.checked_keys(request.namespace, request.keys))
        return pb.ExistsResponse(tier=[w or "" for w in where])

    @rpc
    async def Delete(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.DeleteResponse:
        deleted = await self._run(self.store.delete, tenant.checked_keys(request.namespace, request.keys))
        return pb.DeleteResponse(deleted=deleted)

    @rpc
    async def ReportDelivery(self, request: pb.DeliveryReport, context, tenant: Tenant) -> pb.DeliveryReportAck:
        tenant.checked_namespace(request.namespace)
        self.store.reports.record_delivery(delivered(request.delivered).checked())
        return pb.DeliveryReportAck()

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context, tenant: Tenant) -> pb.LookupResponse:
        namespaces = [tenant.checked_namespace(ns) for ns in (request.namespace, *request.rank_namespaces)]
        query = lookup_query(request)
        found = await self._run(self._lookup, query, namespaces, request.report)
        tiers = found.tiers
        names = sorted(set(tiers))
        index = {name: i for i, name in enumerate(names)}
        return pb.LookupResponse(hit_tokens=found.tokens, tier_names=names,
                                 tiers=bytes(index[tier] for tier in tiers), unverified=found.unverified,
                                 chain_chunks=found.chain_chunks, pod=_KNOWN[self.pods.known(tenant, request.pod_id)])

    def _lookup(self, query, namespaces: list[str], report: bool):
        found = find_hit(query, StoreChain(self.store, namespaces))
        if found.checkpoints:  # the load that follows promotes the kv chunks; their demotions must not evict these
            self.store.touch([ChunkKey(ns, key) for ns in namespaces for key in found.checkpoints])
        if report and not found.unverified:  # a lookup with unverified positions is asked again
            self.store.reports.record_lookup(query.prompt_tokens, found.tokens_by_tier())
        return found

    # -- KV events for routers (tiercache.events) -------------------------------------------------------------------

    @rpc
    async def RegisterPod(self, request: pb.RegisterPodRequest, context, tenant: Tenant) -> pb.RegisterPodResponse:
        pod = Pod(request.pod_id, request.model_name, tuple(request.namespaces),
                  chain_shape(request.chunk_tokens, request.groups), tuple(request.engine_groups), request.dp_rank,
                  same_node=not request.remote, match_unit=request.match_unit)
        ports = (request.pub_port, request.replay_port) if request.pub_port and request.replay_port else None
        endpoints = await self._run(self.pods.register, tenant, pod, ports)
        return pb.RegisterPodResponse(endpoint=endpoints.endpoint, replay_endpoint=endpoints.replay_endpoint,
                                      topic=endpoints.topic)

    @rpc
    async def UnregisterPod(self, request: pb.UnregisterPodRequest, context,
                            tenant: Tenant) -> pb.UnregisterPodResponse:
        await self._run(self.pods.unregister, tenant, request.pod_id)
        return pb.UnregisterPodResponse()

    @rpc
    async def QueryPods(self, request: pb.QueryPodsRequest, context, tenant: Tenant) -> pb.QueryPodsResponse:
        if request.token_ids and request.block_hashes:
            raise InvalidArgument("a pod query names token ids or block hashes, not both")
        answers = await self._run(self.pods.query, tenant, request.model_name, list(request.token_ids),
                                  list(request.block_hashes) if request.block_hashes else None, list(request.pod_ids))
        return pb.QueryPodsResponse(pods=[
            pb.PodQueryHit(pod_id=hit.pod.pod_id, model_name=hit.pod.model_name, dp_rank=hit.pod.dp_rank,
                           matched_tokens=hit.tokens, tokens_by_tier=hit.tokens_by_tier(), tenant=owner,
                           block_tokens=hit.pod.shape.chunk_tokens)
            for owner, hit in answers])

    # -- the same-host path (intake.same_host) ----------------------------------------------------------------------

    @rpc
    async def Attach(self, request: pb.AttachRequest, context, tenant: Tenant) -> pb.AttachResponse:
        data_port, data_unix_socket = self._data_channel()
        same_host = self.intake.same_host
        if same_host is None or not tenant.same_host:  # not an error: the client uses the data channel or Put/Get
            return pb.AttachResponse(available=False, data_port=data_port, data_unix_socket=data_unix_socket,
                                     max_chunk_bytes=self._max_chunk_bytes,
                                     engine_blocks=self.intake.engine_blocks)
        arena = same_host.arena
        return pb.AttachResponse(available=True, path=arena.path, size_bytes=arena.size_bytes, inode=arena.inode,
                                 lease_ttl_s=self.leases.ttl_s, data_port=data_port,
                                 data_unix_socket=data_unix_socket, max_chunk_bytes=self._max_chunk_bytes,
                                 engine_blocks=self.intake.engine_blocks)

    def _same_host(self, tenant: Tenant, instead: str) -> None:
        """Whether this caller may use the same-host path: the server has an arena and the tenant the right."""
        if self.intake.same_host is None:
            raise InvalidArgument(f"this server has no shared-memory arena: use {instead}")
        tenant.check_same_host()

    @rpc
    async def Reserve(self, request: pb.ReserveRequest, context, tenant: Tenant) -> pb.ReserveResponse:
        self._same_host(tenant, "Put")
        granted = await self._run(self._reserve, request, tenant)
        return pb.ReserveResponse(reservations=[pb.Reservation(lease_id=lease_id, payload=_pb_ranges(incoming.ranges))
                                                for lease_id, incoming in granted])

    def _reserve(self, request: pb.ReserveRequest, tenant: Tenant) -> list[tuple[int, InArena]]:
        entries = [PutEntry(header.key, header.size_bytes, chunk_meta(header)) for header in request.chunks]
        chunks = self.intake.admit(tenant, request.namespace, entries)
        granted: list[tuple[int, InArena]] = []
        try:
            for chunk in chunks:
                incoming = self.intake.reserve(chunk)
                granted.append((self.leases.grant(incoming, InArena.abort, writable=True), incoming))
        except Exception:
            self.leases.release([lease_id for lease_id, _ in granted], writable=True)
            raise
        return granted

    @rpc
    async def Commit(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.PutResponse:
        tenant.check_same_host()
        return pb.PutResponse(stored_in=await self._run(self._commit, request.lease_ids))

    def _commit(self, lease_ids) -> list[str]:
        # One lease at a time: a reservation taken out of the table is stored at once, so an id that fails (expired,
        # unknown) leaves the ones after it in the table, where they expire and are taken back.
        return [self.leases.take(i, writable=True).store() for i in lease_ids]

    @rpc
    async def Abort(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.LeaseAck:
        tenant.check_same_host()
        await self._run(self.leases.release, request.lease_ids, True)
        return pb.LeaseAck()

    @rpc
    async def Acquire(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.AcquireResponse:
        self._same_host(tenant, "Get")
        keys = self.intake.checked_keys(tenant, request.namespace, request.keys)
        return pb.AcquireResponse(leases=await self._run(self._acquire, keys))

    def _acquire(self, keys: list[ChunkKey]) -> list[pb.Lease]:
        leases = []
        for batch in batches(keys):
            served = self.intake.serve(batch)
            for n, item in enumerate(served):
                try:
                    leases.append(self._lease(item))
                except BaseException:
                    Served.release_all(served[n:])  # what no lease holds yet
                    raise
        return leases

    def _lease(self, served: Served | None) -> pb.Lease:
        if served is None:
            return pb.Lease(found=False)
        if not served.pinned:  # not in the arena (too large for it, or no room now): the client reads it remotely
            served.release()
            return pb.Lease(found=True, leased=False, tier=served.tier)
        lease_id = self.leases.grant(served, Served.release, writable=False)
        return pb.Lease(found=True, leased=True, lease_id=lease_id, tier=served.tier, size_bytes=served.size_bytes,
                        payload=_pb_ranges(served.ranges))

    @rpc
    async def Release(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.LeaseAck:
        tenant.check_same_host()
        return pb.LeaseAck(expired=await self._run(self.leases.release, request.lease_ids, False))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context, tenant: Tenant) -> pb.StatsResponse:
        stats = await self._run(self.store.stats)
        if not tenant.admin:  # namespaces name models: a tenant sees its own only
            own = tuple(n for n in stats.namespaces if tenant.owns(n.namespace))
            stats = dataclasses.replace(stats, namespaces=own)
        return _stats_message(stats, version=__version__, uptime_s=time.monotonic() - self._started,
                             max_chunk_bytes=self._max_chunk_bytes)


def _give_back(give_back: Callable, done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is None and done.result() is not None:
        give_back(done.result())


def _pb_ranges(ranges) -> list:
    return [pb.Range(offset=o, length=n) for o, n in ranges]
