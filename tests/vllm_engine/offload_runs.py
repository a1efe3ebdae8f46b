"""Engines with vLLM's own offloading and tiercache as its secondary tier, for the tier's engine tests
(tests/vllm_engine/test_offload_tier*.py): what each engine is configured with, the yardstick's runs, and vLLM's
counters read around one request."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from testkit.prompts import prompt
from testkit.vllm_engine import Completion, EngineProcess
from tests.vllm_engine.conftest import Engines
from tests.vllm_engine.gates import assert_same_bytes, assert_same_computation

EXTERNAL = "external_unspecified"  # the source vLLM counts a tier's hits under when the tier names no medium
POOL_BYTES = 64 << 20  # vLLM's CPU pool (cpu_bytes_to_use): a few prompts' chunks, every engine the same


class OffloadEngines:
    """The engines of one model, each started on first use: `alone` (no offloading, the yardstick), `first`
    (tiercache and vLLM's fs tier), `replica` and `restarted` (tiercache), `fs_replica` (vLLM's fs tier). Every engine
    with offloading offloads decode tokens too (offload_prompt_only false). A test that uses `replica` reads its
    tier's counters under the type it was made by: "tiercache"."""

    def __init__(self, engines: Engines, tier: dict, fs_dir: Path) -> None:
        self.engines = engines
        self.tier = tier
        self.fs = {"type": "fs", "root_dir": str(fs_dir)}
        self.n = engines.n

    def offloading(self, name: str, *tiers: dict, **options) -> EngineProcess:
        offload = {"cpu_bytes_to_use": POOL_BYTES, "offload_prompt_only": False, "secondary_tiers": list(tiers)}
        return self.engines.start(name, None, offload=offload, **options)

    @cached_property
    def alone(self) -> EngineProcess:
        return self.engines.start("alone", None)

    @cached_property
    def first(self) -> EngineProcess:
        return self.offloading("first", self.tier, self.fs)

    @cached_property
    def replica(self) -> EngineProcess:
        """By the short name the package's vLLM plugin registers (no module_path), with the worker's copies
        reported only some polls after they were issued, as a device's would be."""
        by_name = {**{k: v for k, v in self.tier.items() if k != "module_path"}, "type": "tiercache"}
        return self.offloading("replica", by_name, offload_complete_after=3)

    @cached_property
    def fs_replica(self) -> EngineProcess:
        return self.offloading("fs-replica", self.fs)

    @cached_property
    def restarted(self) -> EngineProcess:
        return self.offloading("restarted", self.tier)

    def alone_cold(self, tokens: list[int], **options) -> Completion:
        self.alone.reset_prefix_cache()
        return self.alone.one(tokens, **options)

    def alone_hit_at(self, tokens: list[int], position: int) -> Completion:
        """vLLM alone resuming `tokens` at `position` from its own cache: warmed with the prompt's first `position`
        tokens and others after them where `position` is a chunk boundary (it keeps a state there), with the prompt
        itself otherwise (it keeps the state at a repeated prompt's last match unit)."""
        self.alone.reset_prefix_cache()
        warm = tokens if position % self.n else tokens[:position] + prompt(999, 40)
        self.alone.one(warm, max_tokens=1)
        own = self.alone.one(tokens)
        assert own.cached == position, f"vLLM's own hit is {own.cached}, not {position}"
        return own

    @staticmethod
    def promotion_failures(stats: dict) -> float:
        return sum(stats["counters"].get("vllm:kv_offload_tiering_promotion_job_failures", {}).values())

    def close(self) -> None:
        self.engines.close()


def counted(engine: EngineProcess, tokens: list[int], **options) -> tuple[Completion, dict[str, int]]:
    """One request, and the prompt tokens vLLM counted as cached for it, by source (those it counted any for)."""
    before = _by_source(engine.offload_stats())
    got = engine.one(tokens, **options)
    after = _by_source(engine.offload_stats())
    return got, {source: int(after[source] - before.get(source, 0)) for source in after
                 if after[source] != before.get(source, 0)}


def _by_source(stats: dict) -> dict[str, float]:
    return dict(stats["counters"].get("vllm:prompt_tokens_cached_by_source", {}))


def assert_restored(engine: EngineProcess, tokens: list[int], own: Completion, source: str, what: str) -> Completion:
    """One request that must resume exactly where `own` (vLLM's own hit, already asserted at its position) did, every
    token of the hit counted by vLLM under `source`, and compute from the same bytes what `own` computed."""
    got, hits = counted(engine, tokens)
    assert got.cached == own.cached and hits == {source: own.cached}, f"{what}: hit {got.cached}, vLLM counted {hits}"
    assert_same_bytes(got, own, what)
    assert_same_computation(got, own, what)
    return got
