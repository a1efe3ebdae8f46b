"""Soak: N clients x T seconds of mixed put / get / exists against one server process at capacity pressure, beside
clients that misbehave.

The working set is several times the host and disk tiers, so evictions and demotions run the whole time. Every value
is derived from its key, so a reader can tell wrong bytes from right ones: a get returns the right bytes or a miss.
Beside the well-behaved clients run `--stalled` clients (a Put that sends its header and then nothing, reopened each
time the server ends it), `--slow` readers (a Get of 16 MiB read one frame per `--slow-frame-s`) and
`--disconnecting` clients (streams cancelled half-way). `--remote N` of the well-behaved clients use the data
channel instead of the shared arena (same_host=False), and `--stalled-data` / `--unread-data` clients misbehave on
it (a put that stops half-way through its payload; a get of a 16 MiB chunk that is never read). Reports ops/s,
p50/p99 latency per operation, errors and wrong bytes of the well-behaved clients, how each misbehaving stream ended,
evictions, and the server's RSS sampled every few seconds next to the configured tier capacity (plus a PNG of RSS
and ops/s over time).

    .venv/bin/python -m benchmarks.soak [--clients 8] [--seconds 600] [--host-mem 256MiB] [--disk-size 512MiB]
                                        [--stalled 8] [--slow 2] [--disconnecting 2]
                                        [--remote 4] [--stalled-data 4] [--unread-data 2]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import random
import socket
import tempfile
import threading
import time

import grpc

from lab.common import percentiles, write_report
from tiercache.client import Client
from tiercache.client.retry import RetryPolicy
from tiercache.config import parse_size
from tiercache.errors import TierCacheError
from tiercache.process import ServerProcess
from tiercache.protocol import data_channel
from tiercache.protocol.wire import pb, pb_grpc
from tiercache.record.encoding import ChunkMeta

NS = "soak"
SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)


def payload(key: bytes, size: int) -> bytes:
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = {"put": [], "get": [], "exists": []}
        self.errors: list[str] = []
        self.wrong = 0
        self.hits = self.misses = 0
        self.misbehaving: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def ended(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.misbehaving[kind][outcome] += 1


def client_loop(url: str, n: int, keys: int, deadline: float, tally: Tally, remote: bool) -> None:
    rng = random.Random(n)
    with Client.from_url(url, timeout_s=30, retry=RetryPolicy(attempts=2), same_host=not remote) as client:
        while time.monotonic() < deadline:
            # A hot set (5% of the keys get half the traffic) and a long tail that cycles through the tiers.
            index = rng.randrange(keys // 20) if rng.random() < 0.5 else rng.randrange(keys)
            key = b"k%d" % index
            size = SIZES[index % len(SIZES)]
            op = rng.choices(("put", "get", "exists"), (0.3, 0.5, 0.2))[0]
            started = time.perf_counter()
            try:
                if op == "put":
                    client.put(NS, key, payload(key, size))
                elif op == "get":
                    data = client.get(NS, key)
                    with tally.lock:
                        if data is None:
                            tally.misses += 1
                        elif data != payload(key, size):
                            tally.wrong += 1
                        else:
                            tally.hits += 1
                else:
                    client.exists(NS, [key, b"k%d" % (index + 1)])
            except TierCacheError as exc:
                with tally.lock:
                    tally.errors.append(f"{op}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            with tally.lock:
                tally.latency[op].append(elapsed)


def misbehaving_loop(kind: str, url: str, deadline: float, tally: Tally, slow_frame_s: float) -> None:
    """One misbehaving client until the deadline: each stream it opens ends as the server or the client decides."""
    target = url.removeprefix("grpc://")
    rng = random.Random(kind)
    while (left := deadline - time.monotonic()) > 0.5:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TierCacheStub(channel)
            release = threading.Event()
            try:
                if kind == "stalled":
                    def frames():
                        yield pb.PutFrame(header=pb.ChunkHeader(namespace=NS, key=b"stalled", size_bytes=4 << 20))
                        release.wait()  # ...and nothing more, until the call has ended
                    stub.Put(frames(), timeout=left)
                    tally.ended(kind, "completed")
                elif kind == "slow":
                    for _ in stub.Get(pb.GetRequest(namespace=NS, keys=[b"k0", b"k4", b"k8", b"k12"]), timeout=left):
                        time.sleep(slow_frame_s)
                    tally.ended(kind, "completed")
                else:  # disconnecting: a Get or a Put cancelled half-way
                    if rng.random() < 0.5:
                        call = stub.Get(pb.GetRequest(namespace=NS, keys=[b"k3"] * 4), timeout=left)
                        next(call, None)
                    else:
                        def half():
                            yield pb.PutFrame(header=pb.ChunkHeader(namespace=NS, key=b"cut", size_bytes=4 << 20))
                            yield pb.PutFrame(data=bytes(1 << 20))
                            release.wait()
                        call = stub.Put.future(half(), timeout=left)
                        time.sleep(0.05)
                    call.cancel()
                    tally.ended(kind, "cancelled by the client")
                    time.sleep(0.05)
            except grpc.RpcError as exc:
                tally.ended(kind, exc.code().name)
            finally:
                release.set()


def misbehaving_data_loop(kind: str, url: str, deadline: float, tally: Tally, hold_s: float) -> None:
    """One client misbehaving on the data channel until the deadline: a put that stops half-way through its payload
    ("stalled-data"), or a 16 MiB get it does not read for `hold_s` ("unread-data"); then it sees whether the server
    ended the connection meanwhile."""
    client = Client.from_url(url, same_host=False)
    client.put(NS, b"probe", b"x")  # learns the data port
    host, port = client.paths.data_channel.address
    unread = b"unread-%d" % threading.get_ident()
    while deadline - time.monotonic() > 0.5:
        try:
            if kind == "unread-data":  # the chunk it will not read (evictions may have taken the last one)
                client.put(NS, unread, bytes(16 << 20))
            with socket.create_connection((host, port), timeout=deadline - time.monotonic()) as sock:
                sock.sendall(data_channel.hello(None))
                data_channel.read_status(sock)
                if kind == "stalled-data":
                    sock.sendall(data_channel.put_request(NS, [data_channel.PutEntry(b"stalled", 4 << 20, ChunkMeta())])
                                 + bytes(2 << 20))
                    sock.settimeout(max(deadline - time.monotonic(), 0.1))
                    budget_s = 3600.0
                else:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    sock.sendall(data_channel.get_request(NS, [unread]))
                    time.sleep(min(hold_s, max(deadline - time.monotonic(), 0)))  # past the server's idle timeout
                    # Through a tiny window, what the server queued before closing drains at a crawl and its FIN
                    # with it; but a closed socket answers new bytes with a reset at once.
                    sock.sendall(b"\0")
                    sock.settimeout(0.5)
                    budget_s = 5.0
                outcome = "closed by the server" if _drained_to_close(sock, budget_s) else "outlived the run"
        except (OSError, TierCacheError) as exc:
            outcome = type(exc).__name__
        tally.ended(kind, outcome)
    client.close()


def _drained_to_close(sock: socket.socket, budget_s: float = 3600) -> bool:
    """Whether the peer closed: what it sent before is read first (the unread get's buffered bytes)."""
    ends = time.monotonic() + budget_s
    try:
        while sock.recv(1 << 16):
            if time.monotonic() > ends:
                return False
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def run_load(args, host_mem: str, seconds: float):
    """One server process under the load for `seconds`: (peak RSS, RSS samples, tally, final stats, elapsed)."""
    tally = Tally()
    config = ["--config", args.server_config] if args.server_config else []
    with tempfile.TemporaryDirectory(prefix="tiercache-soak-") as disk_dir, \
            ServerProcess("--host-mem", host_mem, "--disk-size", args.disk_size, "--disk-dir", disk_dir,
                          *config) as server:
        pid = server.process.pid
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=client_loop, args=(server.url, n, args.keys, deadline, tally,
                                                              n < args.remote))
                   for n in range(args.clients)]
        threads += [threading.Thread(target=misbehaving_loop, args=(kind, server.url, deadline, tally,
                                                                    args.slow_frame_s), daemon=True)
                    for kind, count in (("stalled", args.stalled), ("slow", args.slow),
                                        ("disconnecting", args.disconnecting)) for _ in range(count)]
        threads += [threading.Thread(target=misbehaving_data_loop, args=(kind, server.url, deadline, tally,
                                                                         args.unread_hold_s), daemon=True)
                    for kind, count in (("stalled-data", args.stalled_data), ("unread-data", args.unread_data))
                    for _ in range(count)]
        started = time.monotonic()
        for t in threads:
            t.start()
        samples = [(0.0, rss_bytes(pid), 0)]  # (seconds, rss bytes, ops so far)
        while any(t.is_alive() for t in threads):
            time.sleep(args.sample_s)
            with tally.lock:
                ops = sum(len(v) for v in tally.latency.values())
            samples.append((time.monotonic() - started, rss_bytes(pid), ops))
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        with Client.from_url(server.url) as client:
            stats = client.stats()
    return max(r for _, r, _ in samples), samples, tally, stats, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--host-mem", default="256MiB")
    parser.add_argument("--disk-size", default="512MiB")
    parser.add_argument("--keys", type=int, default=4000, help="distinct keys (working set ~ keys x 1.3 MiB)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--baseline-seconds", type=float, default=60, help="load run without a host tier")
    parser.add_argument("--plot", default="soak-rss.png", help="RSS over time ('' = none)")
    parser.add_argument("--stalled", type=int, default=0, help="clients whose Put stalls after its header")
    parser.add_argument("--slow", type=int, default=0, help="clients that read a Get one frame at a time")
    parser.add_argument("--slow-frame-s", type=float, default=0.5, help="a slow reader's pause per 1 MiB frame")
    parser.add_argument("--disconnecting", type=int, default=0, help="clients that cancel streams half-way")
    parser.add_argument("--remote", type=int, default=0, help="of the clients, how many use the data channel")
    parser.add_argument("--stalled-data", type=int, default=0, help="data-channel clients whose put stalls")
    parser.add_argument("--unread-data", type=int, default=0, help="data-channel clients that never read a get")
    parser.add_argument("--unread-hold-s", type=float, default=15, help="how long they hold it unread (more than "
                        "server.stream_idle_timeout_s)")
    parser.add_argument("--server-config", help="YAML for the server (e.g. a shorter server.stream_idle_timeout_s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    host_bytes, disk_bytes = parse_size(args.host_mem), parse_size(args.disk_size)
    # The fixed overhead, same run: peak RSS of the same server and load with the host tier off (Python, grpc,
    # the index, chunks in flight). The goal is peak RSS within 10% of host tier capacity + that overhead.
    overhead, _, _, _, _ = run_load(args, "0", args.baseline_seconds)
    peak_rss, samples, tally, stats, elapsed = run_load(args, args.host_mem, args.seconds)
    tiers = {t["name"]: t for t in stats["tiers"]}
    ops = sum(len(v) for v in tally.latency.values())
    report = {
        "clients": args.clients, "seconds": round(elapsed, 1), "ops": ops, "ops_per_s": round(ops / elapsed, 1),
        "latency_ms": {op: {**percentiles(v, (50, 99), scale=1e3), "count": len(v)} for op, v in tally.latency.items()},
        "errors": len(tally.errors), "first_errors": tally.errors[:5], "wrong_bytes": tally.wrong,
        "get_hits": tally.hits, "get_misses": tally.misses,
        "evictions": {name: t["evictions"] for name, t in tiers.items()},
        "checksum_failures": sum(t["checksum_failures"] for t in tiers.values()),
        "host_capacity_bytes": host_bytes, "disk_capacity_bytes": disk_bytes,
        "overhead_rss_bytes": overhead, "idle_rss_bytes": samples[0][1], "peak_rss_bytes": peak_rss,
        "final_rss_bytes": samples[-1][1] if samples else 0,
        "peak_rss_over_capacity_plus_overhead": round(peak_rss / (host_bytes + overhead), 3),
        "rss_samples": [(round(t, 1), r) for t, r, _ in samples],
        "ops_samples": [(round(t, 1), n) for t, _, n in samples],
        "remote_clients": args.remote,
        "misbehaving": {"stalled": args.stalled, "slow": args.slow, "disconnecting": args.disconnecting,
                        "stalled_data": args.stalled_data, "unread_data": args.unread_data,
                        "outcomes": {kind: dict(c) for kind, c in tally.misbehaving.items()}},
    }
    if args.plot and samples:
        from lab.common import pyplot

        plt = pyplot()

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([t for t, _, _ in samples], [r / 2**20 for _, r, _ in samples], label="server RSS")
        ax.axhline((host_bytes + overhead) / 2**20, color="grey", linestyle="--", label="host tier + fixed overhead")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left")
        rate = ax.twinx()  # ops/s of the well-behaved clients between samples
        rate.plot([t for t, _, _ in samples[1:]],
                  [(n - n0) / max(t - t0, 1e-9) for (t0, _, n0), (t, _, n) in zip(samples, samples[1:])],
                  color="tab:green", alpha=0.6, label="ops/s")
        rate.set_ylabel("ops/s")
        rate.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    if args.json:
        write_report(report)
        return
    print(f"{args.clients} clients x {elapsed:.0f} s, host tier {args.host_mem}, disk tier {args.disk_size}, "
          f"{args.keys} keys of 16 KiB..4 MiB")
    print(f"ops {ops} ({ops / elapsed:.0f}/s); errors {len(tally.errors)}; wrong bytes {tally.wrong}; "
          f"get hits {tally.hits} misses {tally.misses}; checksum failures {report['checksum_failures']}")
    if tally.misbehaving:
        print(f"misbehaving streams, how they ended: {report['misbehaving']['outcomes']}")
    for op, lat in report["latency_ms"].items():  # an operation no client made has no percentiles
        if lat["count"]:
            print(f"  {op:<7} p50 {lat['p50']:>8.2f} ms   p99 {lat['p99']:>8.2f} ms   ({lat['count']} calls)")
    print(f"evictions per tier: {report['evictions']}")
    print(f"RSS: fixed overhead {overhead / 2**20:.0f} MiB (same load, no host tier), idle {samples[0][1] / 2**20:.0f} "
          f"MiB, peak {peak_rss / 2**20:.0f} MiB, final {report['final_rss_bytes'] / 2**20:.0f} MiB; "
          f"peak / (host tier + overhead) = {report['peak_rss_over_capacity_plus_overhead']:.3f}")


if __name__ == "__main__":
    main()
