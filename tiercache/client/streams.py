"""The gRPC streams path: payloads in `frame_bytes` frames of Put and Get streams, for servers without a data channel
(or one this client cannot reach). grpcio streams 1 MiB frames ~10x faster than one large message (docs/performance.md).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import grpc

from tiercache.client.payload import Chunk, Fetched
from tiercache.client.transport import call, time_left
from tiercache.errors import InvalidArgument, Unavailable
from tiercache.protocol.wire import chunk_header, error_of, frames, pb, pb_grpc


class StreamsPath:
    """A PayloadPath (client.payload) over the gRPC channel's Put and Get streams."""

    def __init__(self, stub: pb_grpc.TierCacheStub, frame_bytes: int) -> None:
        self._stub = stub
        self.frame_bytes = frame_bytes

    def put(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]:
        return list(call(self._stub.Put, self._frames(namespace, chunks), deadline).stored_in)

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            deadline: float) -> list[Fetched | None]:
        request = pb.GetRequest(namespace=namespace, keys=keys)
        try:  # a streamed answer fails while it is read, not when it is asked for
            streamed = _collect(self._stub.Get(request, timeout=time_left(deadline)), len(keys))
        except grpc.RpcError as exc:
            raise error_of(exc) from None
        return [None if item is None else Fetched(_deliver(item.data, out), item.tier)
                for item, out in zip(streamed, outs)]

    def close(self) -> None:
        pass  # the channel is the client's

    def _frames(self, namespace: str, chunks: Sequence[Chunk]) -> Iterator[pb.PutFrame]:
        for key, payload, meta in chunks:
            yield pb.PutFrame(header=chunk_header(namespace, key, len(payload), meta))
            for frame in frames(payload, self.frame_bytes):
                yield pb.PutFrame(data=frame)


def _collect(responses: Iterable[pb.GetFrame], count: int) -> list[Fetched | None]:
    """Each key's chunk from a Get stream: a header (the key's index, found or not), then its data frames."""
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


def _deliver(data: bytes, out: memoryview | None) -> bytes | memoryview:
    if out is None:
        return data
    if len(out) < len(data):
        raise InvalidArgument(f"a {len(out)}-byte buffer cannot hold a {len(data)}-byte chunk")
    out[:len(data)] = data
    return out[:len(data)]
