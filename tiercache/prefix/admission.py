"""Admission: which objects a request saves, after its prompt, after each engine step, and at its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Mapping, Sequence

from tiercache.prefix.hashes import PrefixHashes
from tiercache.prefix.hit import checkpoint_objects
from tiercache.prefix.objects import CacheSpec, ObjectKind, ObjectRef, object_ref

# -- admission ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SavePlan:
    """What to write after computing tokens [hit, end): the objects, and the positions where the engine must stop
    its forward pass to capture a state (ascending)."""

    objects: tuple[ObjectRef, ...]
    state_positions: tuple[int, ...]


def plan_prompt_admission(spec: CacheSpec, hashes: PrefixHashes, hit_tokens: int,
                          present: Mapping[bytes, str] | None = None) -> SavePlan:
    """Objects a prefill of the whole prompt (tokens [hit, L) computed) should save.

    Every full kv chunk; tail + state at L-1 so an exact repeat hits L-1; a state at every chunk boundary (the
    deepest `max_boundary_states` when set), so a later prompt that branches anywhere inside this one resumes within
    N tokens of the branch; nothing already present.
    """
    length = hashes.length
    n = spec.chunk_tokens
    kv_positions = [k * n for k in range(hit_tokens // n + 1, length // n + 1)]
    states = _boundary_state_positions(spec, hit_tokens, length - 1) if spec.layout.is_hybrid else []
    ends = [length - 1] if length - 1 > hit_tokens else []
    return _plan(spec, hashes, kv_positions, states, ends, present or {})


def plan_finish_admission(spec: CacheSpec, hashes: PrefixHashes, prompt_tokens: int,
                          present: Mapping[bytes, str] | None = None) -> SavePlan:
    """Objects to save when a request ends with KV and state for all `hashes.length` tokens (prompt + output):
    the kv chunks the output completed, and tail + state at the end, for the next turn of a conversation."""
    end = hashes.length
    n = spec.chunk_tokens
    kv_positions = [k * n for k in range(prompt_tokens // n + 1, end // n + 1)]
    ends = [end] if end > prompt_tokens - 1 else []
    return _plan(spec, hashes, kv_positions, [], ends, present or {})


def plan_step_admission(spec: CacheSpec, hashes: PrefixHashes, prompt_tokens: int, hit_tokens: int,
                        computed: tuple[int, int], offered_states: Sequence[int] = (),
                        present: Container[bytes] = ()) -> SavePlan:
    """Objects to save after one step of an engine that computes a request step by step and keeps recurrent states
    only where it chose to (vLLM: align-mode block boundaries and the prompt's last hash boundary): every kv chunk
    the step completed in `computed` = [start, end), and, of the states the engine `offered_states` (positions),
    those the prompt's admission wants, each with its tails when it sits between chunks.

    The prompt's admission (plan_prompt_admission) wants the boundary states (the deepest `max_boundary_states`
    when set) and the state at the prompt's end; an engine that cannot stop
    at L-1 offers the last state it keeps below it, so any offered state past the deepest chunk boundary below L-1
    counts as the prompt's end. States past the prompt (decode) are left to plan_finish_admission (the request's
    end). `hashes` must cover every position planned."""
    n = spec.chunk_tokens
    start, end = computed
    kv_positions = [k * n for k in range(start // n + 1, end // n + 1)]
    states: list[int] = []
    if spec.layout.is_hybrid:
        last = prompt_tokens - 1
        wanted = set(_boundary_state_positions(spec, hit_tokens, last))
        states = [p for p in offered_states if p in wanted or last // n * n < p <= last]
    return _plan(spec, hashes, kv_positions, states, [], present)


def _boundary_state_positions(spec: CacheSpec, after: int, last: int) -> list[int]:
    """Chunk boundaries in (after, last], the deepest `max_boundary_states` of them (all when 0)."""
    n = spec.chunk_tokens
    positions = [k * n for k in range(after // n + 1, last // n + 1)]
    return positions[-spec.max_boundary_states:] if spec.max_boundary_states else positions


def _plan(spec: CacheSpec, hashes: PrefixHashes, kv_positions: list[int], state_positions: list[int],
          end_positions: list[int], present: Container[bytes]) -> SavePlan:
    objects: dict[bytes, ObjectRef] = {}
    attention = [i for i, g in enumerate(spec.layout.groups) if g.is_attention]
    for p in kv_positions:
        for g in attention:
            ref = object_ref(spec, hashes, ObjectKind.KV, p, g)
            objects[ref.key] = ref
    for p in sorted(set(state_positions) | set(end_positions)):
        for ref in checkpoint_objects(spec, hashes, p):
            objects[ref.key] = ref
    wanted = tuple(sorted(ref for key, ref in objects.items() if key not in present))
    captures = tuple(sorted({ref.position for ref in wanted if ref.kind is not ObjectKind.KV}))
    return SavePlan(wanted, captures if spec.layout.is_hybrid else ())
