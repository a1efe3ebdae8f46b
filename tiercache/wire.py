"""What crosses the network: generated protobuf types, error <-> status mapping, frames, stats conversion.

The mapping between tiercache errors and gRPC status codes lives here and nowhere else; the server aborts with
`status_for`, the client raises `error_for`.
"""

from __future__ import annotations

from typing import Iterator

import grpc

from tiercache.errors import (CapacityExceeded, InvalidArgument, NotFound, PermissionDenied, TierCacheError,
                              Unauthenticated, Unavailable)
from tiercache.chunk import CLASS_KV, CLASS_STATE, ChunkMeta
from tiercache.store import StoreStats

try:
    from tiercache._proto import tiercache_pb2 as pb
    from tiercache._proto import tiercache_pb2_grpc as pb_grpc  # noqa: F401 - re-exported for server/client
except ImportError as exc:  # a clone where `make proto` has not run yet
    raise ImportError("tiercache's protobuf stubs are missing: run `make proto` (or `make install`)") from exc

SERVICE_NAME = "tiercache.v1.TierCache"

_STATUS_BY_ERROR: tuple[tuple[type[TierCacheError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (CapacityExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS_BY_ERROR:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, message: str) -> TierCacheError:
    for kind, known in _STATUS_BY_ERROR:
        if code == known:
            return kind(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"deadline exceeded: {message}")
    return TierCacheError(f"{code.name}: {message}")


def frames(payload: memoryview, frame_bytes: int) -> Iterator[bytes]:
    """Split a payload into data frames; grpcio streams 1 MiB frames ~10x faster than one big message."""
    for start in range(0, len(payload), frame_bytes):
        yield bytes(payload[start:start + frame_bytes])


def stats_message(stats: StoreStats, *, version: str, uptime_s: float, max_chunk_bytes: int) -> pb.StatsResponse:
    return pb.StatsResponse(
        version=version, uptime_s=uptime_s, max_chunk_bytes=max_chunk_bytes,
        tiers=[pb.TierStats(**vars(t)) for t in stats.tiers],
        namespaces=[pb.NamespaceStats(namespace=n.namespace, used_bytes=n.used_bytes, chunks=n.chunks)
                    for n in stats.namespaces],
        lookups=stats.lookups.lookups, requested_tokens=stats.lookups.requested_tokens,
        hit_tokens_by_tier=stats.lookups.hit_tokens_by_tier)


def stats_dict(message: pb.StatsResponse) -> dict:
    """The Stats response as plain data (what `Client.stats()` returns and `tiercache stats --json` prints)."""
    tier_fields = [f.name for f in pb.TierStats.DESCRIPTOR.fields]
    return {
        "version": message.version,
        "uptime_s": message.uptime_s,
        "max_chunk_bytes": message.max_chunk_bytes,
        "tiers": [{name: getattr(t, name) for name in tier_fields} for t in message.tiers],
        "namespaces": [{"namespace": n.namespace, "used_bytes": n.used_bytes, "chunks": n.chunks}
                       for n in message.namespaces],
        "lookups": {"lookups": message.lookups, "requested_tokens": message.requested_tokens,
                    "hit_tokens_by_tier": dict(message.hit_tokens_by_tier)},
    }


def chunk_meta(header: pb.ChunkHeader) -> ChunkMeta:
    if header.object_class not in (CLASS_KV, CLASS_STATE):
        raise InvalidArgument(f"unknown object class {header.object_class}")
    return ChunkMeta(header.object_class, header.prefix_tokens)


class Malformed:
    """A request whose bytes are not a valid message. The handler turns it into INVALID_ARGUMENT.

    (grpcio answers an exception in a deserializer with INTERNAL before any of our code runs; deserializing leniently
    and failing in the handler gives malformed input the status code it deserves, counted like any other error.)
    """

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def reject(self) -> None:
        raise InvalidArgument(f"request is not a valid {self.message_type} message: {self.error}")


def _lenient(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RuntimeWarning-as-error, ...: all malformed input
            return Malformed(message_class.DESCRIPTOR.name, exc)
    return deserialize


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handler(servicer) -> grpc.GenericRpcHandler:
    """The TierCache service's handlers, built from the proto descriptor like the generated code, but with lenient
    request deserializers (see Malformed)."""
    service = pb.DESCRIPTOR.services_by_name["TierCache"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=_lenient(request_class),
                                     response_serializer=response_class.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
