"""The gRPC cache server: each RPC decodes its request, makes one store call, and encodes the answer.

Errors are turned into status codes by one wrapper (`_rpc`) using protocol.wire's mapping; an unexpected exception
becomes INTERNAL with a log line, never a dead server.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Iterable, Iterator

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tiercache import __version__
from tiercache.config import Config, SecurityConfig
from tiercache.errors import ConfigError, InvalidArgument
from tiercache.prefix.lookup import find_hit
from tiercache.protocol.wire import (SERVICE_NAME, Malformed, chunk_meta, frames, lookup_query, pb, pb_grpc,
                                     service_handler, stats_message, status_for)
from tiercache.record import encoding
from tiercache.record.keys import ChunkKey, validate_key, validate_namespace
from tiercache.server.auth import Tenant, TenantTable
from tiercache.server.leases import LeaseTable
from tiercache.server.metrics import Metrics
from tiercache.store.tiered import TieredStore
from tiercache.tiers.arena import payload_ranges

log = logging.getLogger(__name__)


def _rpc(method):
    """Authenticate the caller, time the RPC, and map every error it raises to a status code in one place.

    The wrapped method receives the caller's Tenant as a third argument.
    """
    name = method.__name__
    streaming = inspect.isgeneratorfunction(method)

    def finish(self, context, started: float, error: BaseException | None) -> None:
        code = grpc.StatusCode.OK if error is None else status_for(error)
        self.metrics.rpc_seconds.labels(name, code.name).observe(time.perf_counter() - started)
        if error is None:
            return
        if code == grpc.StatusCode.INTERNAL:
            log.exception("%s failed", name, exc_info=error)
            context.abort(code, f"internal error in {name}")
        context.abort(code, str(error))

    if streaming:
        @functools.wraps(method)
        def stream_handler(self, request, context):
            started = time.perf_counter()
            try:
                tenant = self.tenants.authenticate(context.invocation_metadata())
                yield from method(self, _well_formed(request), context, tenant)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status code
                finish(self, context, started, exc)
            else:
                finish(self, context, started, None)
        return stream_handler

    @functools.wraps(method)
    def unary_handler(self, request, context):
        started = time.perf_counter()
        try:
            tenant = self.tenants.authenticate(context.invocation_metadata())
            response = method(self, _well_formed(request), context, tenant)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            finish(self, context, started, exc)
        finish(self, context, started, None)
        return response
    return unary_handler


def _well_formed(request):
    """The request, or InvalidArgument when its bytes did not decode; a request stream is checked frame by frame."""
    if isinstance(request, Malformed):
        request.reject()
    if isinstance(request, Message):
        return request
    return (frame.reject() if isinstance(frame, Malformed) else frame for frame in request)


class _ChunkAssembler:
    """Collects one Put chunk's frames directly into the record buffer the store will keep (no join copy)."""

    def __init__(self, header: pb.ChunkHeader, max_chunk_bytes: int, tenant: Tenant) -> None:
        if header.size_bytes > max_chunk_bytes:
            raise InvalidArgument(f"chunk of {header.size_bytes} bytes exceeds the maximum of {max_chunk_bytes}")
        self.key = ChunkKey.checked(header.namespace, header.key)
        tenant.check_namespace(self.key.namespace)
        self.meta = chunk_meta(header)
        self.start = encoding.header_bytes(self.key, self.meta)
        self.record = bytearray(self.start + header.size_bytes)
        self.filled = self.start

    @property
    def complete(self) -> bool:
        return self.filled == len(self.record)

    def add(self, data: bytes) -> None:
        end = self.filled + len(data)
        if end > len(self.record):
            raise InvalidArgument(f"frames exceed the announced size of {len(self.record) - self.start} bytes")
        self.record[self.filled:end] = data
        self.filled = end

    def sealed(self) -> bytearray:
        encoding.seal(self.record, self.key, self.meta)
        return self.record


class _StoreChain:
    """The store seen by the Lookup search (tiercache.prefix.lookup.ChainIndex), in one namespace or in every
    tensor-parallel rank's: an object counts only when each rank holds its shard; the directory is the first's."""

    def __init__(self, store: TieredStore, namespaces: list[str]) -> None:
        self.store = store
        self.namespaces = namespaces

    def locate(self, keys):
        where = self.store.locate([ChunkKey(self.namespaces[0], k) for k in keys])
        for namespace in self.namespaces[1:]:
            other = self.store.locate([ChunkKey(namespace, k) for k in keys])
            where = [tier if also else None for tier, also in zip(where, other)]
        return where

    def children(self, parent: bytes):
        return [(key.key, meta) for key, meta in self.store.children(ChunkKey(self.namespaces[0], parent))]


def _chunk_keys(tenant: Tenant, namespace: str, keys: Iterable[bytes]) -> list[ChunkKey]:
    _namespace(tenant, namespace)  # once per request, not per key
    return [ChunkKey(namespace, validate_key(k)) for k in keys]


def _namespace(tenant: Tenant, namespace: str) -> str:
    validate_namespace(namespace)
    tenant.check_namespace(namespace)
    return namespace


class TierCacheServicer(pb_grpc.TierCacheServicer):
    def __init__(self, store: TieredStore, config: Config, metrics: Metrics, leases: LeaseTable,
                 tenants: TenantTable) -> None:
        self.store = store
        self.tenants = tenants
        self.metrics = metrics
        self.leases = leases
        self._max_chunk_bytes = config.server.max_chunk_bytes
        self._frame_bytes = config.server.frame_bytes
        self._started = time.monotonic()

    def _check_quota(self, tenant: Tenant, size_bytes: int) -> None:
        """Checked per chunk before it is stored; concurrent puts of one tenant may overshoot by their own sizes."""
        if tenant.quota_bytes is not None:
            tenant.check_quota(self.store.held_bytes(tenant.owns), size_bytes)

    @_rpc
    def Put(self, request_iterator: Iterator[pb.PutFrame], context, tenant: Tenant) -> pb.PutResponse:
        stored_in = []
        current: _ChunkAssembler | None = None
        for frame in request_iterator:
            part = frame.WhichOneof("part")
            if part == "header":
                if current is not None:
                    raise InvalidArgument("a chunk header arrived before the previous chunk's data was complete")
                current = _ChunkAssembler(frame.header, self._max_chunk_bytes, tenant)
                self._check_quota(tenant, frame.header.size_bytes)
            elif part == "data":
                if current is None:
                    raise InvalidArgument("a data frame arrived before any chunk header")
                current.add(frame.data)
            else:
                raise InvalidArgument("empty Put frame")
            if current is not None and current.complete:
                stored_in.append(self.store.put_record(current.key, current.sealed()))
                current = None
        if current is not None:
            raise InvalidArgument(f"stream ended after {current.filled - current.start} of "
                                  f"{len(current.record) - current.start} announced bytes")
        return pb.PutResponse(stored_in=stored_in)

    @_rpc
    def Get(self, request: pb.GetRequest, context, tenant: Tenant) -> Iterator[pb.GetFrame]:
        keys = _chunk_keys(tenant, request.namespace, request.keys)
        for index, key in enumerate(keys):
            found = self.store.get(key)
            if found is None:
                yield pb.GetFrame(header=pb.GetHeader(index=index, found=False))
                continue
            yield pb.GetFrame(header=pb.GetHeader(index=index, found=True, size_bytes=len(found.payload),
                                                  tier=found.tier))
            for data in frames(found.payload, self._frame_bytes):
                yield pb.GetFrame(data=data)

    @_rpc
    def Exists(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.ExistsResponse:
        where = self.store.locate(_chunk_keys(tenant, request.namespace, request.keys))
        return pb.ExistsResponse(tier=[w or "" for w in where])

    @_rpc
    def Delete(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.DeleteResponse:
        return pb.DeleteResponse(deleted=self.store.delete(_chunk_keys(tenant, request.namespace, request.keys)))

    @_rpc
    def ReportLookup(self, request: pb.LookupReport, context, tenant: Tenant) -> pb.LookupReportAck:
        _namespace(tenant, request.namespace)
        hit = dict(request.hit_tokens_by_tier)
        if sum(hit.values()) > request.requested_tokens:
            raise InvalidArgument("a lookup cannot hit more tokens than it requested")
        self.store.record_lookup(request.requested_tokens, hit)
        return pb.LookupReportAck()

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context, tenant: Tenant) -> pb.LookupResponse:
        namespaces = [_namespace(tenant, ns) for ns in (request.namespace, *request.rank_namespaces)]
        query = lookup_query(request)
        found = find_hit(query, _StoreChain(self.store, namespaces))
        if found.checkpoints:  # the load that follows promotes the kv chunks; their demotions must not evict these
            self.store.touch([ChunkKey(ns, key) for ns in namespaces for key in found.checkpoints])
        if request.report and not found.unverified:  # a lookup with unverified positions is asked again
            self.store.record_lookup(query.prompt_tokens, found.tokens_by_tier())
        tiers = found.tiers
        names = sorted(set(tiers))
        index = {name: i for i, name in enumerate(names)}
        return pb.LookupResponse(hit_tokens=found.tokens, tier_names=names,
                                 tiers=bytes(index[tier] for tier in tiers), unverified=found.unverified,
                                 chain_chunks=found.chain_chunks)

    # -- the same-host path (store.same_host) ----------------------------------------------------------------------

    @_rpc
    def Attach(self, request: pb.AttachRequest, context, tenant: Tenant) -> pb.AttachResponse:
        tier = self.store.shared_tier
        if tier is None or not tenant.same_host:  # not an error: the client falls back to streaming over gRPC
            return pb.AttachResponse(available=False)
        return pb.AttachResponse(available=True, path=tier.shared_path, size_bytes=tier.shared_bytes,
                                 inode=tier.shared_inode, lease_ttl_s=self.leases.ttl_s)

    @_rpc
    def Reserve(self, request: pb.ReserveRequest, context, tenant: Tenant) -> pb.ReserveResponse:
        if self.store.shared_tier is None:
            raise InvalidArgument("this server has no shared-memory arena: use Put")
        tenant.check_same_host()
        granted = []  # (lease id, reservation)
        try:
            for header in request.chunks:
                if header.size_bytes > self._max_chunk_bytes:
                    raise InvalidArgument(f"chunk of {header.size_bytes} bytes exceeds the maximum of "
                                          f"{self._max_chunk_bytes}")
                key = ChunkKey.checked(request.namespace, header.key)
                tenant.check_namespace(key.namespace)
                self._check_quota(tenant, header.size_bytes)
                meta = chunk_meta(header)
                reservation = self.store.reserve(key, encoding.header_bytes(key, meta) + header.size_bytes, meta)
                granted.append((self.leases.grant(reservation, self.store.abort, writable=True), reservation))
        except Exception:
            self.leases.release([lease_id for lease_id, _ in granted], writable=True)
            raise
        return pb.ReserveResponse(reservations=[
            pb.Reservation(lease_id=lease_id, payload=_pb_ranges(payload_ranges(r.key, r.meta, r.ranges)))
            for lease_id, r in granted])

    @_rpc
    def Commit(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.PutResponse:
        tenant.check_same_host()
        return pb.PutResponse(stored_in=[self.store.commit(self.leases.take(i, writable=True))
                                         for i in request.lease_ids])

    @_rpc
    def Abort(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.LeaseAck:
        tenant.check_same_host()
        self.leases.release(request.lease_ids, writable=True)
        return pb.LeaseAck()

    @_rpc
    def Acquire(self, request: pb.KeysRequest, context, tenant: Tenant) -> pb.AcquireResponse:
        tier = self.store.shared_tier
        if tier is None:
            raise InvalidArgument("this server has no shared-memory arena: use Get")
        tenant.check_same_host()
        leases = []
        for key in _chunk_keys(tenant, request.namespace, request.keys):
            found = self.store.lease(key)
            if found is None:
                leases.append(pb.Lease(found=False))
                continue
            pinned, where = found
            if pinned is None:
                leases.append(pb.Lease(found=True, leased=False, tier=where))
                continue
            lease_id = self.leases.grant(pinned, tier.unpin, writable=False)
            payload = payload_ranges(key, pinned.meta, pinned.ranges)
            leases.append(pb.Lease(found=True, leased=True, lease_id=lease_id, tier=where,
                                   size_bytes=sum(n for _, n in payload), payload=_pb_ranges(payload)))
        return pb.AcquireResponse(leases=leases)

    @_rpc
    def Release(self, request: pb.LeaseIds, context, tenant: Tenant) -> pb.LeaseAck:
        tenant.check_same_host()
        return pb.LeaseAck(expired=self.leases.release(request.lease_ids, writable=False))

    @_rpc
    def Stats(self, request: pb.StatsRequest, context, tenant: Tenant) -> pb.StatsResponse:
        stats = self.store.stats()
        if not tenant.admin:  # namespaces name models: a tenant sees its own only
            own = tuple(n for n in stats.namespaces if tenant.owns(n.namespace))
            stats = dataclasses.replace(stats, namespaces=own)
        return stats_message(stats, version=__version__, uptime_s=time.monotonic() - self._started,
                             max_chunk_bytes=self._max_chunk_bytes)


def _pb_ranges(ranges) -> list:
    return [pb.Range(offset=o, length=n) for o, n in ranges]


def _grpc_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    # grpc's default 4 MiB receive limit would reject a client that sends a whole chunk in one frame.
    limit = max_chunk_bytes + (1 << 20)
    # grpc sets SO_REUSEPORT by default: a second server on the same port would silently share its traffic.
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port (None: plaintext); with a client CA, clients must present certificates."""
    if not security.tls:
        return None
    cert, key = _read_pem(security.tls_cert_file), _read_pem(security.tls_key_file)
    client_ca = _read_pem(security.tls_client_ca_file) if security.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _read_pem(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind one address; the bound port (a unix socket gives 1), or a ConfigError saying why not."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:
        port = 0
    if not port:
        raise ConfigError(f"cannot listen on {address.removeprefix('unix:')} (address in use or not available)")
    return port


class CacheServer:
    """A running tiercache server: the store, the gRPC service with health checking, and the metrics endpoint."""

    def __init__(self, config: Config, store: TieredStore | None = None) -> None:
        self.config = config
        self.store = store or TieredStore.from_config(config)
        self.metrics = Metrics(self.store)
        self.leases = LeaseTable(config.server.lease_ttl_s)
        self.tenants = TenantTable.load(config.security.tenants_file)
        self._server: grpc.Server | None = None
        self._health_server: grpc.Server | None = None
        self._health = health.HealthServicer()
        self._stopped = threading.Event()
        self.port = 0
        self.health_port: int | None = None
        self.metrics_port: int | None = None

    def start(self) -> "CacheServer":
        cfg = self.config.server
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tiercache-rpc"),
                             options=_grpc_options(cfg.max_chunk_bytes))
        servicer = TierCacheServicer(self.store, self.config, self.metrics, self.leases, self.tenants)
        server.add_generic_rpc_handlers((service_handler(servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        credentials = server_credentials(self.config.security)
        self.port = _listen(server, _address(cfg.host, cfg.port), credentials)
        if cfg.unix_socket:
            # Only local processes reach a unix socket (file permissions guard it); tokens are still checked.
            _listen(server, f"unix:{cfg.unix_socket}", None)
        health_port = self.config.security.health_port
        if health_port is not None:
            self._health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                              options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = _listen(self._health_server, _address(cfg.host, health_port), None)
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
            except OSError as exc:
                raise ConfigError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: "
                                  f"{exc.strerror}") from None
        server.start()
        self._server = server
        if self._health_server is not None:
            self._health_server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    @property
    def url(self) -> str:
        host = self.config.server.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("localhost" if host == "::" else host)
        return f"{'grpcs' if self.config.security.tls else 'grpc'}://{host}:{self.port}"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting RPCs, let running ones finish within `grace_s`, then close the tiers."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        self.metrics.close()
        self.leases.close()  # takes back every reservation and read pin before the arena goes away
        self.store.close()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
