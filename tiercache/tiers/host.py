"""The host-memory tier: an ArenaTier over one mmap, in POSIX shared memory (/dev/shm) so that clients on the same
host can write and read chunks in place (tiercache.store.same_host), and page-locked for fast DMA when CUDA is present.

The shared-memory file is created with mode 0600 (only the server's user may map it) and unlinked when the tier
closes. Without a usable /dev/shm (none, or no permission) the arena is private memory and only the gRPC path exists.
Either way the arena is checked against the memory there is and committed in pieces before the server serves
(tiercache.tiers.memory).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import weakref
from typing import Callable, Sequence

from tiercache.config import HostTierConfig
from tiercache.errors import ConfigError
from tiercache.tiers import memory
from tiercache.tiers.arena import ArenaTier, MappedArenaTier
from tiercache.tiers.base import ArenaFile

log = logging.getLogger(__name__)


SHM_DIR = "/dev/shm"


class HostMemory:
    def __init__(self, size: int, shared: bool, cancelled: Callable[[], bool] | None = None) -> None:
        size = max(size, mmap.PAGESIZE)
        self.path: str | None = None
        self.inode: int | None = None
        self.size = size
        fd = self._shared_file(size) if shared else None
        try:
            self._arena = _map(fd, size)
            memory.commit(self._arena, fd, f"host tier ({self.path or 'private memory'})", cancelled)
        except BaseException:
            self._close_arena()
            raise
        finally:
            if fd is not None:
                os.close(fd)
        self._view = memoryview(self._arena)
        self._pinned = _pin(self._arena)

    def _shared_file(self, size: int) -> int | None:
        """A new file in /dev/shm, sized but not yet allocated (memory.commit does that); None where there is no
        usable /dev/shm."""
        _remove_stale_arenas()
        path = os.path.join(SHM_DIR, f"tiercache-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.warning("no shared-memory arena (%s); same-host clients will use gRPC", exc.strerror)
            return None
        self.path = path
        # Unlinked at close, at garbage collection or at interpreter exit, whichever comes first; a server killed
        # with SIGKILL leaves its file behind, and the next server on the host removes it (_remove_stale_arenas).
        self._unlink_file = weakref.finalize(self, _unlink_quietly, path)
        try:
            os.ftruncate(fd, size)
            self.inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _close_arena(self) -> None:
        arena = getattr(self, "_arena", None)
        if arena is not None:
            arena.close()
        if self.path is not None:
            self._unlink_file()

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
        self._close_arena()


def _map(fd: int | None, size: int) -> mmap.mmap:
    """The arena's address space (pages come in memory.commit)."""
    try:
        return mmap.mmap(-1, size) if fd is None else mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except OSError as exc:  # e.g. ENOMEM: the kernel will not even reserve the addresses
        raise ConfigError(f"cannot map a host tier of {size} bytes: {exc.strerror or exc}") from None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _arenas() -> list[tuple[int, str]]:
    """(server pid, path) of every tiercache arena in /dev/shm (named tiercache-<pid>-<random>)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    found = []
    for name in names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "tiercache" and parts[1].isdigit():
            found.append((int(parts[1]), os.path.join(SHM_DIR, name)))
    return found


def _remove_stale_arenas() -> None:
    """Delete arenas of tiercache servers that no longer run."""
    for pid, path in _arenas():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _unlink_quietly(path)
        except PermissionError:
            pass  # another user's live process


def remove_arenas_of(pid: int) -> int:
    """Delete the arenas of a server that was killed (SIGKILL runs no cleanup: process.ServerProcess.kill calls this
    once the process is reaped); how many there were."""
    paths = [path for owner, path in _arenas() if owner == pid]
    for path in paths:
        _unlink_quietly(path)
    return len(paths)


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


def arena_bytes(config: HostTierConfig) -> int:
    return config.capacity_bytes // config.page_bytes * config.page_bytes


def check_room(config: HostTierConfig) -> None:
    """Refuse (ConfigError) a host tier the machine cannot hold, before anything is allocated. Arenas of dead servers
    are removed first: their room in /dev/shm is ours to take."""
    if config.shared_memory:
        _remove_stale_arenas()
    memory.check_room(arena_bytes(config), SHM_DIR if config.shared_memory else None)


def host_tier(config: HostTierConfig, cancelled: Callable[[], bool] | None = None) -> ArenaTier:
    """The host tier, committed (see check_room for the checks to make before)."""
    memory = HostMemory(arena_bytes(config), config.shared_memory, cancelled)
    budgets = (config.capacity_bytes, config.page_bytes, config.state_budget_bytes, config.state_value_weight)
    if memory.path is None:  # private memory: no same-host path
        return ArenaTier("host", memory, *budgets)
    return MappedArenaTier("host", memory, ArenaFile(memory.path, memory.size, memory.inode), *budgets)
