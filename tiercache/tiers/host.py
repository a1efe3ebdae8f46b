"""The host-memory tier: an ArenaTier over one mmap, in POSIX shared memory (/dev/shm) so that clients on the same
host can write and read chunks in place (tiercache.store.same_host), and page-locked for fast DMA when CUDA is present.

The shared-memory file is created with mode 0600 (only the server's user may map it), fully allocated up front with
posix_fallocate (a tmpfs that is too small fails here, at start, instead of raising SIGBUS on a write later), and
unlinked when the tier closes. Without a usable /dev/shm the arena is anonymous memory and only the gRPC path exists.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import weakref
from typing import Sequence

from tiercache.config import HostTierConfig
from tiercache.tiers.arena import ArenaTier

log = logging.getLogger(__name__)


SHM_DIR = "/dev/shm"


class HostMemory:
    def __init__(self, size: int, shared: bool) -> None:
        size = max(size, mmap.PAGESIZE)
        self.path: str | None = None
        self.inode: int | None = None
        if shared:
            self._arena = self._shared_arena(size)
        if self.path is None:
            self._arena = mmap.mmap(-1, size)
        self._view = memoryview(self._arena)
        self.size = size
        self._pinned = _pin(self._arena)

    def _shared_arena(self, size: int) -> mmap.mmap | None:
        _remove_stale_arenas()
        path = os.path.join(SHM_DIR, f"tiercache-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.warning("no shared-memory arena (%s); same-host clients will use gRPC", exc.strerror)
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            arena = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self.inode = os.fstat(fd).st_ino
        except OSError as exc:
            os.unlink(path)
            log.warning("cannot allocate %d bytes in %s (%s); same-host clients will use gRPC", size, SHM_DIR,
                        exc.strerror)
            return None
        finally:
            os.close(fd)
        self.path = path
        # Unlinked at close, at garbage collection or at interpreter exit, whichever comes first; a server killed
        # with SIGKILL leaves its file behind, and the next server on the host removes it (_remove_stale_arenas).
        self._unlink_file = weakref.finalize(self, _unlink_quietly, path)
        return arena

    def write(self, ranges: Sequence[tuple[int, int]], record: memoryview) -> None:
        done = 0
        for offset, n in ranges:
            self._view[offset:offset + n] = record[done:done + n]
            done += n

    def read(self, ranges: Sequence[tuple[int, int]], size: int) -> bytearray:
        out = bytearray(size)
        done = 0
        for offset, n in ranges:
            out[done:done + n] = self._view[offset:offset + n]
            done += n
        return out

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        return [self._view[offset:offset + n] for offset, n in ranges]

    def close(self) -> None:
        if self._pinned is not None:
            self._pinned()
        self._view.release()
        self._arena.close()
        if self.path is not None:
            self._unlink_file()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale_arenas() -> None:
    """Delete arenas of tiercache servers that no longer run (named tiercache-<pid>-<random>)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "tiercache" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            _unlink_quietly(os.path.join(SHM_DIR, name))
        except PermissionError:
            pass  # another user's live process


def _pin(arena: mmap.mmap):
    """Page-lock the arena with cudaHostRegister when torch sees a GPU, so device<->host copies are DMA at full
    speed; returns the matching unregister, or None. Skipped silently without CUDA (the usual case on CPU nodes)."""
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: don't pay ~150 MiB of RSS to import torch for nothing
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import numpy as np

    pointer = np.frombuffer(arena, dtype=np.uint8).ctypes.data  # the temporary view is gone by the next line
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(pointer, len(arena), 0) != 0:
        log.warning("could not page-lock the host arena; device copies will go through bounce buffers")
        return None
    return lambda: cudart.cudaHostUnregister(pointer)


def host_tier(config: HostTierConfig) -> ArenaTier:
    memory = HostMemory(config.capacity_bytes // config.page_bytes * config.page_bytes, config.shared_memory)
    return ArenaTier("host", memory, config.capacity_bytes, config.page_bytes, config.state_budget_bytes,
                     config.state_value_weight)
