"""Bandwidth of the copy kernels against cudaMemcpy of the same bytes, for Qwen3.5-0.8B and 4B shaped chunks, and
the vLLM connector's worker path (tiercache.connector.vllm.loads and .saves) on them.

For each preset: gather (paged KV -> chunk) and scatter (chunk -> paged KV) of one N-token chunk of all attention
layers, with vLLM's NHD layout and 16-token blocks in random order, into device memory and into pinned host memory;
and the state copy of one slot of every Gated DeltaNet layer (conv bf16 + SSM fp32). Baseline: one contiguous
device->device / device->host copy of the same number of bytes (torch `copy_`, i.e. cudaMemcpyAsync). Needs CUDA
and CuPy (run it on a GPU machine):

    .venv/bin/python -m benchmarks.kernels [--repeat 50] [--json]

The connector rows time one engine step's saves and one request's load through `Saves` and `Loads` against a real
tiercache server (same host): what vLLM's thread waits for in `wait_for_save` (the gathers are queued on a side
stream, the put runs on a background thread), when the gathered bytes are in pinned staging memory (the copies'
bandwidth against a device->host memcpy of the same bytes), and a load from the start of its fetch to its report in an
idle step (fetch into pinned staging, scatter on the load stream) against a host->device memcpy. `--connector --device
cpu` runs those rows on CPU tensors (the kernels' torch reference): the path's own cost without a GPU, against a host
memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.throughput import rate
from lab.common import write_report
from tiercache import kernels
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import preset


def timed_gbps(action, size: int, repeat: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        action()
    samples = []
    for _ in range(repeat):
        start.record()
        action()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000)
    return size / statistics.median(samples) / 1e9


def timed_gbps_host(action, size: int, repeat: int) -> float:
    """timed_gbps for copies on the host (no CUDA events): after a warm-up, the median of wall-clock samples."""
    for _ in range(3):
        action()
    return rate(size, action, repeat)


def bench_preset(name: str, repeat: int) -> list[dict]:
    layout = preset(name)
    spec = CacheSpec.for_layout(layout)
    attention, recurrent = layout.attention_groups[0], layout.recurrent_group
    n, block = spec.chunk_tokens, 16
    blocks = 4 * (n // block + 1)
    dtype = torch.bfloat16
    layers = [torch.randn(2, blocks, block, attention.kv_heads, attention.head_dim, device="cuda").to(dtype)
              for _ in attention.layers]
    order = torch.randperm(blocks, device="cuda")[: n // block + 1]
    slots = kernels.slots_for_blocks(order, block, start=0, count=n).cpu()  # on the host, as the connector has them
    chunk = torch.empty(len(layers), 2, n, attention.kv_heads * attention.head_dim, dtype=dtype, device="cuda")
    pinned = torch.empty(chunk.shape, dtype=dtype).pin_memory()
    size = chunk.numel() * chunk.element_size()
    flat = torch.empty(size, dtype=torch.uint8, device="cuda")
    flat_pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
    d2d = timed_gbps(lambda: flat.copy_(chunk.view(torch.uint8).reshape(-1), non_blocking=True), size, repeat)
    d2h = timed_gbps(lambda: flat_pinned.copy_(flat, non_blocking=True), size, repeat)
    rows = [
        ("gather -> device", timed_gbps(lambda: kernels.gather_kv(layers, slots, chunk), size, repeat), d2d),
        ("scatter <- device", timed_gbps(lambda: kernels.scatter_kv(layers, slots, chunk), size, repeat), d2d),
        ("gather -> pinned host", timed_gbps(lambda: kernels.gather_kv(layers, slots, pinned), size, repeat), d2h),
        ("scatter <- pinned host", timed_gbps(lambda: kernels.scatter_kv(layers, slots, pinned), size, repeat), d2h),
    ]
    conv, ssm = recurrent.state
    pools = []
    for _ in recurrent.layers:
        pools.append(torch.randn(8, *conv.shape, device="cuda").to(getattr(torch, conv.dtype)))
        pools.append(torch.randn(8, *ssm.shape, device="cuda").to(getattr(torch, ssm.dtype)))
    state_slots = torch.tensor([5], dtype=torch.int64)
    pools = kernels.state_pools(pools)  # prepared once, as the connector does at registration
    record = kernels.state_record_bytes(pools)
    buffer = torch.empty(1, record, dtype=torch.uint8, device="cuda")
    buffer_pinned = torch.empty(1, record, dtype=torch.uint8).pin_memory()
    state_source = torch.empty(1, record, dtype=torch.uint8, device="cuda")
    state_d2d = timed_gbps(lambda: buffer.copy_(state_source, non_blocking=True), record, repeat)
    state_d2h = timed_gbps(lambda: buffer_pinned.copy_(buffer, non_blocking=True), record, repeat)
    rows += [
        ("state -> device", timed_gbps(lambda: kernels.states_to_buffer(pools, state_slots, buffer), record, repeat),
         state_d2d),
        ("state -> pinned host", timed_gbps(lambda: kernels.states_to_buffer(pools, state_slots, buffer_pinned),
                                            record, repeat), state_d2h),
    ]
    return [{"preset": name, "copy": label, "bytes": size if "state" not in label else record, "gbps": gbps,
             "memcpy_gbps": base, "ratio": gbps / base} for label, gbps, base in rows]


def bench_connector(name: str, repeat: int, device: str) -> list[dict]:
    """One step's saves (4 full blocks + the state at their end) and one request's load of the same objects, through
    the vLLM connector's Saves and Loads on paged caches shaped like the preset's, against a real server."""
    import time

    from tiercache.client import Client
    from tiercache.connector.vllm.layout import PagedViews, PoolSets
    from tiercache.connector.vllm.loads import Loads
    from tiercache.connector.vllm.plan import Job, Transfer
    from tiercache.connector.vllm.salts import namespaces
    from tiercache.connector.vllm.saves import Saves
    from tiercache.connector.vllm.worker_stats import WorkerStats
    from tiercache.prefix.objects import ObjectKind, object_ref
    from tiercache.process import ServerProcess

    layout = preset(name)
    spec = CacheSpec.for_layout(layout)
    attention, recurrent = layout.attention_groups[0], layout.recurrent_group
    n, blocks = spec.chunk_tokens, 16
    page = n * attention.kv_heads * attention.head_dim * 2 * 2  # K and V, bf16
    conv, ssm = recurrent.state
    state_bytes = [conv.size_bytes, ssm.size_bytes]
    views = PagedViews(
        attention=(tuple(torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device=device)
                         for _ in attention.layers),),
        states=(tuple(torch.randint(0, 256, (blocks, size), dtype=torch.uint8, device=device)
                      for _ in recurrent.layers for size in state_bytes),))
    pools, staging = PoolSets(views), 1 << 30
    server = ServerProcess("--host-mem", "4GiB", "--disk-size", "0").start()
    client = Client.from_url(server.url)
    try:
        saver = Saves(client, namespaces(spec), staging, WorkerStats(), engine_blocks=False)
        saver.register(pools, lambda: None)
        loader = Loads(client, namespaces(spec), staging, WorkerStats())  # its staging reused round to round
        loader.register(pools, lambda: None)
        recurrent_index = layout.groups.index(recurrent)
        synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        waits, gathered, loads, size = [], [], [], 0
        for round_ in range(max(3, repeat // 10)):
            hashes = spec.hashes(torch.randint(3, 1000, (4 * n + 1,)).numpy() + round_)
            transfers = [Transfer(object_ref(spec, hashes, ObjectKind.KV, n * (i + 1), 0), (i,)) for i in range(4)]
            transfers.append(Transfer(object_ref(spec, hashes, ObjectKind.STATE, 4 * n, recurrent_index), (5,)))
            job = Job(f"r{round_}", "", tuple(transfers))
            size = sum(pools.object_bytes(t) for t in transfers)
            synchronize()
            started = time.perf_counter()
            saver.save([job])
            waits.append(time.perf_counter() - started)  # what vLLM's thread waits for
            saver.drain(None)  # the gathers, then the put (sent at once: drain flushes the put queue)
            gathered.append(time.perf_counter() - started)
            moved = Job(job.req_id, "", tuple(Transfer(t.ref, tuple(b + 8 for b in t.blocks)) for t in transfers))
            synchronize()
            started = time.perf_counter()
            loader.start([moved])
            while not loader.ended(idle=True).ended:
                pass
            loads.append(time.perf_counter() - started)
        loader.stop()
        saver.stop()
    finally:
        client.close()
        server.kill()
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device == "cuda")
    source = torch.empty(size, dtype=torch.uint8, device=device)
    timed = timed_gbps if device == "cuda" else timed_gbps_host
    d2h = timed(lambda: host.copy_(source, non_blocking=True), size, repeat)
    h2d = timed(lambda: source.copy_(host, non_blocking=True), size, repeat)
    median = statistics.median
    return [{"preset": name, "copy": f"connector save, vLLM waits ({device})", "bytes": size,
             "ms": round(median(waits) * 1e3, 3), "gbps": size / median(waits) / 1e9, "memcpy_gbps": d2h},
            {"preset": name, "copy": f"connector save, put done ({device})", "bytes": size,
             "ms": round(median(gathered) * 1e3, 3), "gbps": size / median(gathered) / 1e9, "memcpy_gbps": d2h},
            {"preset": name, "copy": f"connector load ({device})", "bytes": size, "ms": round(median(loads) * 1e3, 3),
             "gbps": size / median(loads) / 1e9, "memcpy_gbps": h2d}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--connector", action="store_true", help="only the vLLM connector's worker path")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="for --connector")
    args = parser.parse_args()
    presets = ("qwen3.5-0.8b", "qwen3.5-4b")
    if args.connector and args.device == "cpu":
        rows = [row for name in presets for row in bench_connector(name, args.repeat, "cpu")]
        _print(rows, "cpu (the kernels' torch reference)", args.json)
        return
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device; none is visible here (nothing measured).")
        return
    rows = [] if args.connector else [row for name in presets for row in bench_preset(name, args.repeat)]
    rows += [row for name in presets for row in bench_connector(name, args.repeat, "cuda")]
    _print(rows, torch.cuda.get_device_name(), args.json)


def _print(rows: list[dict], device: str, as_json: bool) -> None:
    for r in rows:
        r["ratio"] = r["gbps"] / r["memcpy_gbps"] if r.get("memcpy_gbps") else None
    if as_json:
        write_report({"device": device, "rows": rows})
        return
    print(f"device: {device}")
    print(f"{'preset':<14}{'copy':<38}{'MiB':>8}{'ms':>9}{'GB/s':>9}{'memcpy GB/s':>13}{'ratio':>7}")
    for r in rows:
        ms = f"{r['ms']:>9.3f}" if "ms" in r else f"{'':>9}"
        base = f"{r['memcpy_gbps']:>13.1f}" if r.get("memcpy_gbps") else f"{'-':>13}"
        ratio = f"{r['ratio']:>7.2f}" if r.get("ratio") else f"{'-':>7}"
        print(f"{r['preset']:<14}{r['copy']:<38}{r['bytes'] / 2**20:>8.1f}{ms}{r['gbps']:>9.1f}{base}{ratio}")


if __name__ == "__main__":
    main()
