"""The server's shared-memory arena mapped into a client (the same-host data path's client half).

It proves it is the server's very file by its inode; payloads are copied in place, gRPC carries control only. The
copies go through numpy, which lets go of the GIL while it copies (a memoryview slice assignment holds it): an
engine's connector copies on a background thread while the engine's own thread runs its forward pass and needs the
GIL between kernels."""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import numpy as np

from tiercache.errors import InvalidArgument


class SharedArena:
    """The server's arena, mapped into a client. Raises OSError when this host cannot see that very file."""

    def __init__(self, path: str, size: int, inode: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_ino != inode:
                raise OSError(f"{path} is not the server's arena (another host or namespace)")
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # the same memory, for copies without the GIL
        self.path = path
        self.batch_bytes = max(size // 4, 1)  # reserve at most a quarter of the arena per round trip

    def write(self, ranges: Sequence[tuple[int, int]], payload: memoryview) -> None:
        source = np.frombuffer(payload, dtype=np.uint8)
        done = 0
        for offset, n in ranges:
            self._bytes[offset:offset + n] = source[done:done + n]
            done += n
        if done != source.size:
            raise InvalidArgument(f"ranges hold {done} bytes, the payload has {source.size}")

    def read(self, ranges: Sequence[tuple[int, int]], size: int, out: memoryview | None = None):
        """Copy a leased payload out: into `out` when given (returns the filled view), else into new bytes."""
        if out is None:
            if len(ranges) == 1:
                offset, n = ranges[0]
                return bytes(self._view[offset:offset + n])  # one copy, straight into the result
            return b"".join(self._view[offset:offset + n] for offset, n in ranges)
        if len(out) < size:
            raise InvalidArgument(f"a {len(out)}-byte buffer cannot hold a {size}-byte chunk")
        into = np.frombuffer(out, dtype=np.uint8)
        done = 0
        for offset, n in ranges:
            into[done:done + n] = self._bytes[offset:offset + n]
            done += n
        return out[:size]

    def close(self) -> None:
        del self._bytes  # (the map cannot close while an array exports it)
        self._view.release()
        self._map.close()
