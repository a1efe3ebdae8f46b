"""SGLang's host memory pools as tiercache sees them: where each pool's pages live on the server (a namespace, and for
a pool beside the KV the digest its keys end with), and the pages' bytes in host memory (flat tensors, or the raw
regions SGLang's `get_page_buffer_meta` describes).

Nothing here talks to the server or decides what SGLang is answered: tiercache.connector.sglang.storage does that.
A pool or an index that does not fit raises PoolMismatch, which the backend's guard answers as a failed transfer.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer

from tiercache.connector.sglang import naming
from tiercache.record.encoding import CLASS_KV, CLASS_STATE

# Pools whose pages are recurrent states (the rest are KV-like pages). By value: PoolName hashes by its member name.
STATE_POOLS = {str(PoolName.MAMBA)}
PER_RANK_POOLS = {str(PoolName.MAMBA)}  # sharded by TP rank even in a model whose KV every rank holds whole


class PoolMismatch(Exception):
    """A pool, or the pages of one call, that does not fit what SGLang registered: the call's transfers fail.
    `kind` names the mismatch, so the guard logs each kind once."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PoolPlace:
    """Where one pool's objects live: a namespace, and for a side pool the digest its keys end with."""

    namespace: str
    side: bytes | None  # None: the KV pool (keys are SGLang's page keys)
    object_class: int
    shares_kv: bool = True  # a side pool in the KV's namespace (its objects' parent is their page's KV)

    def key(self, sglang_key: str) -> bytes:
        page = naming.page_key(sglang_key)
        return page if self.side is None else naming.component_key(page, self.side)

    def parent(self, keys: list[str], index: int, prefix: list[str] | None) -> bytes:
        """The parent of `keys[index]`'s object: a KV page names the page before it (the chain SGLang's hashes
        follow; `prefix`: the pages before this batch, when SGLang passes them), a side pool's object its page's KV
        when they share a namespace; b"" when unknown."""
        if self.side is not None:
            return naming.page_key(keys[index]) if self.shares_kv else b""
        before = keys[index - 1] if index else (prefix[-1] if prefix else None)
        return naming.page_key(before) if before is not None else b""


class HostPools:
    """The host pools SGLang registered and the place of each on the server (built on first use: SGLang registers
    its pools after creating the backend)."""

    def __init__(self, model: str, config: HiCacheStorageConfig, salt: str, interface_v1: bool) -> None:
        self.model = model
        self.config = config
        self.salt = salt
        self.interface_v1 = interface_v1
        self.kv_host = None  # register_mem_pool_host's pool (v0 / v1)
        self.registered: dict[str, Any] = {}  # register_mem_host_pool_v2's pools, by name
        self._places: dict[str, PoolPlace] = {}
        self._lock = threading.Lock()  # SGLang's prefetch and backup threads both look places up

    def register_kv(self, host) -> None:
        with self._lock:
            self.kv_host = host
            self._places.clear()

    def register(self, name: str, host) -> None:
        with self._lock:
            self.registered[name] = host
            self._places.pop(name, None)

    @property
    def page_size(self) -> int:
        return int(getattr(self.kv_host, "page_size", 0) or 0)

    @property
    def probed_kv(self) -> PoolPlace:
        """The KV place `batch_exists` probes: the one SGLang writes pages to (v1 regions or flat pages)."""
        return self.kv("v1" if self.interface_v1 else "flat")

    def kv(self, encoding: str) -> PoolPlace:
        """The KV pool's place: `flat` pages (v0, v2) or `v1` regions; a namespace each (their bytes differ)."""
        name = f"kv:{encoding}"
        with self._lock:
            place = self._places.get(name)
            if place is None:
                host = self.kv_host if self.kv_host is not None else self.registered.get(str(PoolName.KV))
                layout = naming.pool_layout(host) if host is not None else {}
                identity = {"pool": "kv", "encoding": encoding, **layout,
                            **naming.ranks(self.config, replicated=bool(self.config.is_mla_model))}
                place = self._places[name] = PoolPlace(naming.namespace(self.model, identity, self.salt), None,
                                                       CLASS_KV)
            return place

    def side(self, pool_name: str) -> PoolPlace:
        """A pool beside the KV (v2): in the KV's namespace when sharded like it, else in its own."""
        if pool_name == PoolName.KV:
            return self.kv("flat")
        with self._lock:
            place = self._places.get(pool_name)
        if place is not None:
            return place
        host = self.registered.get(pool_name)
        layout = naming.pool_layout(host) if host is not None else {}
        object_class = CLASS_STATE if pool_name in STATE_POOLS else CLASS_KV
        replicated_kv = bool(self.config.is_mla_model)  # MLA / DeepSeek-V4: one KV for every TP rank
        if not replicated_kv or pool_name not in PER_RANK_POOLS:
            # Sharded like the KV (SGLang's file backend names them so too): in the KV's namespace, and a state names
            # its page's KV as parent.
            place = PoolPlace(self.probed_kv.namespace, naming.pool_digest(pool_name, layout), object_class)
        else:  # a Mamba state is TP-sharded even when the KV is replicated: its own namespace, by rank
            identity = {"pool": pool_name, **layout, **naming.ranks(self.config, replicated=False)}
            place = PoolPlace(naming.namespace(self.model, identity, self.salt), naming.pool_digest(pool_name, layout),
                              object_class, shares_kv=False)
        with self._lock:
            return self._places.setdefault(pool_name, place)

    def regions(self, keys: list[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Per page, the (address, bytes) regions of the KV host pool that hold it, in the pool's own order (v1)."""
        if self.kv_host is None:
            raise PoolMismatch("no-kv-pool", "no KV host pool is registered; v1 transfers fail")
        if not keys:
            return []
        try:
            pointers, sizes = self.kv_host.get_page_buffer_meta(host_indices)
        except Exception as exc:  # noqa: BLE001 - a pool or index SGLang gave us that does not fit: a failed transfer
            raise PoolMismatch("regions", f"the host pool cannot describe these pages ({exc!r}); v1 transfers "
                                          "fail") from exc
        per_page = len(pointers) // len(keys)
        if per_page * len(keys) != len(pointers):
            raise PoolMismatch("regions", f"{len(pointers)} regions for {len(keys)} pages; v1 transfers fail")
        return [list(zip(pointers[i * per_page:(i + 1) * per_page], sizes[i * per_page:(i + 1) * per_page]))
                for i in range(len(keys))]

    def transfer_pages(self, transfer: PoolTransfer) -> "TransferPages":
        """The host pool, keys and host offset of each key's page of a v2 transfer; PoolMismatch when it does not fit
        its pool (SGLang's file backend refuses it the same way)."""
        keys = list(transfer.keys or [])
        host = self.registered.get(str(transfer.name))
        if host is None:
            raise PoolMismatch(f"unregistered:{transfer.name}", f"no host pool registered as {transfer.name}")
        page_size = getattr(host, "page_size", 1) or 1
        indices = transfer.host_indices
        if indices is None or indices.numel() != len(keys) * page_size:
            count = None if indices is None else indices.numel()
            raise PoolMismatch(f"indices:{transfer.name}",
                               f"a {transfer.name} transfer of {len(keys)} pages with {count} host indices")
        return TransferPages(host, keys, [int(indices[i * page_size]) for i in range(len(keys))])


class TransferPages(NamedTuple):
    """A v2 transfer's pages in its host pool."""

    host: Any  # SGLang's host pool
    keys: list[str]
    offsets: list[int]  # the host offset of each key's page


class Staging:
    """Per-thread staging, reused (no allocation per call), for pages the host pool holds in several regions."""

    def __init__(self) -> None:
        self._local = threading.local()

    def buffers(self, sizes: list[int]) -> list[memoryview]:
        total = sum(sizes)
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < total:
            buffer = self._local.buffer = bytearray(total)
        view, views, start = memoryview(buffer), [], 0
        for size in sizes:
            views.append(view[start:start + size])
            start += size
        return views


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, in place (SGLang's host pages are contiguous CPU tensors)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def memory(address: int, size: int) -> memoryview:
    """Host-pool memory at a raw address, as a writable buffer (SGLang's get_page_buffer_meta regions)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def scatter(buffer: memoryview, regions: list[tuple[int, int]]) -> None:
    start = 0
    for address, size in regions:
        memory(address, size)[:] = buffer[start:start + size]
        start += size


def gather(regions: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(address, size) for address, size in regions)
