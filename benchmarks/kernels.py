"""Bandwidth of the copy kernels against cudaMemcpy of the same bytes, for Qwen3.5-0.8B and 4B shaped chunks.

For each preset: gather (paged KV -> chunk) and scatter (chunk -> paged KV) of one N-token chunk of all attention
layers, with vLLM's NHD layout and 16-token blocks in random order, into device memory and into pinned host memory;
and the state copy of one slot of every Gated DeltaNet layer (conv bf16 + SSM fp32). Baseline: one contiguous
device->device / device->host copy of the same number of bytes (torch `copy_`, i.e. cudaMemcpyAsync). Needs CUDA
and CuPy (run it on a GPU machine):

    .venv/bin/python benchmarks/kernels.py [--repeat 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tiercache import kernels  # noqa: E402
from tiercache.prefix.objects import CacheSpec  # noqa: E402
from tiercache.prefix.presets import preset  # noqa: E402


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
    slots = kernels.slots_for_blocks(order, block, start=0, count=n)
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
    state_slots = torch.tensor([5], dtype=torch.int64, device="cuda")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device; none is visible here (nothing measured).")
        return
    rows = [row for name in ("qwen3.5-0.8b", "qwen3.5-4b") for row in bench_preset(name, args.repeat)]
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
        return
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'preset':<14}{'copy':<24}{'MiB':>8}{'GB/s':>9}{'memcpy GB/s':>13}{'ratio':>7}")
    for r in rows:
        print(f"{r['preset']:<14}{r['copy']:<24}{r['bytes'] / 2**20:>8.1f}{r['gbps']:>9.1f}{r['memcpy_gbps']:>13.1f}"
              f"{r['ratio']:>7.2f}")


if __name__ == "__main__":
    main()
