"""The host tier's memory at start: whether an arena of a given size fits (RAM, the cgroup's limit, /dev/shm), and
committing it in pieces, with progress in the log and a way to stop.

The arena is committed before the server serves: every page is allocated (posix_fallocate in /dev/shm, so a tmpfs
that is too small fails here rather than with SIGBUS on a later write) and mapped (MADV_POPULATE_WRITE), because a
first touch costs a page fault per 4 KiB (1-2 GB/s against ~12 GB/s into mapped memory on our machines). Done in
one call this took over 3 minutes for 20 GiB on a 23 GiB machine, printed nothing and ignored SIGTERM until done, and
`--host-mem 100GiB` ended in a 30-line `OSError: [Errno 12]` traceback. So the size is checked first, with one line
naming what does not fit, and the commit goes in pieces of `PIECE_BYTES`: a progress line every few seconds, and
`cancelled()` asked between pieces (tests/server/test_startup.py).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from typing import Callable

from tiercache.config import MiB, format_size
from tiercache.errors import ConfigError, StartCancelled

log = logging.getLogger(__name__)

PIECE_BYTES = 128 * MiB  # ~0.1 s of work: a stop request waits no longer than that
PROGRESS_EVERY_S = 5.0
# Linux's value (linux/mman.h, kernel 5.14+); Python's mmap module names it only from 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_WHAT = "host tier of {size} (--host-mem, host.capacity_bytes)"


def check_room(size: int, shm_dir: str | None) -> None:
    """ConfigError, in one line, if `size` bytes cannot be committed now: more than the memory available
    (MemAvailable), than the cgroup's memory limit, or than `shm_dir` has free (when given)."""
    what = _WHAT.format(size=format_size(size))
    meminfo = _meminfo()
    if "MemAvailable" in meminfo and size > meminfo["MemAvailable"]:
        raise ConfigError(f"{what} does not fit in memory: {format_size(meminfo['MemAvailable'])} available of "
                          f"{format_size(meminfo.get('MemTotal', 0))}; lower --host-mem")
    limit = _cgroup_limit()
    if limit is not None and size > limit:
        raise ConfigError(f"{what} does not fit in this container's memory limit ({format_size(limit)}); lower "
                          f"--host-mem or raise the limit")
    if shm_dir is not None:
        try:
            fs = os.statvfs(shm_dir)
        except OSError:
            return  # no /dev/shm: the arena will be private memory (HostMemory logs it)
        free = fs.f_bavail * fs.f_frsize
        if size > free:
            raise ConfigError(f"{what} does not fit in {shm_dir}: {format_size(free)} free; enlarge it (docker run "
                              f"--shm-size, or --ipc=host), lower --host-mem, or set host.shared_memory: false")


def commit(arena: mmap.mmap, fd: int | None, label: str, cancelled: Callable[[], bool] | None = None) -> None:
    """Allocate (fd: a file in /dev/shm) and map every page of `arena`, piece by piece. Raises StartCancelled as soon
    as `cancelled()` is true between two pieces, ConfigError when the memory is not there after all."""
    size = len(arena)
    started = last = time.monotonic()
    log.info("%s: committing %s", label, format_size(size))
    for offset in range(0, size, PIECE_BYTES):
        if cancelled is not None and cancelled():
            raise StartCancelled(f"stopped while committing {label}, {format_size(offset)} of {format_size(size)} done")
        try:
            commit_piece(arena, fd, offset, min(PIECE_BYTES, size - offset))
        except OSError as exc:
            raise ConfigError(f"cannot commit {label} of {format_size(size)} ({format_size(offset)} done): "
                              f"{exc.strerror or exc}") from None
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S:
            done = offset + min(PIECE_BYTES, size - offset)
            log.info("%s: %s of %s committed (%.1f GB/s)", label, format_size(done), format_size(size),
                     done / (now - started) / 1e9)
            last = now
    log.info("%s: %s committed in %.1f s", label, format_size(size), time.monotonic() - started)


def commit_piece(arena: mmap.mmap, fd: int | None, offset: int, length: int) -> None:
    """One piece: its pages allocated in the file (if any) and mapped into this process."""
    if fd is not None:
        os.posix_fallocate(fd, offset, length)
    try:
        arena.madvise(MADV_POPULATE_WRITE, offset, length)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise  # ENOMEM, EFAULT (the pages are not there)
        _touch(arena, offset, length)  # a kernel before 5.14


def _touch(arena: mmap.mmap, offset: int, length: int) -> None:
    import numpy as np

    np.frombuffer(arena, np.uint8, count=length, offset=offset)[::mmap.PAGESIZE] = 0  # fresh pages: all zeros


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _cgroup_limit() -> int | None:
    """This process's cgroup v2 memory limit (memory.max); None without one. Only the limit, not what is used: the
    cgroup's page cache counts as used and is reclaimed on demand, so a check against it would refuse in vain."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        with open(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.max")) as f:
            limit = f.read().strip()
    except OSError:
        return None
    return int(limit) if limit.isdigit() else None  # "max": no limit
