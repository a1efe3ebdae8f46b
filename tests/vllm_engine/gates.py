"""The gates of the vLLM engine tests: what an engine's completion (testkit.vllm_engine.Completion) must share with
its yardstick's to count as the same computation. Every comparison is `==` (testkit/vllm_engine.py, COMPARED_TOKENS:
why exact floats are the yardstick)."""

from __future__ import annotations

import math

from testkit.vllm_engine import COMPARED_TOKENS, Completion


def assert_same_computation(got: Completion, reference: Completion, what: str) -> None:
    """The outputs gate: the same hit, and then the same greedy tokens, the same top-20 logprobs of each (exact floats)
    and the same prompt logprobs at every position both computed, over at least COMPARED_TOKENS generated tokens."""
    assert got.cached == reference.cached, f"{what}: hit {got.cached} tokens, the yardstick's hit is {reference.cached}"
    assert len(reference.tokens) >= COMPARED_TOKENS or reference.finish == "stop", \
        f"{what}: only {len(reference.tokens)} generated tokens to compare"
    assert got.tokens == reference.tokens, f"{what}: generated {got.tokens}, the yardstick {reference.tokens}"
    for step, (mine, theirs) in enumerate(zip(got.logprobs, reference.logprobs, strict=True)):
        assert mine == theirs, f"{what}: top-20 logprobs differ at output {step}: {_difference(mine, theirs)}"
    assert len(got.prompt_logprobs) == len(reference.prompt_logprobs), \
        f"{what}: prompt logprobs of {len(got.prompt_logprobs)} positions, the yardstick's of " \
        f"{len(reference.prompt_logprobs)}"
    for offset, (mine, theirs) in enumerate(zip(got.prompt_logprobs, reference.prompt_logprobs)):
        assert mine == theirs, \
            f"{what}: prompt logprobs differ at position {got.cached + 1 + offset}: {_difference(mine, theirs)}"
    assert_finite(got, what)


def assert_same_bytes(got: Completion, reference: Completion, what: str) -> None:
    """The engine bytes gate: at the same hit, the same digest for every full block of the prefix and for the state
    at the hit, group by group (testkit/vllm_engine_bytes.py)."""
    mine, theirs = got.engine_bytes, reference.engine_bytes
    assert mine is not None and theirs is not None, f"{what}: no engine bytes (no forward pass)"
    assert mine["hit"] == theirs["hit"], \
        f"{what}: the engine resumed at {mine['hit']}, the yardstick at {theirs['hit']}"
    assert mine["hit"] > 0, f"{what}: no hit, no bytes to compare"
    for group, (ours, yardstick) in enumerate(zip(mine["groups"], theirs["groups"], strict=True)):
        differing = [i for i, (a, b) in enumerate(zip(ours["blocks"], yardstick["blocks"], strict=True)) if a != b]
        what_block = "the state's block" if ours["kind"] == "mamba" else "blocks"
        assert not differing, f"{what}: {ours['kind']} group {group}: {what_block} {differing} hold other bytes"


def _difference(mine: dict[int, float], theirs: dict[int, float]) -> str:
    if set(mine) != set(theirs):
        return f"other tokens: {sorted(set(mine) ^ set(theirs))}"
    worst = max(mine, key=lambda t: abs(mine[t] - theirs[t]))
    return f"token {worst}: {mine[worst]!r} vs {theirs[worst]!r}"


def assert_finite(completion: Completion, what: str) -> None:
    for step, logprobs in enumerate(completion.logprobs):
        assert all(math.isfinite(v) for v in logprobs.values()), f"{what}: non-finite logprobs at output {step}"
