"""tiercache as an SGLang HiCache storage backend (SGLang 0.5.23):

    python -m sglang.launch_server --model-path Qwen/Qwen3.5-0.8B --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tiercache",
            "module_path": "tiercache.connector.sglang", "class_name": "TierCacheStorage",
            "interface_v1": 1, "url": "grpc://127.0.0.1:50051"}'

Extra-config keys (SGLang's own: `backend_name`, `module_path`, `class_name`, `interface_v1`, `file_storage_path`
and its prefetch settings; ours, all optional): the connection's (tiercache.client.settings: `url`, `token`,
`tls_ca_file`, `tls_cert_file`, `tls_key_file`, `tls_server_name`, each defaulting to its environment variable), and
`salt` (the tenant's), `model_name` (default: SGLang's), `timeout_s`, `offline_backoff_s`. Any other key is refused
(docs/sglang.md).

All three levels of HiCacheStorage: v0 (`get` / `set` / `exists` and their batches; pages as SGLang's flat tensors),
v1 (`batch_get_v1` / `batch_set_v1`: pages straight between the host pool's memory and the server, by host index;
SGLang uses it when `interface_v1` is set) and v2 for hybrid models (`batch_exists_v2` / `batch_get_v2` /
`batch_set_v2`: Mamba states and SWA windows beside the KV, each page of a pool an object; Mamba states are stored
as recurrent-state objects, under the server's state budget). SGLang calls these from its prefetch and backup
threads: every call is thread-safe, and none raises — an unreachable server is a miss or a failed write (the
client's circuit breaker turns a dead server into instant misses), logged once per outage. The one refusal is at
SGLang's start: a host pool whose pages are larger than the server's chunk limit is refused when SGLang registers it,
with one line naming `--max-chunk-size` (tiercache.connector.limits).

This module is SGLang's interface and the calls to the server; `pools` knows SGLang's host pools (where each pool's
pages live on the server, their bytes in host memory), and `guard` turns every error into an answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tiercache.client import BreakerPolicy, Chunk, Client, ConnectionSettings, RetryPolicy
from tiercache.config import refuse_unknown
from tiercache.connector.limits import check_fits
from tiercache.connector.sglang import pools
from tiercache.connector.sglang.guard import Guard, answers
from tiercache.connector.sglang.pools import HostPools, PoolMismatch, PoolPlace
from tiercache.record.encoding import ChunkMeta

# SGLang's own keys (its controllers pop some of them before constructing the backend; not all of its paths do).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")


@dataclass(frozen=True)
class SGLangSettings:
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)  # url, token, TLS files
    salt: str = ""
    model_name: str | None = None
    timeout_s: float = 5.0  # one call of SGLang's prefetch or backup thread
    offline_backoff_s: float = 2.0  # while the server is unreachable, calls fail at once; probed this far apart
    interface_v1: bool = False  # SGLang's key: KV pages go through batch_get_v1 / batch_set_v1

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "SGLangSettings":
        extra = dict(extra or {})
        interface_v1 = bool(extra.get("interface_v1"))
        for key in SGLANG_KEYS:
            extra.pop(key, None)
        ours = [f.name for f in fields(cls) if f.name not in ("connection", "interface_v1")]
        refuse_unknown(extra, [*ConnectionSettings.keys(), *ours],
                       "unknown --hicache-storage-backend-extra-config keys for TierCacheStorage:", ValueError)
        connection, engine = ConnectionSettings.from_config(extra)
        return cls(connection, **engine, interface_v1=interface_v1)


def _all_failed(transfers) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


class TierCacheStorage(HiCacheStorage):
    """Created by SGLang as `TierCacheStorage(storage_config, kwargs)`; the host pools arrive after
    (`register_mem_pool_host`, `register_mem_host_pool_v2`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.settings = settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        self.client = Client(settings.connection, timeout_s=settings.timeout_s, retry=RetryPolicy(attempts=2),
                             breaker=BreakerPolicy.probing_at_most(settings.offline_backoff_s))
        self.model = settings.model_name or storage_config.model_name or "unnamed"
        self.pools = HostPools(self.model, storage_config, settings.salt, settings.interface_v1)
        self.guard = Guard("TierCacheStorage")
        self._staging = pools.Staging()

    # -- registration -----------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        self._check_page_size(mem_pool_host, "kv")
        self.pools.register_kv(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        self._check_page_size(host_pool, str(host_pool_name))
        self.pools.register(str(host_pool_name), host_pool)

    def _check_page_size(self, host_pool, pool_name: str) -> None:
        """Refuse, while SGLang starts (it registers its pools then), a pool whose pages the server would refuse:
        the one exception this backend raises (tiercache.connector.limits). A pool that cannot show a page is left
        to fail its transfers, as they do."""
        try:
            page = host_pool.get_dummy_flat_data_page()
        except Exception:  # noqa: BLE001 - any pool SGLang may register; its transfers answer for it
            return
        check_fits(self.client, page.numel() * page.element_size(),
                   f"TierCacheStorage: a {pool_name} page of {self.model}")

    # -- v0: flat pages as tensors ------------------------------------------------------------------------------------

    def get(self, key: str, target_location=None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @answers(lambda self, keys, *rest, **kw: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        place = self.pools.kv("flat")
        if target_locations is None:
            found = self.client.get_many(place.namespace, [place.key(k) for k in keys])
            return [torch.frombuffer(bytearray(f.data), dtype=torch.uint8) if f is not None and f.data else None
                    for f in found]
        staged = [t if t.is_contiguous() else t.contiguous() for t in target_locations]
        fetched = self._fetch(place, keys, [pools.tensor_bytes(t) for t in staged])
        for ok, target, page in zip(fetched, target_locations, staged):
            if ok and page is not target:  # received into a contiguous copy of a strided target
                target.copy_(page)
        return [t if ok else None for t, ok in zip(target_locations, fetched)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    @answers(lambda self, *args, **kw: False)
    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None,
                  extra_info: HiCacheStorageExtraInfo | None = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        return all(self._store(self.pools.kv("flat"), keys, [pools.tensor_bytes(v) for v in values], extra_info))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @answers(lambda self, *args, **kw: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        place = self.pools.probed_kv
        return _leading(tier is not None for tier in self.client.locate(place.namespace, [place.key(k) for k in keys]))

    # -- v1: pages straight from and into the host pool's memory ------------------------------------------------------

    @answers(lambda self, keys, *rest, **kw: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self.pools.regions(keys, host_indices)
        if all(len(regions) == 1 for regions in pages):  # each page one region: received in place
            return self._fetch(self.pools.kv("v1"), keys, [pools.memory(*regions[0]) for regions in pages])
        staging = self._staging.buffers([sum(size for _, size in regions) for regions in pages])
        fetched = self._fetch(self.pools.kv("v1"), keys, staging)
        for ok, regions, buffer in zip(fetched, pages, staging):
            if ok:
                pools.scatter(buffer, regions)
        return fetched

    @answers(lambda self, keys, *rest, **kw: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        payloads = [pools.memory(*regions[0]) if len(regions) == 1 else pools.gather(regions)
                    for regions in self.pools.regions(keys, host_indices)]
        return self._store(self.pools.kv("v1"), keys, payloads, extra_info)

    # -- v2: the pools of a hybrid model ------------------------------------------------------------------------------

    @answers(lambda self, *args, **kw: PoolTransferResult(0, {}, []))
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """As SGLang's file backend answers: the leading run of KV pages, then per pool the prefixes it can restore
        (ALL_PAGES: every page up to there; TRAILING_PAGES: the last len(transfer.keys) pages), and the prefixes every
        pool can restore."""
        transfers = list(pool_transfers or [])
        if any(t.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES) for t in transfers):
            raise PoolMismatch("block-groups", "block-group pools (DeepSeek-V4) are not supported; they count as "
                                               "misses")
        present = self._present([(self.pools.probed_kv, keys)] + [(self.pools.side(str(t.name)), keys)
                                                                   for t in transfers])
        kv_pages = _leading(present[0])
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer, has in zip(transfers, present[1:]):
            if not restorable:
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = _leading(has[:kv_pages])
                pool_restorable = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {p for p in range(1, kv_pages + 1) if all(has[max(0, p - trailing):p])}
                boundary = max(pool_restorable, default=0)
            if boundary:
                hits[transfer.name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _present(self, wanted: list[tuple[PoolPlace, list[str]]]) -> list[list[bool]]:
        """Which of each pool's keys the server holds: one Exists call per namespace."""
        by_namespace: dict[str, list[bytes]] = {}
        for place, keys in wanted:
            by_namespace.setdefault(place.namespace, []).extend(place.key(k) for k in keys)
        where = {ns: dict(zip(ks, self.client.locate(ns, ks))) for ns, ks in by_namespace.items()}
        return [[where[place.namespace][place.key(k)] is not None for k in keys] for place, keys in wanted]

    @answers(lambda self, transfers, *rest, **kw: _all_failed(transfers))
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        results = {}
        for transfer in transfers:
            host, keys, offsets = self.pools.transfer_pages(transfer)
            pages = [torch.empty_like(host.get_dummy_flat_data_page()) for _ in keys]
            fetched = self._fetch(self.pools.side(str(transfer.name)), keys, [pools.tensor_bytes(p) for p in pages])
            for ok, page, offset in zip(fetched, pages, offsets):
                if ok:
                    host.set_from_flat_data_page(offset, page)
            results[transfer.name] = fetched
        return results

    @answers(lambda self, transfers, *rest, **kw: _all_failed(transfers))
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        results = {}
        for transfer in transfers:
            host, keys, offsets = self.pools.transfer_pages(transfer)
            payloads = [pools.tensor_bytes(host.get_data_page(offset, flat=True)) for offset in offsets]
            results[transfer.name] = self._store(self.pools.side(str(transfer.name)), keys, payloads, extra_info)
        return results

    # -- the rest of the interface ----------------------------------------------------------------------------------

    def clear(self) -> bool:
        self.guard.warn_once("clear", "clear() is not supported: the server's chunks are shared with other engines "
                                      "(they age out by eviction; `tiercache` admin tools delete namespaces)")
        return False

    def get_stats(self):
        return None

    def close(self) -> None:
        self.client.close()

    # -- the server -------------------------------------------------------------------------------------------------

    def _fetch(self, place: PoolPlace, keys: Sequence[str], buffers: list) -> list[bool]:
        """Read each key's object into its buffer; True where it came whole (a size that does not match the buffer
        is a miss: the namespace names the layout, so that is damage, never a page to use)."""
        fetched = self.client.get_many(place.namespace, [place.key(k) for k in keys], buffers)
        return [f is not None and len(f.data) == len(memoryview(b).cast("B")) for f, b in zip(fetched, buffers)]

    def _store(self, place: PoolPlace, keys: Sequence[str], payloads: list,
               extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """Put objects, each naming its parent (PoolPlace.parent) and, when SGLang passes the pages before this batch
        (hicache_storage_pass_prefix_keys), its position in tokens."""
        # [] is a batch at the prompt's start, None an unknown position.
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        keys = list(keys)
        chunks = []
        for index, (key, payload) in enumerate(zip(keys, payloads)):
            tokens = (len(prefix) + index + 1) * self.pools.page_size if prefix is not None else 0
            chunks.append(Chunk(place.key(key), payload,
                                ChunkMeta(place.object_class, tokens, place.parent(keys, index, prefix))))
        self.client.put_many(place.namespace, chunks)
        return [True] * len(keys)


def _leading(flags) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count
