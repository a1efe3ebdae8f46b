"""The foundation's acceptance scenarios, against `tiercache serve` as a subprocess. Slow: `make test-slow`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ServerProcess, python_env
from tiercache.client import Client

pytestmark = pytest.mark.slow

MiB = 1 << 20
CHUNK = 4 * MiB
_BASE = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)


def chunk_bytes(i: int) -> bytes:
    """A distinct 4 MiB payload per index, cheap to regenerate for comparison."""
    data = _BASE.copy()
    data[::4096] = np.uint8(i % 251)
    data[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return data.tobytes()


def key(i: int) -> bytes:
    return b"chunk-%06d" % i


def test_defaults_round_trip_1000_chunks_of_4mib(tmp_path):
    env = python_env()
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the default disk dir, kept out of the real home
    server = ServerProcess(env=env, scratch_disk=False).start()  # the embedded defaults, disk dir included
    try:
        with Client.from_url(server.url) as client:
            for i in range(1000):
                client.put("scenario", key(i), chunk_bytes(i))
            mismatches = [i for i in range(1000) if client.get("scenario", key(i)) != chunk_bytes(i)]
            stats = client.stats()
        assert mismatches == []
        assert (tmp_path / "cache" / "tiercache" / "chunks").is_dir()
        for tier in stats["tiers"]:
            assert tier["used_bytes"] <= tier["capacity_bytes"]
    finally:
        server.kill()


def test_2gib_through_256mib_host_and_1gib_disk_keeps_the_newest(tmp_path):
    server = ServerProcess("--host-mem", "256MiB", "--disk-size", "1GiB", "--disk-dir", str(tmp_path / "disk")).start()
    try:
        count = 2048 * MiB // CHUNK
        with Client.from_url(server.url) as client:
            for i in range(count):
                client.put("scenario", key(i), chunk_bytes(i))
            where = client.locate("scenario", [key(i) for i in range(count)])
            stats = json.loads(subprocess.run(
                [sys.executable, "-m", "tiercache", "stats", "--server", server.url, "--json"],
                capture_output=True, text=True, env=python_env(), check=True).stdout)
            tiers = {t["name"]: t for t in stats["tiers"]}
            held_host, held_disk = tiers["host"]["chunks"], tiers["disk"]["chunks"]
            # LRU: the oldest are gone, then a run on disk, then the newest in host memory.
            evicted = count - held_host - held_disk
            assert where == [None] * evicted + ["disk"] * held_disk + ["host"] * held_host
            assert evicted > 0 and held_host >= 60 and held_disk >= 250
            for tier in tiers.values():
                assert 0 < tier["used_bytes"] <= tier["capacity_bytes"]
            assert tiers["host"]["evictions"] == count - held_host
            for i in range(count - held_host - held_disk, count, 7):
                assert client.get("scenario", key(i)) == chunk_bytes(i), i
    finally:
        server.kill()
