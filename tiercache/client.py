"""The Python client. Every call goes through `_call`, which owns the deadline, retries and error mapping.

All operations are idempotent (a put of the same key and bytes leaves the same state), so UNAVAILABLE is retried
for every call, with a short exponential backoff inside the call's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence, TypeVar
from urllib.parse import urlparse

import grpc

from tiercache.chunk import ChunkMeta
from tiercache.errors import InvalidArgument, TierCacheError, Unavailable
from tiercache.keys import validate_key, validate_namespace
from tiercache.wire import error_for, frames, pb, pb_grpc, stats_dict

T = TypeVar("T")
DEFAULT_FRAME_BYTES = 1 << 20
DEFAULT_MAX_CHUNK_BYTES = 64 << 20


class Chunk(NamedTuple):
    """One chunk to put: its key, its bytes, and how the store should value it (KV by default)."""

    key: bytes
    data: object  # any bytes-like object
    meta: ChunkMeta = ChunkMeta()


class Fetched(NamedTuple):
    data: bytes
    tier: str  # the tier it was read from


@dataclass(frozen=True)
class Retry:
    """How UNAVAILABLE is retried: `attempts` tries in all, sleeping backoff_s, 2*backoff_s, ... up to max_backoff_s."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def delays(self) -> Iterator[float]:
        delay = self.backoff_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_backoff_s)


class Client:
    def __init__(self, target: str, *, timeout_s: float = 30.0, retry: Retry = Retry(),
                 frame_bytes: int = DEFAULT_FRAME_BYTES, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
        limit = max_chunk_bytes + (1 << 20)
        self._channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
        self._stub = pb_grpc.TierCacheStub(self._channel)
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry
        self.frame_bytes = frame_bytes

    @classmethod
    def from_url(cls, url: str, **options) -> "Client":
        """`grpc://host:port` (or plain `host:port`)."""
        parsed = urlparse(url if "://" in url else f"grpc://{url}")
        if parsed.scheme != "grpc" or not parsed.hostname or not parsed.port:
            raise InvalidArgument(f"expected a URL like grpc://host:port, got {url!r}")
        host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
        return cls(f"{host}:{parsed.port}", **options)

    # -- the API ----------------------------------------------------------------------------------------------------

    def put(self, namespace: str, key: bytes, data, meta: ChunkMeta = ChunkMeta()) -> str:
        """Store `data` (any bytes-like object) under (namespace, key); returns the tier that holds it."""
        return self.put_many(namespace, [Chunk(key, data, meta)])[0]

    def put_many(self, namespace: str, chunks: Sequence[Chunk]) -> list[str]:
        """Store several chunks in one stream; returns, per chunk, the tier that holds it."""
        validate_namespace(namespace)
        views = [(validate_key(c.key), memoryview(c.data).cast("B"), c.meta) for c in chunks]
        if not views:
            return []

        def stream() -> Iterator[pb.PutFrame]:
            for key, payload, meta in views:
                yield pb.PutFrame(header=pb.ChunkHeader(
                    namespace=namespace, key=key, size_bytes=len(payload), object_class=meta.object_class,
                    prefix_tokens=meta.prefix_tokens))
                for frame in frames(payload, self.frame_bytes):
                    yield pb.PutFrame(data=frame)

        return list(self._call(lambda timeout: self._stub.Put(stream(), timeout=timeout)).stored_in)

    def get(self, namespace: str, key: bytes) -> bytes | None:
        return self.get_many(namespace, [key])[0]

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """One result per key, in order: the bytes, or None for a miss."""
        return [f.data if f is not None else None for f in self.fetch_many(namespace, keys)]

    def fetch_many(self, namespace: str, keys: Sequence[bytes]) -> list[Fetched | None]:
        """Like get_many, with the tier each chunk was read from."""
        request = pb.GetRequest(namespace=namespace, keys=self._checked(namespace, keys))
        return self._call(lambda timeout: _collect(self._stub.Get(request, timeout=timeout), len(keys)))

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

    def report_lookup(self, namespace: str, requested_tokens: int, hit_tokens_by_tier: Mapping[str, int]) -> None:
        """Tell the server how a prefix lookup went, for its metrics (`tiercache_lookup_*`) and stats."""
        request = pb.LookupReport(namespace=validate_namespace(namespace), requested_tokens=requested_tokens,
                                  hit_tokens_by_tier=dict(hit_tokens_by_tier))
        self._call(lambda timeout: self._stub.ReportLookup(request, timeout=timeout))

    def stats(self) -> dict:
        return stats_dict(self._call(lambda timeout: self._stub.Stats(pb.StatsRequest(), timeout=timeout)))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one path for every call ------------------------------------------------------------------------------------

    @staticmethod
    def _checked(namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        validate_namespace(namespace)
        return [validate_key(k) for k in keys]

    def _call(self, invoke: Callable[[float], T]) -> T:
        deadline = time.monotonic() + self.timeout_s
        delays = self.retry.delays()
        while True:
            try:
                return invoke(max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                error = error_for(exc.code(), exc.details() or "")
                delay = next(delays, None) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
                if delay is None or time.monotonic() + delay >= deadline:
                    raise error from None
                time.sleep(delay)


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


def _joined(parts: list[bytes], size: int) -> bytes:
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) != size:
        raise Unavailable(f"server sent {len(data)} bytes of a {size}-byte chunk")
    return data


__all__ = ["Chunk", "ChunkMeta", "Client", "Fetched", "Retry", "TierCacheError"]
