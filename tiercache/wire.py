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
