"""Mooncake-format traces (one JSON object per request: `timestamp` ms, `input_length`, `output_length`, `hash_ids`,
one id per 512-token block) turned into token-id prompts: what the lab's serving, chat and fleet benchmarks replay,
and the router-agreement tests' prompts (testkit/router_agreement.py).

Every hash id becomes the same 512 token ids wherever it appears (a generator seeded by the id), so requests whose
ids agree on a prefix share exactly that many tokens of prompt, as in the service the trace came from. The last
block is cut to `input_length`. A slice of the trace keeps its clock, scaled, and its lengths, capped, so an arm runs
in minutes on a small machine. Keeping one conversation in k (by the first block after the shared system prompt)
thins the request rate without breaking conversations apart: the later turns that reuse earlier ones stay, minutes
apart as in the trace, so compressing the clock brings that reuse into an arm's few minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

BLOCK_TOKENS = 512  # the trace's block size: one hash id per 512 prompt tokens
FIRST_TOKEN = 3  # never BOS (1) or EOS (2) of the models the prompts are for
FRESH_IDS = 1 << 40  # ids of `fresh` prompts start here: no trace id is that large
# The rows of the conversation trace the tests read (testkit/traces/README.md: which, and the trace's license).
CONVERSATION_SLICE = Path(__file__).resolve().parent / "traces" / "mooncake-conversation-slice.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    index: int  # position in the slice
    arrival_s: float  # since the first request of the slice, scaled
    prompt: tuple[int, ...]
    max_tokens: int
    hash_ids: tuple[int, ...]  # the ids of the blocks the prompt was made of (after the cap)


@dataclass(frozen=True)
class SliceSpec:
    start: int = 0  # first request of the trace taken
    max_requests: int = 200
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5: twice the trace's request rate)
    max_input_tokens: int = 4096  # longer prompts keep their first tokens (prefix sharing is kept)
    max_output_tokens: int = 16
    vocab: int = 1024
    fresh: bool = False  # every block gets an id of its own: prompts share nothing (the trace's lengths and clock)
    conversations: int = 1  # keep one conversation in this many (whole conversations: their turns keep their reuse)


def load(path: str | Path, spec: SliceSpec) -> list[TraceRequest]:
    rows = _rows(path, spec.start, spec.max_requests, spec.conversations)
    if not rows:
        raise ValueError(f"{path}: no requests from {spec.start}")
    origin = rows[0]["timestamp"]
    requests = []
    for index, row in enumerate(rows):
        length = min(int(row["input_length"]), spec.max_input_tokens)
        ids = list(row["hash_ids"])[:-(-length // BLOCK_TOKENS)]
        if spec.fresh:
            ids = [FRESH_IDS + (spec.start + index) * 4096 + i for i in range(len(ids))]
        prompt = np.concatenate([block_tokens(h, spec.vocab) for h in ids])[:length] if ids else np.zeros(0)
        requests.append(TraceRequest(index, (row["timestamp"] - origin) / 1e3 * spec.time_scale,
                                     tuple(int(t) for t in prompt), max(1, min(int(row["output_length"]),
                                                                                spec.max_output_tokens)),
                                     tuple(ids)))
    return requests


def block_tokens(hash_id: int, vocab: int) -> np.ndarray:
    """The 512 token ids of one trace block: the same for the same id in every process."""
    return np.random.default_rng([hash_id & 0xFFFFFFFF, hash_id >> 32]).integers(FIRST_TOKEN, vocab, BLOCK_TOKENS)


def shared_prefix_tokens(requests: list[TraceRequest]) -> int:
    """Prompt tokens each request shares with the longest matching prefix of an earlier request of the slice (at
    most its length - 1: the engine computes the last token): what a cache that never forgets could reuse, an upper
    bound on hit tokens before the engine's own rules (states only at some positions)."""
    return sum(shared_prefixes(requests))


def shared_prefixes(requests: list[TraceRequest]) -> list[int]:
    """Per request, in order: the tokens it shares with the longest matching prefix of an earlier request (at most
    its length - 1)."""
    covered: dict[tuple[int, ...], int] = {}  # block-id prefix -> most tokens an earlier prompt had of its last block
    shared = []
    for request in requests:
        ids, length = request.hash_ids, len(request.prompt)
        reuse = 0
        for i in range(len(ids)):
            earlier = covered.get(ids[:i + 1])
            if earlier is None:
                break
            reuse = min(earlier, length)
            if earlier < (i + 1) * BLOCK_TOKENS:  # the earlier prompt ended inside this block
                break
        shared.append(min(reuse, max(length - 1, 0)))
        for i in range(len(ids)):
            end = min(length, (i + 1) * BLOCK_TOKENS)
            covered[ids[:i + 1]] = max(covered.get(ids[:i + 1], 0), end)
    return shared


def conversation(hash_ids) -> int:
    """Which conversation a request belongs to: its first block after the one every request shares (the system
    prompt). A later turn repeats the earlier turns' blocks, so it has the same one."""
    return hash_ids[1] if len(hash_ids) > 1 else -1


def _kept(hash_ids, one_in: int) -> bool:
    key = conversation(hash_ids)
    return one_in <= 1 or xxhash.xxh64_intdigest(key.to_bytes(8, "little", signed=True)) % one_in == 0


def _rows(path: str | Path, start: int, count: int, one_in: int) -> list[dict]:
    """`count` requests of the conversations kept, from the trace's request `start` on."""
    rows = []
    with open(path) as lines:
        for number, line in enumerate(lines):
            if number < start or not line.strip():
                continue
            row = json.loads(line)
            if _kept(row["hash_ids"], one_in):
                rows.append(row)
            if len(rows) == count:
                break
    return rows
