"""What `tiercache serve` does before it serves: one server per disk directory, a host tier checked against
the memory there is, committed in pieces with progress in the log, and a SIGTERM during that obeyed at once. Real
server processes, a real tmpfs where one is needed; nothing here allocates more than 64 MiB."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, mounted_tmpfs, python_env, wait_for
from tiercache.client import Client
from tiercache.config import MiB
from tiercache.errors import ConfigError, StartCancelled
from tiercache.tiers import memory
from tiercache.tiers.host import SHM_DIR, HostMemory


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, env=python_env())


def _disk_server(disk: Path, size: str = "16MiB") -> ServerProcess:
    return ServerProcess("--host-mem", "0", "--disk-dir", str(disk), "--disk-size", size)


def _chunks(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.chunk"))


# -- one server per disk directory ------------------------------------------------------------------------------------

def test_a_second_server_on_a_disk_directory_in_use_is_refused_and_the_first_loses_nothing(tmp_path):
    # Before: the second server (smaller cap) deleted most of the first's files at start, and the first kept
    # counting them while its reads missed.
    disk = tmp_path / "disk"
    first = _disk_server(disk).start()
    try:
        payloads = {b"k%d" % i: bytes([i]) * 100_000 for i in range(20)}
        with Client.from_url(first.url) as client:
            assert {client.put("ns", k, v) for k, v in payloads.items()} == {"disk"}
        files = _chunks(disk)
        assert len(files) == 20
        second = run_serve("--host-mem", "0", "--disk-dir", str(disk), "--disk-size", "1MiB")
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"{disk} is in use by another tiercache server (pid {first.process.pid})" in lines[0]
        assert "--disk-dir" in lines[0]
        assert _chunks(disk) == files
        with Client.from_url(first.url) as client:
            assert [client.get("ns", k) for k in payloads] == list(payloads.values())
    finally:
        first.kill()


def test_a_disk_dir_that_names_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    # Before: "disk tier directory ... is not usable: File exists", which did not say the path was a file.
    kept = tmp_path / "notes.txt"
    kept.write_text("the user's own file")
    for disk, culprit in ((kept, ""), (kept / "chunks", f": {kept}")):
        result = run_serve("--host-mem", "8MiB", "--disk-dir", str(disk))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"tiercache serve: error: disk tier directory {disk}{culprit} is a file, not a directory "
            f"(--disk-dir, disk.path)"], result.stderr  # one line: no host tier was committed before it
    assert kept.read_text() == "the user's own file"


def test_the_lock_goes_with_the_server_that_held_it(tmp_path):
    """A graceful stop releases the directory; so does a SIGKILL (the kernel drops the lock): a restart finds every
    chunk either way."""
    disk = tmp_path / "disk"
    with _disk_server(disk) as first, Client.from_url(first.url) as client:
        client.put("ns", b"k", b"kept")
        code, _ = first.terminate()
        assert code == 0
    with _disk_server(disk) as restarted:
        with Client.from_url(restarted.url) as client:
            assert client.get("ns", b"k") == b"kept"
        restarted.process.kill()
        restarted.process.wait()
    with _disk_server(disk) as again, Client.from_url(again.url) as client:
        assert client.get("ns", b"k") == b"kept"


# -- the host tier's room -------------------------------------------------------------------------------------------

def test_a_host_tier_larger_than_the_memory_is_one_line_and_exit_2():
    # Before: a 30-line traceback (OSError: [Errno 12]) and exit 1.
    result = run_serve("--host-mem", "64TiB", "--disk-size", "0")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit" in lines[0] and "--host-mem" in lines[0], result.stderr
    assert "64.0 TiB" in lines[0]


@pytest.mark.parametrize("flags, flag", [(["--host", "192.0.2.1"], "--host"),
                                         (["--metrics-port", "0", "--metrics-host", "192.0.2.1"], "--metrics-host")])
def test_an_address_that_is_not_this_machines_is_refused_before_the_host_tier_is_committed(flags, flag):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): documentation only, no machine's address. Before, with --port 0 nothing
    # checked the host: the host tier was committed (a log line per step, seconds per GiB), and then the data
    # channel's bind failed, blamed on the data channel.
    result = run_serve("--host-mem", "64MiB", "--disk-size", "0", *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "committing" not in result.stderr, result.stderr
    assert lines[0].startswith("tiercache serve: error: cannot listen on 192.0.2.1 for ") and f"({flag})" in lines[0]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 4 MiB tmpfs, a /dev/shm too small for the arenas below."""
    with mounted_tmpfs(tmp_path / "shm") as mount_point:
        yield mount_point


def test_a_host_tier_larger_than_dev_shm_is_refused_with_what_to_do(small_tmpfs):
    memory.check_room(2 * MiB, str(small_tmpfs))  # fits
    with pytest.raises(ConfigError, match=r"does not fit in .*shm: 4.0 MiB free; enlarge it .*--shm-size.*"
                                          r"host.shared_memory: false"):
        memory.check_room(8 * MiB, str(small_tmpfs))


def test_memory_that_is_not_there_after_all_is_a_clear_error(small_tmpfs):
    """The check passed, then something else took the room: the commit fails with the reason, not SIGBUS later."""
    fd = os.open(small_tmpfs / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 8 * MiB)
        with mmap.mmap(fd, 8 * MiB, flags=mmap.MAP_SHARED) as arena:
            with pytest.raises(ConfigError, match="cannot commit the arena of 8.0 MiB .*No space left on device"):
                memory.commit(arena, fd, "the arena")
    finally:
        os.close(fd)


def test_a_cancelled_commit_leaves_no_arena_behind():
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(StartCancelled, match="stopped while committing"):
        HostMemory(4 * MiB, shared=True, cancelled=lambda: True)
    assert not {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith(f"tiercache-{os.getpid()}-")}


# -- SIGTERM while the host tier is committed -------------------------------------------------------------------------

# `tiercache serve` with one step made slow on purpose, in a real process: the host arena is committed in 1 MiB pieces,
# each after the first waits until a stop request (SIGTERM) is pending, and every piece logs its progress. So the
# signal always lands mid-preparation, without an arena of gigabytes; a server that went on would commit the rest at
# once after the signal and serve.
_SLOW_SERVE = """
import signal, sys, time
# Blocked first, as `tiercache serve` does before it imports what starts threads (numpy's BLAS pool, here).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
from tiercache import cli
from tiercache.tiers import memory

real_piece = memory.commit_piece

def piece_after_a_stop_request(arena, fd, offset, length):
    while offset and not signal.sigpending():
        time.sleep(0.01)
    real_piece(arena, fd, offset, length)

memory.PIECE_BYTES = 1 << 20
memory.PROGRESS_EVERY_S = 0
memory.commit_piece = piece_after_a_stop_request
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("shared", [True, False])
def test_sigterm_while_the_host_tier_is_committed_stops_the_server(tmp_path, shared):
    config = tmp_path / "tiercache.yaml"
    config.write_text(f"host:\n  shared_memory: {str(shared).lower()}\n")
    with tempfile.TemporaryFile("a+") as output:  # appended to: reading it here moves the offset the server shares
        process = subprocess.Popen([sys.executable, "-c", _SLOW_SERVE, "serve", "--port", "0", "--config", str(config),
                                    "--host-mem", "64MiB", "--disk-size", "0"],
                                   stdout=output, stderr=subprocess.STDOUT, text=True, env=python_env())

        def log() -> str:
            output.seek(0)
            return output.read()

        try:
            wait_for(lambda: "1.0 MiB of 64.0 MiB committed" in log() or process.poll() is not None, timeout_s=60,
                     what="the first piece of the host tier")
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        text = log()
    assert code == 0, text
    assert "committing 64.0 MiB" in text
    assert "SIGTERM: stopped while committing host tier" in text and "exiting without serving" in text, text
    assert "serving on" not in text
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"tiercache-{process.pid}-")]
