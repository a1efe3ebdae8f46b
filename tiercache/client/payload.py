"""What a payload path is: one way chunk bytes travel between a client and the server, and the chunks it carries.

Three paths exist, one per transport: the server's shared-memory arena when the client is on its host
(client.arena_path), the data channel, a plain socket beside gRPC (client.data_channel), and gRPC streams
(client.streams). client.chooser decides which one carries each call; a new transport is a fourth implementation of
`PayloadPath` and one more case there.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from tiercache.errors import InvalidArgument
from tiercache.record.encoding import ChunkMeta


class Chunk(NamedTuple):
    """One chunk to put: its key, its bytes, and how the store should value it (KV by default)."""

    key: bytes
    data: object  # any bytes-like object; a path receives a flat memoryview of it
    meta: ChunkMeta = ChunkMeta()


def flat_bytes(data: object, what: str) -> memoryview:
    """`data` as the flat byte view a path takes, or InvalidArgument naming what it is (memoryview's TypeError said
    neither which argument nor what would do: tests/client/test_settings.py)."""
    try:
        return memoryview(data).cast("B")
    except TypeError:
        if isinstance(data, str):
            raise InvalidArgument(f"{what} must be bytes-like (bytes, bytearray, memoryview, an array), got str: "
                                  f"encode it first") from None
        raise InvalidArgument(f"{what} must be a contiguous bytes-like object (bytes, bytearray, memoryview, an "
                              f"array), got {type(data).__name__}") from None


class Fetched(NamedTuple):
    data: bytes | memoryview  # new bytes, or a view of the caller's buffer it was copied into
    tier: str  # the tier it was read from


class Elsewhere:
    """A path's answer for a key the server holds that this path could not bring (only the arena path gives it: the
    chunk could not be leased in the arena, or its lease lapsed while it was copied). Another path must ask again."""

    def __repr__(self) -> str:
        return "ELSEWHERE"


ELSEWHERE = Elsewhere()


class PayloadPath(Protocol):
    """The contract, for every path:
    - `put` stores a batch of chunks (keys checked, data flat memoryviews) and answers, per chunk, the tier that holds
      it; `get` answers, per key, a Fetched (into `outs[i]` when that is a buffer, else new bytes), None for a miss,
      or ELSEWHERE. A buffer too small for its chunk is InvalidArgument.
    - One call is one try that ends by `deadline` (time.monotonic()); the client's call path retries what is
      transient (tiercache.errors). Every call is idempotent: a retry of a put or get that half happened is harmless.
    - Failures are tiercache errors: ConnectFailed when the path cannot be opened at all, Busy when the server's end
      of it is at its limits (the chooser then takes another path), anything else as the server answered.
    - Paths are thread-safe; `close` ends what they hold (connections, mappings, threads)."""

    def put(self, namespace: str, chunks: Sequence[Chunk], deadline: float) -> list[str]: ...

    def get(self, namespace: str, keys: Sequence[bytes], outs: Sequence[memoryview | None],
            deadline: float) -> list[Fetched | Elsewhere | None]: ...

    def close(self) -> None: ...
