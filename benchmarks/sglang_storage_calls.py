"""SGLang's HiCache storage calls, as its controller makes them, against tiercache and against SGLang's own file
backend, with SGLang's real host pool (MHA, page_first) on the CPU; memcpy of the same pages in the same run.

Per backend: pages written from the host pool in 128-page batches (the controller's backup: `batch_set` of flat
pages, or `batch_set_v1` by host index), the leading-run query (`batch_exists`), and pages read back into fresh
host slots (`batch_get` into dummy pages + `set_from_flat_data_page`, or `batch_get_v1`). Needs .venv-sglang.

    .venv-sglang/bin/python -m benchmarks.sglang_storage_calls [--pages 256] [--page-tokens 64] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from testkit import torchvision_stub  # noqa: F401 - before SGLang's pool modules (see tests/sglang)

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from lab.common import write_report
from tiercache.malloc import tune_allocator
from tiercache.process import ServerProcess

BATCH = 128  # the controller's storage batch (STORAGE_BATCH_SIZE)


def host_pool(pages: int, page_tokens: int, layers: int, heads: int, head_dim: int) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=pages * page_tokens, page_size=page_tokens, dtype=torch.float16, head_num=heads,
                              head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                              start_layer=0, end_layer=layers - 1)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, page_tokens, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=0, end_layer=layers - 1)


def config(model: str, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def run(backend, host, keys: list[str], v1: bool, page: int) -> dict:
    written = host.alloc(len(keys) * page)
    host.kv_buffer.view(torch.uint8).random_()
    page_bytes = host.get_dummy_flat_data_page().numel() * host.dtype.itemsize
    total = len(keys) * page_bytes
    started = time.perf_counter()
    for start in range(0, len(keys), BATCH):
        batch, slots = keys[start:start + BATCH], written[start * page:(start + BATCH) * page]
        if v1:
            assert all(backend.batch_set_v1(batch, slots))
        else:
            assert backend.batch_set(batch, [host.get_data_page(int(slots[i * page])) for i in range(len(batch))])
    put = total / (time.perf_counter() - started) / 1e9
    started = time.perf_counter()
    assert backend.batch_exists(keys) == len(keys)
    exists_ms = (time.perf_counter() - started) * 1000
    read = host.alloc(len(keys) * page)
    started = time.perf_counter()
    for start in range(0, len(keys), BATCH):
        batch, slots = keys[start:start + BATCH], read[start * page:(start + BATCH) * page]
        if v1:
            assert all(backend.batch_get_v1(batch, slots))
        else:
            pages = backend.batch_get(batch, [host.get_dummy_flat_data_page() for _ in batch])
            for i, flat in enumerate(pages):
                host.set_from_flat_data_page(int(slots[i * page]), flat)
    get = total / (time.perf_counter() - started) / 1e9
    first, last = int(written[0]), int(read[0])
    assert torch.equal(host.get_data_page(first).view(torch.uint8), host.get_data_page(last).view(torch.uint8))
    host.free(written)
    host.free(read)
    return {"put_gbps": put, "get_gbps": get, "batch_exists_ms": exists_ms}


def memcpy_gbps(host, pages: int, page: int) -> float:
    source = host.alloc(pages * page)
    target = host.alloc(pages * page)
    started = time.perf_counter()
    for i in range(pages):
        host.set_from_flat_data_page(int(target[i * page]), host.get_data_page(int(source[i * page])))
    elapsed = time.perf_counter() - started
    host.free(source)
    host.free(target)
    return pages * host.get_dummy_flat_data_page().numel() * host.dtype.itemsize / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tune_allocator()
    host = host_pool(args.pages, args.page_tokens, args.layers, args.heads, args.head_dim)
    page_bytes = host.get_dummy_flat_data_page().numel() * host.dtype.itemsize
    results: dict[str, list[dict]] = {"file": [], "tiercache_v0": [], "tiercache_v1": []}
    memcpy = []
    with ServerProcess("--host-mem", f"{4 * args.pages * page_bytes // (1 << 20) + 256}MiB", "--disk-size", "0") \
            as server, tempfile.TemporaryDirectory(prefix="hicache-bench-") as directory:
        factory = {"backend_name": "tiercache", "module_path": "tiercache.connector.sglang",
                   "class_name": "TierCacheStorage", "url": server.url}
        backends = {
            "file": (HiCacheFile(config("bench", {"file_storage_path": directory})), False),
            "tiercache_v0": (StorageBackendFactory.create_backend("dynamic", config("bench", factory), None), False),
            "tiercache_v1": (StorageBackendFactory.create_backend(
                "dynamic", config("bench", {**factory, "interface_v1": 1}), None), True),
        }
        for backend, _ in backends.values():
            backend.register_mem_pool_host(host)
        for round_ in range(args.rounds):
            memcpy.append(memcpy_gbps(host, args.pages, args.page_tokens))
            for name, (backend, v1) in backends.items():
                keys = get_storage_hash_str(list(range(round_ * 10**7, round_ * 10**7 + args.pages * args.page_tokens)),
                                            None, page_size=args.page_tokens)  # new pages each round
                results[name].append(run(backend, host, keys, v1, args.page_tokens))
        backends["file"][0].clear()
        for name in ("tiercache_v0", "tiercache_v1"):
            backends[name][0].close()
    report = {"pages": args.pages, "page_bytes": page_bytes, "memcpy_gbps": statistics.median(memcpy),
              **{name: {field: statistics.median(r[field] for r in runs) for field in runs[0]}
                 for name, runs in results.items()}}
    if args.json:
        write_report(report)
        return
    print(f"{args.pages} pages of {page_bytes / (1 << 20):.2f} MiB (MHA page_first), medians of {args.rounds} rounds")
    print(f"{'':<14}{'put GB/s':>10}{'get GB/s':>10}{'exists ms':>11}")
    print(f"{'memcpy':<14}{report['memcpy_gbps']:>10.2f}{report['memcpy_gbps']:>10.2f}")
    for name in results:
        r = report[name]
        print(f"{name:<14}{r['put_gbps']:>10.2f}{r['get_gbps']:>10.2f}{r['batch_exists_ms']:>11.2f}")


if __name__ == "__main__":
    main()
