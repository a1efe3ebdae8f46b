"""Faults a test plants in an engine process, one at a time, to show that each gate of the real-engine tests fails
on the faults it is meant to catch (tests/sglang_engine/test_planted_faults.py). Nothing here changes tiercache: the
harness wraps TierCacheStorage's load calls in the engine's process, as it patches SGLang, and a fault stays off until
a test plants it (Scheduler RPC `harness_plant`); it then fires once, in the next load of its kind from storage,
and is off again. `harness_fired` answers which faults fired since it was last asked (a test checks that the fault
it planted did, so a gate that passes was not merely spared).

Each fault is a thing a storage backend could get wrong after its own checks passed (the server's checksums, the
sizes the backend checks):
- swapped_pages: two KV pages (the second and third of a load) land in each other's host-pool places;
- previous_state: the Mamba state stored for an earlier boundary of the same prompt is loaded for the hit's boundary
  (hybrids; the earlier state's size is the same, so no size check can see it);
- flipped_bit_kv / flipped_bit_state / flipped_bit_recurrent: after the load returned (its checksum verified), one
  bit flips in a KV page / a Mamba state (its conv windows and recurrent state) / its recurrent state alone: the top
  mantissa bit of the largest value there (a change of a quarter to a half of it);
- longer_hit: the hit's last token is reported loaded but never was: its KV stays as a fresh pool holds it (zeros).
"""

from __future__ import annotations

import sys
import threading

from sglang_cpu import patches

FAULTS = ("swapped_pages", "previous_state", "flipped_bit_kv", "flipped_bit_state", "flipped_bit_recurrent",
          "longer_hit")

_lock = threading.Lock()
_planted: str | None = None
_fired: list[str] = []
_hit_keys: list[str] = []  # the page keys of the last storage hit query (batch_exists_v2): the prompt's boundaries


def _take(fault: str) -> bool:
    """True once for a planted `fault` (it is then off, and listed as fired)."""
    global _planted
    with _lock:
        if _planted != fault:
            return False
        _planted = None
        _fired.append(fault)
        return True


_TOP_MANTISSA_BIT = {"torch.float32": (22, "int32"), "torch.bfloat16": (6, "int16"), "torch.float16": (9, "int16")}


def _flip_largest(values) -> None:
    """Flip, in place, the top mantissa bit of the largest-magnitude value of a float tensor."""
    import torch

    bit, integer = _TOP_MANTISSA_BIT[str(values.dtype)]
    flat = values.view(-1)
    index = int(flat.float().abs().argmax())
    flat.view(getattr(torch, integer))[index] ^= 1 << bit


def _after_get_v1(backend, keys, host_indices, fetched: list[bool]) -> None:
    """Faults in a v1 load of KV pages, applied to the host pool's memory the load wrote."""
    from tiercache.connector.sglang import pools

    loaded = [i for i, ok in enumerate(fetched) if ok]
    if not loaded:
        return
    regions = backend.pools.regions(keys, host_indices)
    if len(loaded) >= 3 and _take("swapped_pages"):
        first, second = (pools.gather(regions[i]) for i in loaded[1:3])
        pools.scatter(memoryview(second), regions[loaded[1]])
        pools.scatter(memoryview(first), regions[loaded[2]])
    if _take("flipped_bit_kv"):
        import torch

        middle = regions[loaded[len(loaded) // 2]]
        page = bytearray(pools.gather(middle))
        _flip_largest(torch.frombuffer(page, dtype=backend.pools.kv_host.dtype))
        pools.scatter(memoryview(page), middle)
    if _take("longer_hit"):
        _zero_last_token(backend, regions[loaded[-1]])


def _zero_last_token(backend, regions: list[tuple[int, int]]) -> None:
    """The page's last token in every layer, zeroed: in the page_first_direct layout a page is [layers, page_size,
    ...] per region (K, then V), so the token is the last 1/page_size of each layer's run."""
    from tiercache.connector.sglang import pools

    host = backend.pools.kv_host
    assert host.layout == "page_first_direct", f"longer_hit is planted in page_first_direct pools only ({host.layout})"
    page_size, layers = host.page_size, host.layer_num
    for address, size in regions:
        per_layer = size // layers
        token = per_layer // page_size
        for layer in range(layers):
            pools.memory(address + (layer + 1) * per_layer - token, token)[:] = bytes(token)


def _previous_boundary(backend, transfer) -> list[str] | None:
    """The key of the latest page before the transfer's boundary that has a state of this pool stored, as a
    one-key transfer list; None when there is none."""
    keys = list(transfer.keys or [])
    if len(keys) != 1 or keys[0] not in _hit_keys:
        return None
    boundary = _hit_keys.index(keys[0])
    present = backend._present([(backend.pools.side(str(transfer.name)), _hit_keys[:boundary])])[0]
    stored = [page for page, has in enumerate(present) if has]
    if not stored:
        return None
    # (the engine's log says which: the tests' report names the boundaries)
    print(f"harness fault previous_state: the {transfer.name} state stored at page {stored[-1]} loaded for the one "
          f"at page {boundary}", file=sys.stderr, flush=True)
    return [_hit_keys[stored[-1]]]


def _flip_in_state(backend, host, transfer) -> None:
    """flipped_bit_state: in the largest value of the state's tensors (its conv windows and recurrent state);
    flipped_bit_recurrent: in the largest value of its recurrent state alone."""
    assert host.layout.startswith("page_first"), host.layout  # a slot's state: one contiguous row per tensor
    _, _, offsets = backend.pools.transfer_pages(transfer)
    slot = offsets[-1]
    if _take("flipped_bit_recurrent"):
        _flip_largest(host.temporal_buffer[slot])
    elif _take("flipped_bit_state"):
        tensors = [host.temporal_buffer[slot], *(conv[slot] for conv in host.conv_buffer)]
        _flip_largest(max(tensors, key=lambda t: float(t.float().abs().max())))


@patches("tiercache.connector.sglang.storage")
def _plantable(module) -> None:
    import dataclasses

    storage = module.TierCacheStorage
    get_v1, get_v2, exists_v2 = storage.batch_get_v1, storage.batch_get_v2, storage.batch_exists_v2

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        fetched = get_v1(self, keys, host_indices, extra_info)
        if _planted is not None:
            _after_get_v1(self, keys, host_indices, fetched)
        return fetched

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        _hit_keys[:] = list(keys)
        return exists_v2(self, keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers, extra_info=None):
        transfers = list(transfers)
        if _planted == "previous_state":
            for index, transfer in enumerate(transfers):
                earlier = _previous_boundary(self, transfer)
                if earlier is not None and _take("previous_state"):
                    transfers[index] = dataclasses.replace(transfer, keys=earlier)
        results = get_v2(self, transfers, extra_info)
        if _planted in ("flipped_bit_state", "flipped_bit_recurrent"):
            for transfer in transfers:
                fetched = results.get(transfer.name) or []
                host = self.pools.registered.get(str(transfer.name))
                if fetched and all(fetched) and hasattr(host, "temporal_buffer"):
                    _flip_in_state(self, host, transfer)
        return results

    storage.batch_get_v1, storage.batch_get_v2, storage.batch_exists_v2 = batch_get_v1, batch_get_v2, batch_exists_v2


@patches("sglang.srt.managers.scheduler")
def _plant_rpc(module) -> None:
    module.Scheduler.harness_plant = harness_plant
    module.Scheduler.harness_fired = harness_fired


def harness_plant(self, fault: str) -> None:
    """Scheduler RPC: plant `fault` for the next load of its kind (one at a time)."""
    global _planted
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
    with _lock:
        _planted = fault


def harness_fired(self, path: str) -> None:
    """Scheduler RPC: write the faults that fired since the last call (JSON list) to `path`; unplant any other."""
    import json

    global _planted
    with _lock:
        fired, _fired[:], _planted = list(_fired), [], None
    with open(path, "w") as out:
        json.dump(fired, out)
