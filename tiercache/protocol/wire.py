"""What crosses the network: generated protobuf types, gRPC statuses of errors, frames, limits, conversions.

Which status names which error is tiercache.errors.WIRE_CODES; the server aborts with `status_for`, the client raises
`error_of` (which also tells a status the server chose from one grpc made up because the server was not reached).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import grpc

from tiercache.errors import WIRE_CODES, ConnectFailed, ConnectionBroken, InvalidArgument, TierCacheError, wire_code
from tiercache.prefix.delivered import Delivered
from tiercache.prefix.hashes import HASH_BYTES, InsideChunk
from tiercache.prefix.layout import GroupKind
from tiercache.prefix.lookup import Query
from tiercache.prefix.objects import ChainShape
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, MAX_PARENT_BYTES, MAX_TOKEN_BYTES, ChunkMeta

try:
    from tiercache._proto import tiercache_pb2 as pb
    from tiercache._proto import tiercache_pb2_grpc as pb_grpc  # noqa: F401 - re-exported for server/client
except ImportError as exc:  # a checkout put on the path without being built (every build generates them: setup.py)
    raise ImportError("tiercache's protobuf stubs are missing: this tiercache is a checkout that was never built; "
                      "install it (`make install`, `pip install -e .`, or a wheel: README, 'Installing the "
                      "package elsewhere')") from exc

SERVICE_NAME = "tiercache.v1.TierCache"
# Trailing metadata on every error status the server chooses itself, so a client can tell "the server answered
# UNAVAILABLE" (reachable) from a connection that failed (grpc's own UNAVAILABLE): only the latter opens a breaker.
ANSWERED_BY_SERVER = "tiercache-answered"
AUTHORIZATION = "authorization"  # the bearer token's gRPC metadata key (lower case, as HTTP/2 requires)


def status_for(error: BaseException) -> grpc.StatusCode:
    row = wire_code(error)
    return grpc.StatusCode[row.grpc_status] if row else grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, message: str) -> TierCacheError:
    kind = next((row.error for row in WIRE_CODES if row.grpc_status == code.name), None)
    return kind(message) if kind else TierCacheError(f"{code.name}: {message}")


# How grpc begins the details of an UNAVAILABLE when no connection could be opened at all (refused, no such host, no
# such socket, a failed TLS handshake), as opposed to one that broke mid-call ("Socket closed", "Connection reset"):
# grpc gives both the same status, and only its text tells them apart (tests/client/test_settings.py).
_NOT_CONNECTED = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


def error_of(failure: grpc.RpcError) -> TierCacheError:
    """What a failed call raises in the client. An UNAVAILABLE the server did not mark as its own answer is grpc's:
    the server was not reached, ConnectFailed when no connection could be opened (with the reason only: grpc's text
    is a chain of its internals), else ConnectionBroken; a passed deadline is TimedOut."""
    code, message = failure.code(), failure.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and not _answered(failure):
        if message.startswith(_NOT_CONNECTED):  # "...; last error: UNKNOWN: ipv4:127.0.0.1:1: ...: Connection refused"
            return ConnectFailed(" ".join(message.rsplit(": ", 1)[-1].strip("[]").split()))
        return ConnectionBroken(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"deadline exceeded: {message}"
    return error_for(code, message)


def _answered(failure: grpc.RpcError) -> bool:
    try:
        return any(key == ANSWERED_BY_SERVER for key, _ in failure.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - errors raised before any call existed carry no metadata
        return False


def max_message_bytes(max_chunk_bytes: int) -> int:
    """gRPC's message limit for a peer taking chunks of up to max_chunk_bytes: grpcio's default 4 MiB would reject a
    client that sends a whole chunk in one message; one frame of headroom covers the header fields."""
    return max_chunk_bytes + (1 << 20)


def frames(payload: memoryview, frame_bytes: int) -> Iterator[bytes]:
    """Split a payload into data frames; grpcio streams 1 MiB frames ~10x faster than one big message."""
    for start in range(0, len(payload), frame_bytes):
        yield bytes(payload[start:start + frame_bytes])


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
                    "found_tokens_by_tier": dict(message.found_tokens_by_tier)},
        "delivered": vars(delivered(message.delivered)),
    }


def delivery_totals(totals: Delivered) -> pb.DeliveryTotals:
    return pb.DeliveryTotals(loads=totals.loads, loaded_tokens_by_tier=totals.loaded_tokens_by_tier,
                             failed_loads=totals.failed_loads, failed_load_tokens=totals.failed_load_tokens,
                             saves_dropped_by_reason=totals.saves_dropped_by_reason)


def delivered(message: pb.DeliveryTotals) -> Delivered:
    return Delivered(message.loads, dict(message.loaded_tokens_by_tier), message.failed_loads,
                     message.failed_load_tokens, dict(message.saves_dropped_by_reason))


def chunk_meta(header: pb.ChunkHeader) -> ChunkMeta:
    """A chunk header's meta as the client sent it (the server's intake checks it with `checked_meta`)."""
    return ChunkMeta(header.object_class, header.prefix_tokens, header.parent, header.tokens, header.engine_hash)


def chunk_header(namespace: str, key: bytes, size_bytes: int, meta: ChunkMeta) -> pb.ChunkHeader:
    """The header a client sends for a chunk (Put streams, Reserve)."""
    return pb.ChunkHeader(namespace=namespace, key=key, size_bytes=size_bytes, object_class=meta.object_class,
                          prefix_tokens=meta.prefix_tokens, parent=meta.parent, tokens=meta.tokens,
                          engine_hash=meta.engine_hash)


def checked_meta(meta: ChunkMeta) -> ChunkMeta:
    """A chunk's meta as a client sent it (over gRPC or the data channel), checked."""
    if meta.object_class not in (CLASS_KV, CLASS_STATE):
        raise InvalidArgument(f"unknown object class {meta.object_class}")
    if len(meta.parent) > MAX_PARENT_BYTES:
        raise InvalidArgument(f"a parent key is at most {MAX_PARENT_BYTES} bytes, got {len(meta.parent)}")
    if len(meta.tokens) % 4 or len(meta.tokens) > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"tokens are little-endian uint32, at most {MAX_TOKEN_BYTES} bytes, "
                              f"got {len(meta.tokens)} bytes")
    if not 0 <= meta.engine_hash < 1 << 64:
        raise InvalidArgument("an engine hash is 64 bits")
    return meta


_GROUP_KINDS = {GroupKind.FULL_ATTENTION: pb.GROUP_KIND_FULL_ATTENTION,
                GroupKind.SLIDING_WINDOW: pb.GROUP_KIND_SLIDING_WINDOW, GroupKind.RECURRENT: pb.GROUP_KIND_RECURRENT}
_KINDS_BY_WIRE = {wire: kind for kind, wire in _GROUP_KINDS.items()}
MAX_LOOKUP_POSITIONS = 65_536
MAX_LOOKUP_BOUNDARIES = 262_144  # 4 MiB of hashes: 4M tokens at N = 16 (a lookup's work is linear in it)
MAX_RANK_NAMESPACES = 256


def lookup_request(namespace: str, shape: ChainShape, prompt_tokens: int, boundaries: bytes,
                   positions: Mapping[int, bytes], rank_namespaces: Sequence[str] = (), report: bool = True,
                   last_chunk_tokens: bytes = b"", match_unit: int = 0, pod_id: str = "") -> pb.LookupRequest:
    groups = layer_groups(shape)
    return pb.LookupRequest(namespace=namespace, rank_namespaces=list(rank_namespaces),
                            chunk_tokens=shape.chunk_tokens, groups=groups, prompt_tokens=prompt_tokens,
                            boundaries=boundaries, report=report, last_chunk_tokens=last_chunk_tokens,
                            match_unit=match_unit, pod_id=pod_id,
                            positions=[pb.PositionHash(position=p, hash=h) for p, h in positions.items()])


def chain_shape(chunk_tokens: int, groups: Sequence[pb.LayerGroupShape]) -> ChainShape:
    """A layout's shape as a request names it (Lookup, RegisterPod); InvalidArgument for an unknown group kind."""
    kinds = []
    for group in groups:
        if group.kind not in _KINDS_BY_WIRE:
            raise InvalidArgument(f"unknown layer group kind {group.kind}")
        kinds.append(_KINDS_BY_WIRE[group.kind])
    windows = tuple(g.window if kind is GroupKind.SLIDING_WINDOW else None for g, kind in zip(groups, kinds))
    return ChainShape(chunk_tokens, tuple(kinds), windows)


def layer_groups(shape: ChainShape) -> list[pb.LayerGroupShape]:
    return [pb.LayerGroupShape(kind=_GROUP_KINDS[kind], window=window or 0)
            for kind, window in zip(shape.kinds, shape.windows)]


def lookup_query(request: pb.LookupRequest) -> Query:
    """The search's input from a request, checked (InvalidArgument on anything malformed)."""
    if len(request.positions) > MAX_LOOKUP_POSITIONS or len(request.rank_namespaces) > MAX_RANK_NAMESPACES:
        raise InvalidArgument("too many positions or rank namespaces in one lookup")
    if len(request.boundaries) % HASH_BYTES or len(request.boundaries) > MAX_LOOKUP_BOUNDARIES * HASH_BYTES:
        raise InvalidArgument(f"boundaries must be at most {MAX_LOOKUP_BOUNDARIES} {HASH_BYTES}-byte hashes")
    shape = chain_shape(request.chunk_tokens, request.groups)
    data = request.boundaries
    boundaries = [data[i:i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]
    last_chunk = None
    if request.last_chunk_tokens:
        u, n = request.match_unit, request.chunk_tokens
        tokens = request.last_chunk_tokens
        if not boundaries or u <= 0 or not n or n % u or len(tokens) % 4 or len(tokens) > 4 * n:
            raise InvalidArgument("last_chunk_tokens needs boundaries, a match unit dividing N, and at most N tokens")
        last_chunk = InsideChunk(boundaries[-1], tokens, u)
    return Query(shape, request.prompt_tokens, boundaries, {p.position: p.hash for p in request.positions},
                 last_chunk)
