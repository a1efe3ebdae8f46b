"""Helpers for the tests: tiercache servers on free ports, awaited for readiness, and polling with a deadline (both
shared with the lab: tiercache.process and testkit/polling.py). Redis servers and clusters are in
testkit/redis_processes.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

from testkit.polling import wait_for
from tiercache.process import ServerProcess, free_port

__all__ = ["ROOT", "ServerProcess", "free_port", "leaked_arenas", "python_env", "wait_for"]

ROOT = Path(__file__).resolve().parent.parent  # the checkout


@contextlib.contextmanager
def leaked_arenas() -> Iterator[list[str]]:
    """The host arenas (/dev/shm/tiercache-<pid>-*) that appeared inside the block and whose server is gone by its
    end: what a command that ran a server left behind. Servers of others (a user's, a concurrent test's) are alive
    or were there before, and are not counted."""
    from tiercache.tiers.host import _arenas

    before = {path for _, path in _arenas()}
    leaked: list[str] = []
    yield leaked
    for pid, path in _arenas():
        if path not in before and not Path(f"/proc/{pid}").exists():
            leaked.append(path)


def python_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str = "4m") -> Iterator[Path]:
    """A real tmpfs of `size` at `mount_point` (a full filesystem, a too small /dev/shm), unmounted afterwards; the
    test is skipped where this user may not mount (root may, as on our CI machines)."""
    import pytest

    mount_point.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
