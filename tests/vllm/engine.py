"""A vLLM engine on the CPU for the connector tests: vLLM's real v1 Scheduler and KVCacheManager (a
HybridKVCacheCoordinator over a full-attention group and a Gated-DeltaNet Mamba group, align mode), our connector in
both roles, the per-layer cache tensors vLLM's own `allocate_kv_cache` lays out, and a stand-in for the forward pass.

vLLM cannot run a model on this machine (no compiled CPU ops), so `Forward` plays the model runner: it writes the KV
and recurrent state a real forward pass would leave, each a deterministic function of the token prefix, where vLLM's
conventions put them (KV at the request's slots; in align mode the state after t tokens in Mamba block (t-1)//B).
Before each pass it checks what it reads: the KV of every earlier token and the state it continues from must be
exactly what a full recompute would have left. A wrong load therefore fails the test at the step that would have
produced wrong logits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from transformers import Qwen3NextConfig  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace  # noqa: E402

from tiercache.connector.vllm.connector import TierCacheConnector  # noqa: E402

BLOCK = 32  # N: one attention page (32 tokens x 1 head x 16 x 2 x fp32 = 4 KiB) holds one GDN state (3.1 KiB)
HASH_BLOCK = 16  # vLLM's prefix_match_unit: its own prefix cache hits land on multiples of 16
ATTENTION = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
GDN = ("model.layers.0.linear_attn", "model.layers.2.linear_attn")
VOCAB = 1024


def tiny_qwen3_next(directory: str) -> str:
    """config.json of a 4-layer Qwen3-Next (GDN, attention, GDN, attention): vLLM reads shapes from it, no weights."""
    Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                    max_position_embeddings=4096).save_pretrained(directory)
    return directory


def vllm_config(model_dir: str, url: str, extra: dict | None = None, max_num_batched_tokens: int = 512,
                failure_policy: str = "recompute", retention_interval: int | None = 0,
                max_model_len: int = 1024) -> VllmConfig:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len,
                        runner="generate")
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="align",
                        mamba_block_size=BLOCK, prefix_match_unit=HASH_BLOCK,
                        prefix_cache_retention_interval=retention_interval)
    transfer = KVTransferConfig(kv_connector="TierCacheConnector", kv_connector_module_path="tiercache.connector.vllm",
                                kv_role="kv_both", kv_load_failure_policy=failure_policy,
                                kv_connector_extra_config={"url": url, "model_name": "tiny-qwen3-next",
                                                           **(extra or {})})
    config = VllmConfig(model_config=model, cache_config=cache, kv_transfer_config=transfer,
                        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens,
                                                         max_model_len=max_model_len, is_encoder_decoder=False),
                        device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves this from the attention backend
    return config


def kv_cache_config(config: VllmConfig, num_blocks: int):
    """vLLM's own planning (groups, shared backing tensors) for the tiny model's layer specs."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    gdn = MambaSpec(block_size=BLOCK, shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(config),
                    dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(config), mamba_cache_mode="align",
                    page_size_padded=attention.page_size_bytes)
    specs = {name: attention for name in ATTENTION} | {name: gdn for name in GDN}
    groups = get_global_kv_cache_groups(config, [specs])
    memory = num_blocks * len(ATTENTION) * attention.page_size_bytes  # each block: one page per attention+GDN pair
    kv_config = get_kv_cache_configs(config, [specs], [memory], groups)[0]
    kv_config.hash_block_size = HASH_BLOCK
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    return kv_config


class Engine:
    """One engine: scheduler + worker connector + forward stand-in, stepped like vLLM's EngineCore.step()."""

    def __init__(self, url: str, num_blocks: int = 64, extra: dict | None = None, async_scheduling: bool = False,
                 **options) -> None:
        """`async_scheduling`: vLLM's AsyncScheduler, stepped like EngineCore.step_with_batch_queue (the next step
        is scheduled and run before the previous step's output is processed)."""
        self.model_dir = tiny_qwen3_next(tempfile.mkdtemp(prefix="tiny-qwen3-next-"))
        self.config = vllm_config(self.model_dir, url, extra, **options)
        self.config.scheduler_config.async_scheduling = async_scheduling
        self.kv_config = kv_cache_config(self.config, num_blocks)
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(self.config, self.kv_config, StructuredOutputManager(self.config),
                                         block_size=BLOCK, hash_block_size=HASH_BLOCK, log_stats=True)
        self.async_scheduling = async_scheduling
        self.worker = TierCacheConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
        self.caches = allocate_kv_cache(self.kv_config, torch.device("cpu"), KVCacheLayout.LBNHC)
        self.worker.register_kv_caches(self.caches)
        groups = [set(g.layer_names) for g in self.kv_config.kv_cache_groups]
        self.forward = Forward(self.caches, groups.index(set(ATTENTION)), groups.index(set(GDN)))
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(HASH_BLOCK, sha256)
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.transfer_log: list[KVConnectorOutput] = []
        self.hits: dict[str, int] = {}  # request -> tokens it did not compute when first scheduled (local + loaded)
        self.recomputed: dict[str, int] = {}  # request -> tokens its forward passes computed
        self.preemptions: list[str] = []
        self.resumed: list[tuple[str, int]] = []  # (request, tokens it did not recompute) after a preemption
        self.before_load = None  # a fault to inject between the scheduler's lookup and the worker's fetch

    @property
    def connector(self) -> TierCacheConnector:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2, cache_salt: str | None = None,
            stop_token_ids: list[int] | None = None) -> Request:
        request = Request(req_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids), pooling_params=None,
            block_hasher=self.hasher, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    def step(self):
        out, result = self._execute()
        self._process(out, result)
        return out

    def _execute(self):
        """Schedule one step and run it on the worker side; its output is processed by _process."""
        out = self.scheduler.schedule()
        for data in out.scheduled_new_reqs:
            self.hits.setdefault(data.req_id, data.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        self.resumed += [(req_id, computed) for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens)
                         if req_id in cached.resumed_req_ids]
        for req_id, count in out.num_scheduled_tokens.items():
            self.recomputed[req_id] = self.recomputed.get(req_id, 0) + count
        self.preemptions += list(out.preempted_req_ids or ())
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        if self.before_load is not None and out.kv_connector_metadata.plan.loads:
            self.before_load()
        # The model runner's own step before the forward: vLLM's copy-on-write of partially hit blocks.
        copy_kv_cache_blocks_inplace(self.caches.values(), self.kv_config.num_blocks, out.kv_cache_block_copies or [])
        worker.start_load_kv(None)
        worker.drain()  # deterministic tests: this step's loads are done when it reports
        sampled = self.forward.run(out, self.scheduler.requests)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        worker.clear_connector_metadata()
        transfer = KVConnectorOutput(finished_sending=results.finished_sending,
                                     finished_recving=results.finished_recving,
                                     failed_recving=results.failed_recving)
        self.transfer_log.append(transfer)
        req_ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[sampled.get(r, []) for r in req_ids], logprobs=None,
                                   prompt_logprobs_dict={}, pooler_output=[], kv_connector_output=transfer)
        return out, result

    def _process(self, out, result) -> None:
        for outputs in self.scheduler.update_from_output(out, result).values():
            for output in outputs.outputs:
                self.outputs[output.request_id] += output.new_token_ids
                self.forward.reported(output.request_id, len(output.new_token_ids))
                if output.finish_reason is not None:
                    self.finished.add(output.request_id)

    def run(self, *req_ids: str, max_steps: int = 200) -> None:
        """Step until these requests finish and every end-of-request save has been handed back."""
        in_flight = []  # async scheduling: (scheduler output, model output) of the step not processed yet
        for _ in range(max_steps):
            if set(req_ids) <= self.finished and not self.scheduler.has_requests() and not in_flight:
                self.worker.drain()
                return
            if not self.async_scheduling:
                self.step()
                continue
            if self.scheduler.has_requests():
                in_flight.append(self._execute())
            if len(in_flight) == 2 or (in_flight and not self.scheduler.has_requests()):
                self._process(*in_flight.pop(0))
        raise AssertionError(f"requests {req_ids} did not finish in {max_steps} steps")

    def generate(self, req_id: str, prompt: list[int], max_tokens: int = 2, **options) -> list[int]:
        """Run one request to its end; its generated tokens."""
        self.add(req_id, prompt, max_tokens, **options)
        self.run(req_id)
        return self.outputs[req_id]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()
        shutil.rmtree(self.model_dir, ignore_errors=True)  # (its config only: the model is read once, at start)


@dataclass
class Forward:
    """The model runner's forward pass, as far as caches are concerned (see the module docstring)."""

    caches: dict[str, torch.Tensor]
    attention_group: int
    gdn_group: int
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # request -> block ids per KV cache group
    state_block: dict[str, int] = field(default_factory=dict)  # request -> index of its running state block
    unreported: dict[str, list[int]] = field(default_factory=dict)  # sampled, not yet in the request (async)
    checked_tokens: int = 0  # tokens whose cached KV a pass verified (tests assert this moved)
    checked_states: int = 0

    def run(self, out, requests) -> dict[str, list[int]]:
        self._update_tables(out)
        sampled = {}
        for req_id, count in out.num_scheduled_tokens.items():
            request = requests[req_id]
            start = request.num_computed_tokens - count  # the scheduler advanced it already
            # With async scheduling the token sampled by the previous step is not in the request yet; a real
            # model runner takes it from the previous step's output on the device.
            tokens = list(request.all_token_ids) + self.unreported.get(req_id, [])
            self._check_inputs(req_id, tokens, start)
            self._write(req_id, tokens, start, start + count)
            if start + count >= len(tokens):
                sampled[req_id] = [next_token(tokens[:start + count])]
                self.unreported.setdefault(req_id, []).extend(sampled[req_id])
        for req_id in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            self.state_block.pop(req_id, None)
            self.unreported.pop(req_id, None)
        return sampled

    def reported(self, req_id: str, count: int) -> None:
        """The scheduler appended `count` sampled tokens to the request."""
        del self.unreported.get(req_id, [])[:count]

    def _update_tables(self, out) -> None:
        for data in out.scheduled_new_reqs:
            self.tables[data.req_id] = [list(ids) for ids in data.block_ids]
            self.state_block.pop(data.req_id, None)
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
                self.state_block.pop(req_id, None)
            elif new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)

    def _tables(self, req_id: str) -> tuple[list[int], list[int]]:
        tables = self.tables[req_id]
        return tables[self.attention_group], tables[self.gdn_group]

    def _check_inputs(self, req_id: str, tokens: list[int], start: int) -> None:
        attention_table, gdn_table = self._tables(req_id)
        for position in range(start):
            block = attention_table[position // BLOCK]
            for layer in ATTENTION:
                found = self.caches[layer][block, 0, position % BLOCK]
                assert torch.equal(found, kv_value(tokens[:position + 1], layer)), \
                    f"{req_id}: KV of token {position} in {layer} is not what the prefix computes"
        self.checked_tokens += start
        if start == 0:
            return
        index = self.state_block.get(req_id, (start - 1) // BLOCK)
        block = gdn_table[index]
        assert block != 0, f"{req_id}: the state after {start} tokens would be read from the null block"
        for layer in GDN:
            found = self.caches[layer][block, 0, 0]
            assert torch.equal(found, state_value(tokens[:start], layer, found.numel())), \
                f"{req_id}: the {layer} state it continues from is not the state after {start} tokens"
        self.checked_states += 1

    def _write(self, req_id: str, tokens: list[int], start: int, end: int) -> None:
        attention_table, gdn_table = self._tables(req_id)
        for position in range(start, end):
            block = attention_table[position // BLOCK]
            for layer in ATTENTION:
                self.caches[layer][block, 0, position % BLOCK] = kv_value(tokens[:position + 1], layer)
        index = (end - 1) // BLOCK
        block = gdn_table[index]
        assert block != 0, f"{req_id}: vLLM gave the null block for the running state"
        for layer in GDN:
            target = self.caches[layer][block, 0, 0]
            target.copy_(state_value(tokens[:end], layer, target.numel()))
        self.state_block[req_id] = index


def prefix_seed(tokens, salt: str) -> int:
    seed = xxhash.xxh32_intdigest(salt.encode())
    return xxhash.xxh64_intdigest(np.asarray(tokens, dtype=np.int64).tobytes(), seed=seed)


def kv_value(prefix, layer: str) -> torch.Tensor:
    """The K|V row a forward pass leaves for the last token of `prefix` (depends on the whole prefix)."""
    rng = np.random.default_rng(prefix_seed(prefix, layer))
    return torch.from_numpy(rng.standard_normal(32, dtype=np.float32))


def state_value(prefix, layer: str, size: int) -> torch.Tensor:
    rng = np.random.default_rng(prefix_seed(prefix, "state" + layer))
    return torch.from_numpy(rng.integers(-128, 128, size, dtype=np.int8))


def next_token(prefix) -> int:
    return prefix_seed(prefix, "sample") % VOCAB


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()
