"""`ServerProcess` (tiercache/process.py: the demo's, `bench cliff`'s and the tests' way to run `tiercache serve`)
leaves nothing behind however it ends the server: a graceful stop (the server unlinks its /dev/shm arena), or a
SIGKILL as a crash would (the arena is removed once the process is reaped). Before, `bench cliff --quick` left 1 GiB
in /dev/shm and the demo 512 MiB until a later server happened to reclaim it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ServerProcess, leaked_arenas
from tiercache.tiers.host import _arenas


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_server_leaves_no_arena_in_dev_shm(end):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm: the host arena is private memory")
    with leaked_arenas() as leaked:
        server = ServerProcess("--host-mem", "8MiB", "--disk-size", "0").start()
        pid = server.process.pid
        assert [path for owner, path in _arenas() if owner == pid], "the server made no arena to leave"
        getattr(server, end)()
        assert server.process.poll() is not None
    assert leaked == []
    assert not [path for owner, path in _arenas() if owner == pid]
