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
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence, TypeVar

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
from tiercache.connector.sglang import naming
from tiercache.errors import CircuitOpen, TierCacheError, Unavailable
from tiercache.record.encoding import CLASS_KV, CLASS_STATE, ChunkMeta

log = logging.getLogger(__name__)
T = TypeVar("T")

# SGLang's own keys (its controllers pop some of them before constructing the backend; not all of its paths do).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
# Pools whose pages are recurrent states (the rest are KV-like pages). By value: PoolName hashes by its member name.
STATE_POOLS = {str(PoolName.MAMBA)}
PER_RANK_POOLS = {str(PoolName.MAMBA)}  # sharded by TP rank even in a model whose KV every rank holds whole


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


def _answers(failed: Callable[..., Any]):
    """No exception from a decorated call reaches SGLang's threads: any error (a bug, a pool that does not fit) is
    logged once per method and answered with `failed(self, *args)`: misses, False."""
    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - see above
                if method.__name__ not in self._refusals:
                    self._refusals.add(method.__name__)
                    log.exception("TierCacheStorage.%s failed (answered as a miss; logged once): %r", method.__name__,
                                  exc)
                return failed(self, *args, **kwargs)
        return guarded
    return decorate


def _all_failed(transfers) -> dict[str, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


class TierCacheStorage(HiCacheStorage):
    """Created by SGLang as `TierCacheStorage(storage_config, kwargs)`; the host pools arrive after
    (`register_mem_pool_host`, `register_mem_host_pool_v2`)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.settings = SGLangSettings.from_extra_config(storage_config.extra_config)
        settings = self.settings
        self.client = Client(settings.connection, timeout_s=settings.timeout_s, retry=RetryPolicy(attempts=2),
                             breaker=BreakerPolicy.probing_at_most(settings.offline_backoff_s))
        self.model = settings.model_name or storage_config.model_name or "unnamed"
        self.mem_pool_host = None
        self.registered_pools: dict[str, Any] = {}
        self._pools: dict[str, _Pool] = {}  # by pool name: where its objects live
        self._staging = threading.local()
        self._failing = False  # one warning per outage, not one per call
        self._refusals: set[str] = set()  # kinds of refusal already logged

    # -- registration -----------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        self._check_page_size(mem_pool_host, "kv")
        self.mem_pool_host = mem_pool_host
        self._pools.clear()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        self._check_page_size(host_pool, str(host_pool_name))
        self.registered_pools[str(host_pool_name)] = host_pool
        self._pools.pop(str(host_pool_name), None)

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

    def _kv(self, encoding: str) -> "_Pool":
        """The KV pool's place: `flat` pages (v0, v2) or `v1` regions; a namespace each (their bytes differ)."""
        name = f"kv:{encoding}"
        pool = self._pools.get(name)
        if pool is None:
            host = self.mem_pool_host if self.mem_pool_host is not None else self.registered_pools.get(str(PoolName.KV))
            layout = naming.pool_layout(host) if host is not None else {}
            identity = {"pool": "kv", "encoding": encoding, **layout,
                        **naming.ranks(self.storage_config, replicated=bool(self.storage_config.is_mla_model))}
            pool = self._pools[name] = _Pool(naming.namespace(self.model, identity, self.settings.salt), None,
                                             CLASS_KV)
        return pool

    def _side(self, pool_name: str) -> "_Pool":
        """A pool beside the KV (v2): in the flat KV namespace when sharded like it, else in its own."""
        pool = self._pools.get(pool_name)
        if pool is None:
            host = self.registered_pools.get(pool_name)
            layout = naming.pool_layout(host) if host is not None else {}
            object_class = CLASS_STATE if pool_name in STATE_POOLS else CLASS_KV
            if pool_name == PoolName.KV:
                return self._kv("flat")
            replicated_kv = bool(self.storage_config.is_mla_model)  # MLA / DeepSeek-V4: one KV for every TP rank
            if not replicated_kv or pool_name not in PER_RANK_POOLS:
                # Sharded like the KV (SGLang's file backend names them so too): in the KV's namespace, and a state
                # names its page's KV as parent.
                kv = self._kv("v1" if self.settings.interface_v1 else "flat")
                pool = _Pool(kv.namespace, naming.pool_digest(pool_name, layout), object_class)
            else:  # a Mamba state is TP-sharded even when the KV is replicated: its own namespace, by rank
                identity = {"pool": pool_name, **layout, **naming.ranks(self.storage_config, replicated=False)}
                pool = _Pool(naming.namespace(self.model, identity, self.settings.salt),
                             naming.pool_digest(pool_name, layout), object_class, shares_kv=False)
            self._pools[pool_name] = pool
        return pool

    # -- v0: flat pages as tensors ------------------------------------------------------------------------------------

    def get(self, key: str, target_location=None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @_answers(lambda self, keys, *rest, **kw: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        pool = self._kv("flat")
        if target_locations is None:
            found = self._guarded(lambda: self.client.get_many(pool.namespace, [pool.key(k) for k in keys]),
                                  [None] * len(keys))
            return [torch.frombuffer(bytearray(f.data), dtype=torch.uint8) if f is not None and f.data else None
                    for f in found]
        staged = [t if t.is_contiguous() else t.contiguous() for t in target_locations]
        fetched = self._fetch(pool, keys, [_tensor_bytes(t) for t in staged])
        for ok, target, page in zip(fetched, target_locations, staged):
            if ok and page is not target:  # received into a contiguous copy of a strided target
                target.copy_(page)
        return [t if ok else None for t, ok in zip(target_locations, fetched)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    @_answers(lambda self, *args, **kw: False)
    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None,
                  extra_info: HiCacheStorageExtraInfo | None = None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        return all(self._store(self._kv("flat"), keys, [_tensor_bytes(v) for v in values], extra_info))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_answers(lambda self, *args, **kw: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        pool = self._kv("v1" if self.settings.interface_v1 else "flat")
        where = self._guarded(lambda: self.client.locate(pool.namespace, [pool.key(k) for k in keys]),
                              [None] * len(keys))
        return _leading(tier is not None for tier in where)

    # -- v1: pages straight from and into the host pool's memory ------------------------------------------------------

    @_answers(lambda self, keys, *rest, **kw: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._regions(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        if all(len(regions) == 1 for regions in pages):  # each page one region: received in place
            return self._fetch(self._kv("v1"), keys, [_memory(*regions[0]) for regions in pages])
        staging = self._staging_buffers([sum(size for _, size in regions) for regions in pages])
        fetched = self._fetch(self._kv("v1"), keys, staging)
        for ok, regions, buffer in zip(fetched, pages, staging):
            if ok:
                _scatter(buffer, regions)
        return fetched

    @_answers(lambda self, keys, *rest, **kw: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages = self._regions(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        payloads = [_memory(*regions[0]) if len(regions) == 1 else _gather(regions) for regions in pages]
        return self._store(self._kv("v1"), keys, payloads, extra_info)

    def _regions(self, keys: list[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]] | None:
        """Per page, the (address, bytes) regions of the host pool that hold it, in the pool's own order."""
        if self.mem_pool_host is None or not keys:
            return None if self.mem_pool_host is None else []
        try:
            pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        except Exception as exc:  # noqa: BLE001 - a pool or index SGLang gave us that does not fit: a failed transfer
            self._log_once("regions", f"the host pool cannot describe these pages ({exc!r}); v1 transfers fail")
            return None
        per_page = len(pointers) // len(keys)
        if per_page * len(keys) != len(pointers):
            self._log_once("regions", f"{len(pointers)} regions for {len(keys)} pages; v1 transfers fail")
            return None
        return [list(zip(pointers[i * per_page:(i + 1) * per_page], sizes[i * per_page:(i + 1) * per_page]))
                for i in range(len(keys))]

    # -- v2: the pools of a hybrid model ------------------------------------------------------------------------------

    @_answers(lambda self, *args, **kw: PoolTransferResult(0, {}, []))
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """As SGLang's file backend answers: the leading run of KV pages, then per pool the prefixes it can restore
        (ALL_PAGES: every page up to there; TRAILING_PAGES: the last len(transfer.keys) pages), and the prefixes every
        pool can restore."""
        kv = self._kv("v1" if self.settings.interface_v1 else "flat")
        transfers = [t for t in pool_transfers or [] if t.hit_policy in (PoolHitPolicy.ALL_PAGES,
                                                                           PoolHitPolicy.TRAILING_PAGES)]
        if len(transfers) != len(pool_transfers or []):
            self._log_once("block-groups", "block-group pools (DeepSeek-V4) are not supported; they count as misses")
            return PoolTransferResult(0, {}, [])
        wanted = [(kv, keys)] + [(self._side(str(t.name)), keys) for t in transfers]
        present = self._guarded(lambda: self._present(wanted), None)
        if present is None:
            return PoolTransferResult(0, {}, [])
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

    def _present(self, wanted: list[tuple["_Pool", list[str]]]) -> list[list[bool]]:
        """Which of each pool's keys the server holds: one Exists call per namespace."""
        by_namespace: dict[str, list[bytes]] = {}
        for pool, keys in wanted:
            by_namespace.setdefault(pool.namespace, []).extend(pool.key(k) for k in keys)
        where = {ns: dict(zip(ks, self.client.locate(ns, ks))) for ns, ks in by_namespace.items()}
        return [[where[pool.namespace][pool.key(k)] is not None for k in keys] for pool, keys in wanted]

    @_answers(lambda self, transfers, *rest, **kw: _all_failed(transfers))
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        def read(pool: _Pool, host, keys: list[str], offsets: list[int]) -> list[bool]:
            pages = [torch.empty_like(host.get_dummy_flat_data_page()) for _ in keys]
            fetched = self._fetch(pool, keys, [_tensor_bytes(p) for p in pages])
            for ok, page, offset in zip(fetched, pages, offsets):
                if ok:
                    host.set_from_flat_data_page(offset, page)
            return fetched
        return self._per_transfer(transfers, read)

    @_answers(lambda self, transfers, *rest, **kw: _all_failed(transfers))
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        def write(pool: _Pool, host, keys: list[str], offsets: list[int]) -> list[bool]:
            payloads = [_tensor_bytes(host.get_data_page(offset, flat=True)) for offset in offsets]
            return self._store(pool, keys, payloads, extra_info)
        return self._per_transfer(transfers, write)

    def _per_transfer(self, transfers: list[PoolTransfer], move) -> dict[str, list[bool]]:
        """Per transfer: `move(pool, host pool, keys, host offsets)`, or all False when it does not fit its pool."""
        results = {}
        for transfer in transfers:
            host, keys, offsets = self._transfer_pages(transfer)
            results[transfer.name] = ([False] * len(keys) if offsets is None
                                      else move(self._side(str(transfer.name)), host, keys, offsets))
        return results

    def _transfer_pages(self, transfer: PoolTransfer):
        """(host pool, keys, the host offset of each key's page) — offsets None when the transfer does not fit its
        pool (SGLang's file backend refuses it the same way)."""
        keys = list(transfer.keys or [])
        host = self.registered_pools.get(str(transfer.name))
        if host is None:
            log.error("TierCacheStorage: no host pool registered as %s", transfer.name)
            return None, keys, None
        page_size = getattr(host, "page_size", 1) or 1
        indices = transfer.host_indices
        if indices is None or indices.numel() != len(keys) * page_size:
            log.error("TierCacheStorage: %s transfer of %d pages with %s host indices", transfer.name, len(keys),
                      None if indices is None else indices.numel())
            return host, keys, None
        return host, keys, [int(indices[i * page_size]) for i in range(len(keys))]

    # -- the rest of the interface ----------------------------------------------------------------------------------

    def clear(self) -> bool:
        log.warning("TierCacheStorage: clear() is not supported: the server's chunks are shared with other engines "
                    "(they age out by eviction; `tiercache` admin tools delete namespaces)")
        return False

    def get_stats(self):
        return None

    def close(self) -> None:
        self.client.close()

    # -- one path for every call ------------------------------------------------------------------------------------

    def _fetch(self, pool: "_Pool", keys: Sequence[str], buffers: list) -> list[bool]:
        """Read each key's object into its buffer; True where it came whole (a size that does not match the buffer
        is a miss: the namespace names the layout, so that is damage, never a page to use)."""
        fetched = self._guarded(lambda: self.client.get_many(pool.namespace, [pool.key(k) for k in keys], buffers),
                                [None] * len(keys))
        return [f is not None and len(f.data) == len(memoryview(b).cast("B")) for f, b in zip(fetched, buffers)]

    def _store(self, pool: "_Pool", keys: Sequence[str], payloads: list,
               extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        """Put objects; each page names the page before it as parent (the chain SGLang's hashes follow), a side
        pool's object its page's KV (when in the same namespace)."""
        # The pages before this batch, when SGLang passes them (hicache_storage_pass_prefix_keys): [] is a batch at
        # the prompt's start, None an unknown position.
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        chunks = []
        for index, (key, payload) in enumerate(zip(keys, payloads)):
            page = naming.page_key(key)
            if pool.side is not None:
                parent = page if pool.shares_kv else b""
            else:
                before = keys[index - 1] if index else (prefix[-1] if prefix else None)
                parent = naming.page_key(before) if before is not None else b""
            tokens = (len(prefix) + index + 1) * self._page_size() if prefix is not None else 0
            chunks.append(Chunk(pool.key(key), payload, ChunkMeta(pool.object_class, tokens, parent)))
        stored = self._guarded(lambda: self.client.put_many(pool.namespace, chunks), None)
        return [stored is not None] * len(keys)

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._refusals:
            self._refusals.add(kind)
            log.warning("TierCacheStorage: %s (logged once)", message)

    def _page_size(self) -> int:
        return int(getattr(self.mem_pool_host, "page_size", 0) or 0)

    def _guarded(self, call: Callable[[], T], failed: T) -> T:
        """Run a client call; on any error, log (once per outage) and answer `failed`: SGLang's threads never see
        an exception from us."""
        try:
            result = call()
        except CircuitOpen:
            return failed
        except Unavailable as exc:
            if not self._failing:
                log.warning("TierCacheStorage: the cache server did not answer (%s); pages are misses and writes "
                            "are dropped until it does", exc)
                self._failing = True
            return failed
        except TierCacheError as exc:  # refused (a salt the token does not own, a quota, a page that does not fit)
            kind = type(exc).__name__
            if kind not in self._refusals:
                self._refusals.add(kind)
                log.warning("TierCacheStorage: %s: %s (such calls are misses or dropped writes; logged once)", kind,
                            exc)
            return failed
        except Exception:  # noqa: BLE001 - a bug here must not take SGLang's storage thread down
            log.exception("TierCacheStorage: unexpected error")
            return failed
        if self._failing:
            log.info("TierCacheStorage: the cache server answers again")
            self._failing = False
        return result

    def _staging_buffers(self, sizes: list[int]) -> list[memoryview]:
        """Per-thread staging (reused: no allocation per call) for pages the host pool holds in several regions."""
        total = sum(sizes)
        buffer = getattr(self._staging, "buffer", None)
        if buffer is None or len(buffer) < total:
            buffer = self._staging.buffer = bytearray(total)
        view, views, start = memoryview(buffer), [], 0
        for size in sizes:
            views.append(view[start:start + size])
            start += size
        return views


@dataclass(frozen=True)
class _Pool:
    """Where one pool's objects live: a namespace, and for a side pool the digest its keys end with."""

    namespace: str
    side: bytes | None  # None: the KV pool (keys are SGLang's page keys)
    object_class: int
    shares_kv: bool = True  # a side pool in the KV's namespace (its objects' parent is their page's KV)

    def key(self, sglang_key: str) -> bytes:
        page = naming.page_key(sglang_key)
        return page if self.side is None else naming.component_key(page, self.side)


def _leading(flags) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, in place (SGLang's host pages are contiguous CPU tensors)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def _memory(address: int, size: int) -> memoryview:
    """Host-pool memory at a raw address, as a writable buffer (SGLang's get_page_buffer_meta regions)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _scatter(buffer: memoryview, regions: list[tuple[int, int]]) -> None:
    start = 0
    for address, size in regions:
        _memory(address, size)[:] = buffer[start:start + size]
        start += size


def _gather(regions: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(address, size) for address, size in regions)
