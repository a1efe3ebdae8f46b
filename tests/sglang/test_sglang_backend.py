"""tiercache's HiCache storage backend against SGLang's real code: created by SGLang's StorageBackendFactory, held
to the answers of SGLang's own file backend (HiCacheFile) on the same call sequences, with SGLang's real host memory
pools (MHA, MLA, Mamba; built on the CPU without pinned memory) for the v1 and v2 paths, and a real server."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from tests.certs import make_pki
from tiercache.client import Client
from tiercache.config import SecurityConfig
from tiercache.connector.sglang import SGLangSettings, TierCacheStorage
from tiercache.errors import InvalidArgument
from tiercache.process import ServerProcess
from tiercache.record.keys import salt_suffix

PAGE = 4
FACTORY = {"backend_name": "tiercache", "module_path": "tiercache.connector.sglang", "class_name": "TierCacheStorage"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--host-mem", "256MiB", "--disk-size", "0").start()
    yield proc
    proc.kill()


def storage_config(model: str, extra: dict | None = None, **fields) -> HiCacheStorageConfig:
    values = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=True, model_name=model, extra_config=extra)
    return HiCacheStorageConfig(**{**values, **fields})


def tiercache_backend(server_url: str, model: str, **extra) -> TierCacheStorage:
    config = storage_config(model, {**FACTORY, "url": server_url, "timeout_s": 5, **extra})
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, TierCacheStorage)
    return backend


def file_backend(tmp_path, model: str) -> HiCacheFile:
    return HiCacheFile(storage_config(model, {"file_storage_path": str(tmp_path / "hicache")}))


def page_keys(seed: int, pages: int) -> list[str]:
    """Page hashes as SGLang computes them for a prompt (a SHA-256 chain per page)."""
    return get_storage_hash_str([seed * 1000 + i for i in range(pages * PAGE)], None, page_size=PAGE)


def mha_host(layout: str = "page_first") -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=8, layer_num=3,
                              device="cpu", enable_memory_saver=False, start_layer=0, end_layer=2)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=0, end_layer=2)


def mla_host() -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(size=64, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
                              layer_num=2, device="cpu", enable_memory_saver=False, start_layer=0, end_layer=1)
    info = device.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=0, end_layer=1, target_layer_num=2)


def mamba_host() -> MambaPoolHost:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 5, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, 5, 16, 3, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=5, pin_memory=False, device="cpu", layout="page_first")


def fill(host, indices: torch.Tensor, seed: int) -> None:
    """Random bytes in the host pool's slots for `indices` (whole pages), as a forward pass would leave them."""
    generator = torch.Generator().manual_seed(seed)
    page = getattr(host, "page_size", 1) or 1
    for start in range(0, len(indices), page):
        offset = int(indices[start])
        flat = host.get_data_page(offset, flat=True)
        noise = torch.randint(0, 255, (flat.numel() * flat.element_size(),), generator=generator, dtype=torch.uint8)
        host.set_from_flat_data_page(offset, noise.view(flat.dtype).reshape(flat.shape))


def pages_of(host, indices: torch.Tensor) -> list[bytes]:
    page = getattr(host, "page_size", 1) or 1
    return [bytes(host.get_data_page(int(indices[i]), flat=True).contiguous().view(torch.uint8).numpy())
            for i in range(0, len(indices), page)]


# -- created by SGLang ----------------------------------------------------------------------------------------------

def test_sglangs_factory_creates_the_backend_and_refuses_unknown_keys(server):
    backend = tiercache_backend(server.url, "factory/model")
    assert backend.settings.connection.url == server.url and backend.model == "factory/model"
    backend.close()
    with pytest.raises(ValueError, match="colour"):
        StorageBackendFactory.create_backend("dynamic", storage_config("m", {**FACTORY, "colour": "red"}), None)
    with pytest.raises(ValueError, match="backend_name"):  # SGLang's own check, before ours
        StorageBackendFactory.create_backend("dynamic", storage_config("m", {"module_path": "tiercache"}), None)


# -- the same answers as SGLang's file backend ----------------------------------------------------------------------

def v0_transcript(backend, keys: list[str]) -> list:
    """A v0 call sequence as SGLang's generic path makes it; what each call answered."""
    values = [torch.arange(24, dtype=torch.float16) + i for i in range(len(keys))]
    out = []
    out.append(backend.batch_exists(keys))
    out.append(backend.set(keys[0], values[0]))
    out.append(backend.batch_set(keys[1:3], values[1:3]))
    out.append(backend.exists(keys[0]))
    out.append(backend.exists(keys[3]))
    out.append(backend.batch_exists(keys))
    out.append(backend.batch_exists([keys[3], keys[0]]))
    target = torch.zeros(24, dtype=torch.float16)
    got = backend.get(keys[1], target)
    out.append((got is target, target.tolist()))
    out.append(backend.get(keys[3], torch.zeros(24, dtype=torch.float16)))
    targets = [torch.zeros(24, dtype=torch.float16) for _ in keys]
    out.append([None if t is None else t.tolist() for t in backend.batch_get(keys, targets)])
    return out


def test_v0_answers_like_the_file_backend(server, tmp_path):
    keys = page_keys(1, 4)
    ours = tiercache_backend(server.url, "contract/v0")
    expected = v0_transcript(file_backend(tmp_path, "contract/v0"), keys)
    assert v0_transcript(ours, keys) == expected
    assert expected[5] == 3 and expected[6] == 0  # the leading run, as SGLang uses it
    ours.close()


def generic_path_transcript(backend, host, keys: list[str]) -> tuple[list, list[bytes]]:
    """The controller's generic page path (no v1): batch_set of host pages, batch_get into dummy pages copied into
    fresh host slots; the answers and the pages read back."""
    backend.register_mem_pool_host(host)
    written = host.alloc(len(keys) * PAGE)
    fill(host, written, seed=7)
    data = [host.get_data_page(int(written[i * PAGE])) for i in range(len(keys) - 1)]  # the last page not saved
    answers = [backend.batch_set(keys[:-1], data), backend.batch_exists(keys)]
    read = host.alloc(len(keys) * PAGE)
    pages = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    answers.append([page is not None for page in pages])
    for i, page in enumerate(pages):
        if page is None:
            break
        host.set_from_flat_data_page(int(read[i * PAGE]), page)
    n = sum(page is not None for page in pages)
    assert pages_of(host, read[:n * PAGE]) == pages_of(host, written[:n * PAGE])
    return answers, pages_of(host, read[:n * PAGE])


def test_generic_page_path_with_a_real_host_pool_answers_like_the_file_backend(server, tmp_path):
    keys = page_keys(2, 4)
    file_answers, file_pages = generic_path_transcript(file_backend(tmp_path, "contract/generic"), mha_host(), keys)
    ours = tiercache_backend(server.url, "contract/generic")
    our_answers, our_pages = generic_path_transcript(ours, mha_host(), keys)
    assert our_answers == file_answers == [True, 3, [True, True, True, False]]
    assert our_pages == file_pages and len(our_pages) == 3
    ours.close()


def v2_transcript(backend, kv, mamba, keys: list[str]) -> list:
    """A hybrid model's v2 sequence: KV pages and one Mamba state (at the end of page 1) saved, then the existence
    query SGLang makes (Mamba: the last hit page only), then reads into fresh slots."""
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    kv_slots, state_slot = kv.alloc(len(keys) * PAGE), mamba.alloc(1)
    fill(kv, kv_slots, seed=11)
    fill(mamba, state_slot, seed=12)
    trailing = [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    out = [backend.batch_exists_v2(keys, trailing)]
    out.append(backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=kv_slots, keys=keys)]))
    out.append(backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state_slot, keys=[keys[1]],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]))
    out.append(backend.batch_exists_v2(keys, trailing))
    out.append(backend.batch_exists_v2(keys, None))
    all_pages = [PoolTransfer(name=PoolName.MAMBA, keys=list(keys), hit_policy=PoolHitPolicy.ALL_PAGES)]
    out.append(backend.batch_exists_v2(keys, all_pages))
    read_state, read_kv = mamba.alloc(1), kv.alloc(2 * PAGE)
    out.append(backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=read_state, keys=[keys[1]]),
                                     PoolTransfer(name=PoolName.KV, host_indices=read_kv, keys=keys[:2])]))
    out.append(pages_of(mamba, read_state) == pages_of(mamba, state_slot))
    out.append(pages_of(kv, read_kv) == pages_of(kv, kv_slots[:2 * PAGE]))
    out.append(backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(1), keys=[keys[2]])]))
    out.append(backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=kv.alloc(PAGE), keys=keys[:2])]))
    return out


def test_v2_hybrid_pools_answer_like_the_file_backend(server, tmp_path):
    keys = page_keys(3, 4)
    expected = v2_transcript(file_backend(tmp_path, "contract/v2"), mha_host(), mamba_host(), keys)
    ours = tiercache_backend(server.url, "contract/v2")
    assert v2_transcript(ours, mha_host(), mamba_host(), keys) == expected
    assert expected[3].kv_hit_pages == 2 and expected[3].restorable_prefix_pages == [2]  # the state's page
    assert expected[7] is True and expected[8] is True
    ours.close()


def test_mamba_states_are_state_objects_whose_parent_is_their_page(server):
    backend = tiercache_backend(server.url, "objects/v2")
    kv, mamba = mha_host(), mamba_host()
    keys = page_keys(4, 2)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    slots, state = kv.alloc(2 * PAGE), mamba.alloc(1)
    backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=slots, keys=keys)])
    backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state, keys=[keys[1]])])
    stats = Client.from_url(server.url).stats()
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert host["state_chunks"] >= 1
    side = backend.pools.side(str(PoolName.MAMBA))
    assert side.namespace == backend.pools.kv("flat").namespace and side.shares_kv
    backend.close()


# -- v1: zero copy between the host pool and the server ----------------------------------------------------------

@pytest.mark.parametrize("make_host", [lambda: mha_host("page_first"), lambda: mha_host("layer_first"), mla_host],
                         ids=["mha-page-first", "mha-layer-first", "mla"])
def test_v1_pages_round_trip_through_the_host_pools_memory(server, make_host):
    host = make_host()
    backend = tiercache_backend(server.url, f"v1/{type(host).__name__}/{host.layout}", interface_v1=1)
    backend.register_mem_pool_host(host)
    keys = page_keys(5, 4)
    written = host.alloc(len(keys) * PAGE)
    fill(host, written, seed=21)
    assert backend.batch_set_v1(keys[:3], written[:3 * PAGE]) == [True] * 3
    assert backend.batch_exists(keys) == 3
    read = host.alloc(len(keys) * PAGE)
    assert backend.batch_get_v1(keys, read) == [True, True, True, False]
    assert pages_of(host, read[:3 * PAGE]) == pages_of(host, written[:3 * PAGE])
    # v1 pages are a namespace of their own: SGLang's flat pages of the same keys are not them
    assert backend.batch_get(keys[:1], [host.get_dummy_flat_data_page()]) == [None]
    backend.close()


# -- namespaces: everything that changes the bytes ----------------------------------------------------------------

def test_pages_are_kept_apart_by_model_rank_layout_and_salt_and_found_again_after_a_restart(server):
    keys = page_keys(6, 2)
    value = [torch.arange(24, dtype=torch.float16)] * 2
    first = tiercache_backend(server.url, "names/model")
    assert first.batch_set(keys, value)
    others = [
        tiercache_backend(server.url, "names/other-model"),
        TierCacheStorage(storage_config("names/model", {**FACTORY, "url": server.url}, tp_rank=1, tp_size=2)),
        tiercache_backend(server.url, "names/model", salt="a-tenant-salt"),
    ]
    assert [other.batch_exists(keys) for other in others] == [0, 0, 0]
    layout = tiercache_backend(server.url, "names/model")
    layout.register_mem_pool_host(mha_host("layer_first"))  # the same model with its pages laid out otherwise
    assert layout.batch_exists(keys) == 0
    again = tiercache_backend(server.url, "names/model")  # a restarted engine, same configuration
    assert again.batch_exists(keys) == 2
    assert others[2].pools.kv("flat").namespace.endswith(salt_suffix("a-tenant-salt"))
    for backend in (first, *others, layout, again):
        backend.close()


def test_a_stored_page_of_another_size_is_a_miss_never_part_of_a_page(server):
    backend = tiercache_backend(server.url, "names/size")
    keys = page_keys(10, 1)
    assert backend.set(keys[0], torch.arange(24, dtype=torch.float16))
    for size in (12, 48):  # smaller and larger than what is stored
        target = torch.full((size,), -1, dtype=torch.float16)
        assert backend.get(keys[0], target) is None
    assert backend.get(keys[0], torch.zeros(24, dtype=torch.float16)) is not None
    backend.close()


def test_with_a_replicated_kv_only_mamba_states_are_kept_per_rank(server):
    def rank(r: int) -> TierCacheStorage:
        return TierCacheStorage(storage_config("mla/model", {**FACTORY, "url": server.url}, is_mla_model=True,
                                               tp_rank=r, tp_size=2))
    rank0, rank1 = rank(0), rank(1)
    kv = rank0.pools.kv("flat").namespace
    assert rank1.pools.kv("flat").namespace == kv  # written by one rank, read by all (SGLang's writer rank)
    assert rank0.pools.side(str(PoolName.SWA)).namespace == rank1.pools.side(str(PoolName.SWA)).namespace == kv
    assert rank0.pools.side(str(PoolName.MAMBA)).namespace != rank1.pools.side(str(PoolName.MAMBA)).namespace
    for backend in (rank0, rank1):
        backend.close()


class _PoolWithoutFlatPages:
    """Fault injection: a host pool SGLang could register whose pages have no flat form."""

    page_size = 1

    def get_dummy_flat_data_page(self):
        raise NotImplementedError("no flat pages")

    def get_data_page(self, index, flat=True):
        raise NotImplementedError("no flat pages")


def test_no_exception_reaches_sglang_from_a_pool_that_does_not_fit(server):
    backend = tiercache_backend(server.url, "broken/pool")
    backend.register_mem_host_pool_v2(_PoolWithoutFlatPages(), PoolName.SWA)
    transfer = PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0]), keys=page_keys(11, 1))
    assert backend.batch_get_v2([transfer]) == {PoolName.SWA: [False]}
    assert backend.batch_set_v2([transfer]) == {PoolName.SWA: [False]}
    assert backend.batch_get_v1(page_keys(11, 1), torch.arange(PAGE)) == [False]  # no host pool registered
    backend.close()


def test_prefix_keys_give_positions_and_parents(server):
    backend = tiercache_backend(server.url, "names/prefix")
    keys = page_keys(7, 3)
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:1])
    assert backend.batch_set(keys[1:], [torch.zeros(8, dtype=torch.float16)] * 2, extra_info=info)
    assert backend.batch_exists(keys[1:]) == 2
    backend.close()


# -- a cache that is down never breaks SGLang ------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_pool_whose_pages_the_server_would_refuse_is_refused_when_sglang_registers_it():
    """The one refusal the backend makes: at SGLang's start, in one line naming the flag, instead of every
    later write being dropped with a refusal in the log. Pools whose pages fit are registered as before."""
    kv, mamba = mha_host(), mamba_host()
    sizes = {name: page.numel() * page.element_size()
             for name, page in (("kv", kv.get_dummy_flat_data_page()), ("mamba", mamba.get_dummy_flat_data_page()))}
    limit = sizes["kv"] - 1
    with ServerProcess("--host-mem", "16MiB", "--disk-size", "0", "--max-chunk-size", str(limit)) as small:
        backend = tiercache_backend(small.url, "small/limit")
        with pytest.raises(InvalidArgument) as refused:
            backend.register_mem_pool_host(kv)
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"TierCacheStorage: a kv page of small/limit is {sizes['kv']} B")
        assert "`tiercache serve --max-chunk-size 1MiB` (server.max_chunk_bytes)" in str(refused.value)
        if sizes["mamba"] <= limit:
            backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backend.close()


def test_a_dead_server_gives_misses_and_false_never_an_exception(caplog):
    backend = tiercache_backend(f"grpc://127.0.0.1:{_closed_port()}", "dead/model", interface_v1=1,
                                timeout_s=0.5)
    kv, mamba = mha_host(), mamba_host()
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    keys = page_keys(8, 2)
    slots = kv.alloc(2 * PAGE)
    trailing = [PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        for _ in range(20):  # after the first failure the breaker answers at once
            assert backend.batch_exists(keys) == 0
            assert backend.get(keys[0], torch.zeros(24, dtype=torch.float16)) is None
            assert backend.set(keys[0], torch.zeros(24, dtype=torch.float16)) is False
            assert backend.batch_get_v1(keys, slots) == [False, False]
            assert backend.batch_set_v1(keys, slots) == [False, False]
            assert backend.batch_exists_v2(keys, trailing).kv_hit_pages == 0
            assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=slots, keys=keys)]) == {
                PoolName.KV: [False, False]}
            assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(1),
                                                      keys=[keys[0]])]) == {PoolName.MAMBA: [False]}
        elapsed = time.monotonic() - started
    warnings = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warnings) <= 1  # once per outage, not once per call
    assert elapsed < 60  # 160 calls; without the breaker each would wait out its retries (a loose bound, not a timing)
    backend.close()


def test_a_tenant_salt_on_a_server_with_tenants(tmp_path):
    token, salt = "sglang-tenant-token-0123456789", "sglang-tenant-salt"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  engines:\n    token_sha256: {hashlib.sha256(token.encode()).hexdigest()}\n"
                       f"    salt: {salt}\n")
    proc = ServerProcess("--host-mem", "64MiB", "--disk-size", "0", "--tenants-file", str(tenants)).start()
    try:
        keys = page_keys(9, 2)
        value = [torch.arange(24, dtype=torch.float16)] * 2
        good = tiercache_backend(proc.url, "tenant/model", token=token, salt=salt)
        assert good.batch_set(keys, value) and good.batch_exists(keys) == 2
        unsalted = tiercache_backend(proc.url, "tenant/model", token=token)  # refused by the server: a miss
        assert unsalted.batch_exists(keys) == 0 and unsalted.batch_set(keys, value) is False
        for backend in (good, unsalted):
            backend.close()
    finally:
        proc.kill()


def test_mutual_tls_from_the_extra_config(start_server, tmp_path):
    """The connection keys are every connector's (tiercache.client.settings), client certificates included."""
    pki = make_pki(tmp_path)
    server = start_server(security=SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                                                  tls_client_ca_file=pki.ca))
    keys = page_keys(11, 2)
    value = [torch.arange(24, dtype=torch.float16)] * 2
    certified = tiercache_backend(server.url, "mtls/model", tls_ca_file=pki.ca, tls_cert_file=pki.client_cert,
                                  tls_key_file=pki.client_key)
    assert certified.batch_set(keys, value) and certified.batch_exists(keys) == 2
    anonymous = tiercache_backend(server.url, "mtls/model", tls_ca_file=pki.ca)  # no handshake: a miss
    assert anonymous.batch_exists(keys) == 0
    for backend in (certified, anonymous):
        backend.close()


def test_settings_take_sglangs_keys_and_ours():
    settings = SGLangSettings.from_extra_config(
        {**FACTORY, "interface_v1": 1, "file_storage_path": "/x", "url": "grpc://h:1", "salt": "s", "timeout_s": 2})
    assert settings.connection.url == "grpc://h:1" and settings.interface_v1 and settings.salt == "s"


def test_the_benchmark_script_runs():
    from tests.helpers import python_env
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "benchmarks.sglang_storage_calls", "--pages", "8",
                             "--page-tokens", "4", "--layers", "2", "--heads", "2", "--head-dim", "8", "--rounds", "1",
                             "--json"], capture_output=True, text=True, env=python_env(), cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert all(report[name]["get_gbps"] > 0 for name in ("file", "tiercache_v0", "tiercache_v1"))
