"""One server per disk-tier directory: a lock file in the directory, held for the life of the tier.

Two servers on one directory destroy each other's chunks: each indexes the other's files, evicts them to fit its own
cap and never learns of the other's writes. The default directory (~/.cache/tiercache/chunks) is shared by every
`tiercache serve` a user starts, so this happened by accident: a second server with a smaller cap deleted 46 of the
first's 59 files at start, and the first went on reporting 59 chunks while its reads missed (a test in
tests/server/test_startup.py starts two real servers on one directory).

The lock is flock(2) on `<dir>/.tiercache.lock`: the kernel drops it when its holder exits, however it exits (SIGKILL,
the OOM killer), so a lock file left behind never blocks a restart. The file is never unlinked (a process waiting to
lock it could otherwise end up holding a file nobody else sees). It holds the holder's pid, for the message only.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

from tiercache.errors import ConfigError

LOCK_NAME = ".tiercache.lock"  # a dot name: the disk tier's index rebuild (*/*.chunk) never sees it


class DirectoryLock:
    """Held from construction until `release` (or until the object is collected, or the process ends)."""

    def __init__(self, directory: Path) -> None:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            who = ("this process" if holder == os.getpid() else
                   f"another tiercache server{f' (pid {holder})' if holder else ''}")
            raise ConfigError(f"disk tier directory {directory} is in use by {who}: give each server its own "
                              f"--disk-dir (disk.path)") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._close = weakref.finalize(self, os.close, fd)  # closing the descriptor releases the lock

    def release(self) -> None:
        self._close()


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote (None if it has not written it yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
