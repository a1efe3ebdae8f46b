"""Faults survived with real processes: Redis killed under 8 client threads, the server SIGKILLed mid-write and
restarted on its disk directory, a full disk, bit flips in disk files and Redis values, leases of crashed clients."""

from __future__ import annotations

import errno
import hashlib
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.helpers import mounted_tmpfs, wait_for
from tiercache.client import Client
from tiercache.client.retry import RetryPolicy
from tiercache.config import KiB, MiB
from tiercache.errors import CapacityExceeded, TierCacheError
from tiercache.process import ServerProcess
from tiercache.protocol.wire import pb

NS = "faults"


def _payload(key: bytes, size: int) -> bytes:
    """Bytes derived from the key, so any reader can tell right bytes from wrong ones."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_redis_killed_and_restarted_under_eight_client_threads(start_server, redis_proc):
    server = start_server(host_bytes=32 * MiB, disk_bytes=64 * MiB, redis_url=redis_proc.url, write_through=True)
    local = {b"local-%d" % i: _payload(b"local-%d" % i, 64 * KiB) for i in range(64)}
    with Client.from_url(server.url) as client:
        for key, value in local.items():
            client.put(NS, key, value)
    failures, wrong, calls = [], [], [0]
    stop = threading.Event()

    def worker(n: int) -> None:
        rng = random.Random(n)
        with Client.from_url(server.url, timeout_s=10, retry=RetryPolicy(attempts=1)) as client:
            while not stop.is_set():
                key = rng.choice(list(local))
                try:
                    if rng.random() < 0.3:
                        new = b"new-%d-%d" % (n, rng.randrange(1000))
                        client.put(NS, new, _payload(new, 16 * KiB))
                    elif client.get(NS, key) != local[key]:
                        wrong.append(key)
                except TierCacheError as exc:
                    failures.append(repr(exc))
                calls[0] += 1

    with ThreadPoolExecutor(max_workers=8) as pool:
        workers = [pool.submit(worker, n) for n in range(8)]

        def traffic(more: int) -> None:  # let the clients make `more` calls before the next step
            target = calls[0] + more  # (a worker that died stops waiting: its exception is raised below)
            wait_for(lambda: calls[0] >= target or any(w.done() for w in workers), timeout_s=60,
                     what=f"{more} more client calls")

        try:
            traffic(100)
            redis_proc.kill()
            traffic(300)  # under load while Redis is gone
            redis_proc.start()
            back = time.monotonic()
            with Client.from_url(server.url) as client:
                # The tier retries after its backoff (at most redis.max_backoff_s); the next write-through marks it up.
                def redis_up() -> bool:
                    client.put(NS, b"probe", b"p")
                    return next(t for t in client.stats()["tiers"] if t["name"] == "redis")["up"]
                wait_for(redis_up, timeout_s=10, what="redis tier up")
                rejoined = time.monotonic() - back
            traffic(100)
        finally:
            stop.set()  # leaving the pool joins the workers
    for w in workers:
        w.result()  # an exception in a client thread fails the test
    assert calls[0] > 100
    assert failures == [] and wrong == []
    assert rejoined < 5.0


def _durable_server(disk_dir, *extra: str) -> ServerProcess:
    # No host tier: every put lands on disk, fsynced before the ack (the put's answer says "disk").
    return ServerProcess("--host-mem", "0", "--disk-size", "512MiB", "--disk-dir", str(disk_dir), "--disk-fsync",
                         *extra)


def test_sigkill_mid_write_loses_no_acknowledged_durable_put(tmp_path):
    acknowledged: list[bytes] = []
    lock = threading.Lock()
    server = _durable_server(tmp_path / "disk").start()
    stop = threading.Event()

    def writer(n: int) -> None:
        with Client.from_url(server.url, timeout_s=5, retry=RetryPolicy(attempts=1)) as client:
            i = 0
            while not stop.is_set():
                key = b"w%d-%d" % (n, i)
                try:
                    where = client.put(NS, key, _payload(key, random.Random(i).choice([4 * KiB, 300 * KiB, 3 * MiB])))
                except TierCacheError:
                    return  # the server died under us
                assert where == "disk"
                with lock:
                    acknowledged.append(key)
                i += 1

    with ThreadPoolExecutor(max_workers=4) as pool:
        writers = [pool.submit(writer, n) for n in range(4)]
        try:  # (a writer that failed stops waiting: its exception is raised below)
            wait_for(lambda: len(acknowledged) >= 40 or any(w.done() and w.exception() for w in writers),
                     timeout_s=60, what="40 acknowledged puts")
        finally:
            server.kill()  # SIGKILL: no shutdown code runs
            stop.set()  # leaving the pool joins the writers
    for w in writers:
        w.result()  # a failed assertion (or any exception) in a writer thread fails the test
    with _durable_server(tmp_path / "disk") as restarted, Client.from_url(restarted.url) as client:
        for key in acknowledged:
            size = len(client.get(NS, key) or b"")
            assert size, f"acknowledged {key!r} lost"
            data = client.get(NS, key)
            assert data == _payload(key, len(data)), f"{key!r} came back with wrong bytes"
        stats = next(t for t in client.stats()["tiers"] if t["name"] == "disk")
        assert stats["chunks"] >= len(acknowledged)
    leftovers = [p for p in (tmp_path / "disk").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []  # torn writes were cleared at start


def test_full_disk_fails_the_disk_write_and_keeps_serving(start_server, monkeypatch):
    server = start_server(host_bytes=2 * MiB, disk_bytes=64 * MiB)
    disk = next(t for t in server.store.tiers if t.name == "disk")
    with Client.from_url(server.url) as client:
        client.put(NS, b"before", _payload(b"before", 64 * KiB))
        real_write = disk._write_file

        def enospc(path, record):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk, "_write_file", enospc)
        stored = {}
        for i in range(60):  # 60 x 64 KiB overflow the 2 MiB host tier: demotions to the full disk fail
            key = b"k%d" % i
            stored[key] = client.put(NS, key, _payload(key, 64 * KiB))
        assert set(stored.values()) == {"host"}
        for key in stored:
            data = client.get(NS, key)
            assert data is None or data == _payload(key, 64 * KiB)
        disk_stats = next(t for t in client.stats()["tiers"] if t["name"] == "disk")
        assert disk_stats["errors"] > 0 and disk_stats["used_bytes"] <= disk_stats["capacity_bytes"]
        with pytest.raises(CapacityExceeded, match="No space left on device"):
            client.put(NS, b"too-big-for-host", bytes(3 * MiB))  # only the full disk could take it
        monkeypatch.setattr(disk, "_write_file", real_write)
        client.put(NS, b"after", b"disk has room again")
        assert client.get(NS, b"after") == b"disk has room again"


def _flip_one_bit(data: bytearray, rng: random.Random) -> None:
    position = rng.randrange(len(data))
    data[position] ^= 1 << rng.randrange(8)


def test_every_bit_flip_on_disk_is_detected(start_server):
    server = start_server(host_bytes=0, disk_bytes=64 * MiB)
    rng = random.Random(7)
    keys = [b"f%d" % i for i in range(200)]
    with Client.from_url(server.url) as client:
        for key in keys:
            client.put(NS, key, _payload(key, rng.choice([100, 4 * KiB, 70 * KiB])))
        files = sorted(Path(server.config.disk.path).rglob("*.chunk"))
        assert len(files) == len(keys)
        for path in files:
            data = bytearray(path.read_bytes())
            _flip_one_bit(data, rng)
            path.write_bytes(data)
        results = [client.get(NS, key) for key in keys]
        disk = next(t for t in client.stats()["tiers"] if t["name"] == "disk")
    assert results == [None] * len(keys)  # 100% detected: a flipped chunk is a miss, never wrong bytes
    assert disk["checksum_failures"] == len(keys)
    assert list(Path(server.config.disk.path).rglob("*.chunk")) == []  # and dropped


def test_every_bit_flip_in_redis_is_detected(start_server, redis_url, shared_redis):
    server = start_server(host_bytes=0, disk_bytes=0, redis_url=redis_url)
    rng = random.Random(8)
    keys = [b"r%d" % i for i in range(200)]
    raw = shared_redis.client()
    with Client.from_url(server.url) as client:
        for key in keys:
            client.put(NS, key, _payload(key, rng.choice([100, 4 * KiB, 70 * KiB])))
        for name in raw.keys("tiercache:*"):
            value = bytearray(raw.get(name))
            _flip_one_bit(value, rng)
            raw.set(name, bytes(value))
        results = [client.get(NS, key) for key in keys]
        redis_tier = next(t for t in client.stats()["tiers"] if t["name"] == "redis")
    assert results == [None] * len(keys)
    assert redis_tier["checksum_failures"] == len(keys)
    assert raw.dbsize() == 0


def test_a_crashed_same_host_client_leaks_nothing(tmp_path):
    """A client process killed while holding reservations: the pages come back once its leases expire."""
    with ServerProcess("--host-mem", "8MiB", "--disk-size", "0", "--disk-dir", str(tmp_path / "d"),
                       "--config", str(_lease_config(tmp_path))) as server:
        script = ("import sys\nfrom tiercache.client import Client\n"
                  f"c = Client.from_url({server.url!r}, same_host=True)\n"
                  "from tiercache.protocol.wire import pb\n"
                  "r = c._stub.Reserve(pb.ReserveRequest(namespace='ns', chunks=[pb.ChunkHeader(key=b'k%d' % i, "
                  "size_bytes=1 << 20) for i in range(6)]))\n"
                  "print('reserved', flush=True)\nsys.stdin.read()\n")  # holds the leases until killed
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout.readline().strip() == "reserved"
        with Client.from_url(server.url, same_host=False, retry=RetryPolicy(attempts=1)) as client:
            child.kill()
            child.wait()
            # Meanwhile others are not blocked: puts still work (the arena has room beyond the reservations)...
            client.put("ns", b"other", bytes(512 * KiB))
            with pytest.raises(TierCacheError):  # ...but 6 of the 8 MiB are still reserved by the dead client
                client.put("ns", b"big", bytes(7 * MiB))

            def room_is_back() -> bool:  # the leases expire (1 s), then a quarantine of one more TTL
                try:
                    return client.put("ns", b"big", bytes(7 * MiB)) == "host"
                except TierCacheError:
                    return False
            wait_for(room_is_back, timeout_s=15, what="the dead client's reservations taken back")
            assert client.get("ns", b"big") == bytes(7 * MiB)


def _lease_config(tmp_path):
    path = tmp_path / "lease.yaml"
    path.write_text("server:\n  lease_ttl_s: 1\n")
    return path


def test_a_slow_reader_does_not_block_others(start_server):
    """A Get stream whose client stops reading holds one worker, not the store: other calls keep flowing."""
    server = start_server(host_bytes=64 * MiB, disk_bytes=0)
    with Client.from_url(server.url, timeout_s=20) as client, \
            grpc.insecure_channel(server.url.removeprefix("grpc://")) as channel:
        client.put(NS, b"big", bytes(32 * MiB))
        get = channel.unary_stream("/tiercache.v1.TierCache/Get", request_serializer=pb.GetRequest.SerializeToString,
                                   response_deserializer=lambda b: b)
        stalled = get(pb.GetRequest(namespace=NS, keys=[b"big"]))
        next(stalled)  # started, then left unread with ~32 MiB pending
        for i in range(50):
            client.put(NS, b"small-%d" % i, b"x" * 1000)
            assert client.get(NS, b"small-%d" % i) == b"x" * 1000
        stalled.cancel()


def test_a_disk_read_error_is_a_counted_miss(start_server, monkeypatch):
    import builtins

    import tiercache.tiers.disk as disk_module

    server = start_server(host_bytes=0, disk_bytes=16 * MiB)
    with Client.from_url(server.url) as client:
        client.put(NS, b"k", b"on disk")

        def failing_open(path, mode="r", *args, **kwargs):
            if str(path).endswith(".chunk") and "r" in mode:
                raise OSError(errno.EIO, "Input/output error")
            return builtins.open(path, mode, *args, **kwargs)

        monkeypatch.setattr(disk_module, "open", failing_open, raising=False)
        assert client.get(NS, b"k") is None  # a miss, not INTERNAL
        disk = next(t for t in client.stats()["tiers"] if t["name"] == "disk")
        assert disk["errors"] == 1
        monkeypatch.undo()
        assert client.get(NS, b"k") == b"on disk"


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 4 MiB tmpfs, so the disk tier meets a real ENOSPC."""
    with mounted_tmpfs(tmp_path / "tiny") as mount_point:
        yield mount_point


def test_a_really_full_filesystem_under_a_larger_cap(start_server, tiny_filesystem):
    # The disk tier's cap (64 MiB) is 16x what its filesystem can hold: other writers, or a wrong cap.
    server = start_server(host_bytes=1 * MiB, disk_bytes=64 * MiB, disk_options=dict(path=str(tiny_filesystem)))
    with Client.from_url(server.url) as client:
        stored = {}
        for i in range(40):  # 40 x 256 KiB = 10 MiB: overflows host (1 MiB) and the filesystem (4 MiB)
            key = b"f%d" % i
            try:
                stored[key] = client.put(NS, key, _payload(key, 256 * KiB))
            except CapacityExceeded as exc:
                assert "No space left on device" in str(exc)
        for key in stored:
            data = client.get(NS, key)
            assert data is None or data == _payload(key, 256 * KiB)
        disk_stats = next(t for t in client.stats()["tiers"] if t["name"] == "disk")
        assert disk_stats["errors"] > 0 and disk_stats["used_bytes"] <= 4 * MiB
        assert client.get(NS, b"f39") == _payload(b"f39", 256 * KiB)  # the newest is in the host tier
