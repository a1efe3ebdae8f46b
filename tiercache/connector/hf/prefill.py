"""tiercache for Hugging Face transformers models: `CachedPrefill` skips the prefill of every token it can reuse.

    prefill(ids): lookup -> load -> rebuild a DynamicCache at the hit p -> run the model on [p, L), split where
                  admission wants recurrent states (chunk boundaries, L-1) -> save what admission planned;
    finish(...):  save the end of a request (prompt + output) so the next chat turn hits it;
    generate(...): greedy decoding around both, for multi-turn chat.

Continuing at p passes position_ids = arange(p, p + n) explicitly (some models, e.g. Bamba, do not offset on their
own). A model whose cached state does not survive a split forward pass (Jamba's PyTorch Mamba path restarts its scan
from zero) is refused hits, with the reason logged, rather than given wrong logits.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from tiercache.client import Client
from tiercache.connector.hf.cache import build_cache, derive_layout, holds, object_payload, state_payload
from tiercache.connector.limits import check_spec
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.admission import plan_prompt_admission
from tiercache.prefix.objects import CacheSpec, ObjectKind

log = logging.getLogger(__name__)

# Families whose PyTorch implementation is known to ignore a cached recurrent state when continuing with several
# tokens at once (checked with transformers 5.23). The self-test below catches others, within float tolerance.
KNOWN_BROKEN_CONTINUATION = {
    "jamba": "JambaMambaMixer runs its selective scan from a zero state whenever more than one token is fed, "
             "ignoring the cached SSM state; a restored state would give wrong logits",
}
# Largest |logit| difference, relative to the largest logit, allowed between a split and a one-shot forward pass.
CONTINUATION_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
LOW_PRECISION_TOLERANCE = 5e-2


class Prefill(NamedTuple):
    logits: torch.Tensor  # [1, vocab]: the next-token logits after the prompt
    past_key_values: object  # the DynamicCache, covering the whole prompt
    hit_tokens: int


class Generation(NamedTuple):
    tokens: list[int]  # generated token ids
    past_key_values: object  # covers prompt + all generated tokens
    hit_tokens: int


@dataclass(frozen=True)
class Options:
    model_name: str | None = None  # default: config.name_or_path, else config.model_type
    revision: str | None = None  # default: the config's commit hash, else a digest of the weights
    match_unit: int = 16
    chunk_tokens: int | None = None  # default: unified_block_size of the derived layout
    salt: str = ""
    verify_continuation: bool = True
    max_boundary_states: int = 0  # boundary states saved per prompt, the deepest first; 0: one at every chunk boundary


class CachedPrefill:
    def __init__(self, model, client: Client, **options) -> None:
        self.options = Options(**options)
        self.model = model
        config = model.config
        name = self.options.model_name or getattr(config, "name_or_path", "") or config.model_type
        revision = self.options.revision or getattr(config, "_commit_hash", None) or weights_digest(model)
        self.layout = derive_layout(model, name, revision)
        self.spec = CacheSpec.for_layout(self.layout, match_unit=self.options.match_unit,
                                         chunk_tokens=self.options.chunk_tokens, salt=self.options.salt,
                                         max_boundary_states=self.options.max_boundary_states)
        check_spec(client, self.spec, "CachedPrefill")
        self.cache = PrefixCache(client, self.spec)
        self.refusal = continuation_refusal(model, verify=self.options.verify_continuation)
        self.last_timings: dict[str, float] = {}  # seconds of the last prefill: lookup, load, compute, save
        self.last_loaded_bytes = 0  # what the last prefill loaded from tiercache (benchmarks/hf_gpu.py: its GB/s)
        # A pass before the last one is run for its cache alone: its logits are not computed beyond one position (a
        # long prompt's would be prompt x vocab: 128K tokens of a 248K vocabulary, 63 GB in bf16). The last pass
        # computes them as the model alone does, so the exactness gates compare like with like
        # (tests/connector/hf/test_gate.py).
        self._cache_only = _last_logits_only(model)
        if self.refusal:
            log.warning("tiercache will not serve hits for %s: %s", name, self.refusal)

    @torch.no_grad()
    def prefill(self, input_ids) -> Prefill:
        tokens = _token_array(input_ids)
        ids = torch.as_tensor(tokens, device=self.model.device)[None]
        if self.refusal:
            out = self.model(ids, past_key_values=self._fresh_cache(), use_cache=True)
            return Prefill(out.logits[:, -1], out.past_key_values, 0)
        clock = _Clock()
        lookup = self.cache.lookup(tokens)
        clock.lap("lookup")
        hit, present = lookup.hit.tokens, lookup.present
        loaded = self.cache.load(lookup.hit) if hit else {}
        if loaded is None:  # gone or corrupt since the lookup: recompute, and write everything again
            log.info("tiercache: objects of a %d-token hit could not be loaded; recomputing", hit)
            hit, present, loaded = 0, {}, {}
        self.last_loaded_bytes = sum(len(data) for data in loaded.values())
        past = build_cache(self.model, self.spec, hit, loaded) if hit else self._fresh_cache()
        clock.lap("load")
        _record_sliding_windows(past, True)
        plan = plan_prompt_admission(self.spec, lookup.hashes, hit, present)
        cuts = [p for p in plan.state_positions if hit < p < len(tokens)]
        states = {}
        for start, end in zip([hit, *cuts], [*cuts, len(tokens)]):
            out = self.model(ids[:, start:end], past_key_values=past, use_cache=True,
                             position_ids=torch.arange(start, end, device=ids.device)[None],
                             **(self._cache_only if end < len(tokens) else {}))
            if end in plan.state_positions:
                states[end] = state_payload(past, self.layout.recurrent_group)
        clock.lap("compute")  # the first token's logits exist from here on: time to first token
        self.cache.save(self._payloads(past, plan.objects, states))
        clock.lap("save")
        self.last_timings = clock.laps
        return Prefill(out.logits[:, -1], past, hit)

    @property
    def last_ttft_s(self) -> float:
        """Seconds of the last prefill to its first token's logits: lookup + load + compute (the save that follows
        is not on that path)."""
        t = self.last_timings
        return t["lookup"] + t["load"] + t["compute"]

    @torch.no_grad()
    def finish(self, token_ids, past_key_values, prompt_tokens: int) -> None:
        """Save the end of a request: `token_ids` are all the tokens `past_key_values` has consumed (prompt and
        output). Also trims sliding-window layers back to their window (prefill keeps them whole until here)."""
        tokens = _token_array(token_ids)
        if not self.refusal and len(tokens) > prompt_tokens:
            plan = self.cache.plan_finish(tokens, prompt_tokens)
            state = {len(tokens): state_payload(past_key_values, self.layout.recurrent_group)} \
                if self.layout.recurrent_group is not None else {}
            self.cache.save(self._payloads(past_key_values, plan.objects, state))
        _record_sliding_windows(past_key_values, False)

    def _payloads(self, past, refs, states: dict) -> dict:
        """The bytes of every planned object the cache still holds (`states`: captured states by position). After a
        partial hit a restored sliding-window layer holds only its window, so a chunk reaching back before it
        cannot be written: it is skipped — a cache may forget, it must never fail the request
        (tests/connector/hf/test_gate.py, `test_a_sliding_window_partial_hit_never_fails_the_request`)."""
        payloads = {}
        for ref in refs:
            if ref.kind is ObjectKind.STATE:
                payloads[ref] = states[ref.position]
            elif holds(past, self.spec, ref):
                payloads[ref] = object_payload(past, self.spec, ref)
            else:
                log.debug("tiercache: not saving %s at %d: its window no longer holds it", ref.kind.name,
                          ref.position)
        return payloads

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, eos_token_id: int | None = None) -> Generation:
        """Greedy decoding; the cache ends covering prompt + output, and that end is saved for the next turn."""
        prompt = _token_array(input_ids)
        result = self.prefill(prompt)
        past = result.past_key_values
        generated = [int(result.logits[0].argmax())]
        position = len(prompt)
        while True:
            token = torch.tensor([[generated[-1]]], device=self.model.device)
            out = self.model(token, past_key_values=past, use_cache=True,
                             position_ids=torch.tensor([[position]], device=self.model.device))
            position += 1
            if len(generated) == max_new_tokens or generated[-1] == eos_token_id:
                break  # the last token is fed too, so the next turn can reuse everything up to here
            generated.append(int(out.logits[0, -1].argmax()))
        self.finish(np.concatenate([prompt, generated]), past, len(prompt))
        return Generation(generated, past, result.hit_tokens)

    def _fresh_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


def _token_array(input_ids) -> np.ndarray:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu().numpy()
    tokens = np.asarray(input_ids)
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(f"expected one non-empty sequence of token ids (batch size 1), got shape {tokens.shape}")
    return tokens.astype(np.int64, copy=False)


def _record_sliding_windows(cache, record: bool) -> None:
    """Keep sliding-window layers whole while objects may still be cut from them, then trim them to the window."""
    for layer in cache.layers:
        if not getattr(layer, "is_sliding", False):
            continue
        if record:
            layer.record_past = True
        elif layer.record_past:
            if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > layer.sliding_window - 1:
                layer.keys = layer.keys[:, :, -layer.sliding_window + 1:, :]
                layer.values = layer.values[:, :, -layer.sliding_window + 1:, :]
            layer.record_past = False


def _last_logits_only(model) -> dict:
    """The forward argument that keeps only the last position's logits, where the model takes it."""
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"logits_to_keep": 1} if takes else {}


def weights_digest(model) -> str:
    """16 hex characters naming the weights, for models built in memory (no hub revision to name them by)."""
    h = xxhash.xxh3_64()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


@torch.no_grad()
def continuation_refusal(model, verify: bool = True) -> str | None:
    """Why hits must not be served for this model, or None. Known families first, then (optionally) a self-test:
    a forward pass split at 16 tokens must reproduce the one-shot logits of the continuation."""
    from transformers import DynamicCache

    model_type = getattr(model.config, "model_type", "")
    if model_type in KNOWN_BROKEN_CONTINUATION:
        return KNOWN_BROKEN_CONTINUATION[model_type]
    if not verify:
        return None
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(24, device=model.device) * 7919 % vocab)[None]
    whole = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits[0, 16:]
    cache = DynamicCache(config=model.config)
    model(ids[:, :16], past_key_values=cache, use_cache=True, position_ids=torch.arange(16, device=ids.device)[None])
    split = model(ids[:, 16:], past_key_values=cache, use_cache=True,
                  position_ids=torch.arange(16, 24, device=ids.device)[None]).logits[0]
    difference = ((split - whole).abs().max() / whole.abs().max().clamp_min(1e-6)).item()
    tolerance = CONTINUATION_TOLERANCE.get(whole.dtype, LOW_PRECISION_TOLERANCE)
    if difference > tolerance:
        return (f"continuing from a cache split at 16 tokens changes the logits by {difference:.2e} (relative), "
                f"more than float rounding ({tolerance:.0e})")
    return None

