"""`tiercache bench cliff`: the hit cliff of hybrid models, measured against a real server.

A simulated engine runs requests through PrefixCache (the same lookup, load and admission code a connector uses),
with objects of the real byte sizes of a preset layout filled with random bytes. Workloads:
- repeated prompts: distinct prompts of lengths 32..4096 (dense around N), each sent R times; tiercache's token hit
  ratio on the repeats next to the full-block rule floor(L/N)*N/L of engines that reuse only whole N-token blocks;
- multi-turn chat: a system prompt and turns, each extending the previous conversation (prompt + output);
- multi_turn_long: the same with turns adding 1.2 N to 3 N tokens (the previous end lies more than N back);
- long shared context: one long document followed by different short questions (`lookup_ms_<tokens>`: the median
  lookup of the warm questions);
- branches: questions that branch off the document at 10% .. 90% of it (`shared_tokens`, `hit_tokens`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import xxhash
from tqdm import tqdm

from tiercache.client import Client
from tiercache.client.probe import require_server
from tiercache.connector.limits import check_spec
from tiercache.connector.prefix_cache import EngineBlock, PrefixCache, WithEngineBlock
from tiercache.prefix.hashes import token_bytes
from tiercache.prefix.objects import CacheSpec, ObjectKind, ObjectRef
from tiercache.prefix.presets import preset

REPEATED_LENGTHS = (32, 64, 128, 256, 384, 479, 512, 527, 528, 529, 543, 544, 545, 552, 600, 800, 979, 1024,
                    1055, 1087, 1088, 1089, 1500, 2048, 3000, 4096)
VOCAB = 150_000


@dataclass
class RequestResult:
    prompt_tokens: int
    hit_tokens: int
    lookup_ms: float
    loaded_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    loaded_objects: int = 0
    saved_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    saved_objects: int = 0


class SimulatedEngine:
    """Runs requests through PrefixCache; payloads are views into one random buffer (random bytes, no alloc).

    `engine_blocks`: the anchor group's kv chunks and tails carry their tokens, and kv chunks a stand-in for the
    engine's block hash (an xxh64 of the whole prefix up to the chunk's end), as the vLLM connector sends them from
    rank 0 to a server that publishes KV events (docs/events.md)."""

    def __init__(self, cache: PrefixCache, seed: int, engine_blocks: bool = False) -> None:
        self.cache = cache
        self.spec = cache.spec
        self.engine_blocks = engine_blocks
        largest = max(self.spec.layout.state_bytes, self.spec.layout.kv_bytes_per_token * self.spec.chunk_tokens)
        self._noise = memoryview(np.random.default_rng(seed).integers(0, 256, 2 * largest, dtype=np.uint8).data)
        self._offset = 0

    def run(self, prompt: np.ndarray, output: np.ndarray | None = None) -> RequestResult:
        start = time.perf_counter()
        lookup = self.cache.lookup(prompt)
        result = RequestResult(len(prompt), lookup.hit.tokens, (time.perf_counter() - start) * 1e3)
        loaded = self.cache.load_with_tiers(lookup.hit)
        if loaded is None:  # an object vanished between lookup and load: recompute everything
            lookup = dataclasses.replace(lookup, hit=dataclasses.replace(lookup.hit, tokens=0, objects=()))
            result.hit_tokens = 0
        else:
            result.loaded_objects, result.loaded_bytes_by_tier = len(loaded.objects), loaded.bytes_by_tier
        self._save(self.cache.plan_prompt(lookup).objects, result, prompt)
        if output is not None and len(output):
            tokens = np.concatenate([prompt, output])
            self._save(self.cache.plan_finish(tokens, len(prompt)).objects, result, tokens)
        return result

    def _save(self, refs: Sequence[ObjectRef], result: RequestResult, tokens: np.ndarray) -> None:
        if not refs:
            return
        saved = self.cache.save({ref: self._with_engine_block(ref, tokens, self._payload(self.spec.object_bytes(ref)))
                                 for ref in refs})
        result.saved_objects += saved.objects
        for tier, n in saved.bytes_by_tier.items():
            result.saved_bytes_by_tier[tier] = result.saved_bytes_by_tier.get(tier, 0) + n

    def _with_engine_block(self, ref: ObjectRef, tokens: np.ndarray, payload: memoryview):
        if not self.engine_blocks or ref.group != self.spec.shape.anchor or ref.kind is ObjectKind.STATE:
            return payload
        block = token_bytes(tokens[ref.start:ref.position])
        engine_hash = 0  # a tail: vLLM hashes no block there
        if ref.kind is ObjectKind.KV:
            engine_hash = xxhash.xxh64_intdigest(token_bytes(tokens[:ref.position])) or 1  # 0 is "no parent"
        return WithEngineBlock(payload, EngineBlock(block, engine_hash))

    def _payload(self, size: int) -> memoryview:
        self._offset = (self._offset + 4099) % (len(self._noise) - size + 1)
        return self._noise[self._offset:self._offset + size]


def repeated_prompts(engine: SimulatedEngine, rng: np.random.Generator, lengths: Sequence[int], repeats: int,
                     progress: tqdm) -> list[dict]:
    n = engine.spec.chunk_tokens
    rows = []
    for length in lengths:
        prompt = rng.integers(0, VOCAB, length)
        runs = []
        for _ in range(repeats):
            runs.append(engine.run(prompt))
            progress.update()
        repeats_hit = [r.hit_tokens for r in runs[1:]]
        rows.append({"length": length, "cold_hit_tokens": runs[0].hit_tokens,
                     "repeat_hit_tokens": repeats_hit,
                     "tiercache_hit_ratio": statistics.mean(repeats_hit) / length if repeats_hit else 0.0,
                     "full_block_hit_ratio": (length // n) * n / length,
                     "requests": [asdict(r) for r in runs]})
    return rows


def multi_turn(engine: SimulatedEngine, rng: np.random.Generator, system_tokens: int, turns: int,
               progress: tqdm) -> list[dict]:
    conversation = rng.integers(0, VOCAB, system_tokens)
    rows = []
    previous_end = 0
    for turn in range(1, turns + 1):
        prompt = np.concatenate([conversation, rng.integers(0, VOCAB, int(rng.integers(24, 160)))])
        output = rng.integers(0, VOCAB, int(rng.integers(48, 400)))
        request = engine.run(prompt, output)
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "hit_tokens": request.hit_tokens,
                     "previous_turn_end": previous_end, **_moved(request)})
        conversation = np.concatenate([prompt, output])
        previous_end = len(conversation)
        progress.update()
    return rows


def multi_turn_long(engine: SimulatedEngine, rng: np.random.Generator, system_tokens: int, turns: int,
                    progress: tqdm) -> list[dict]:
    """A conversation whose every turn adds 1.2 N to 3 N tokens (a pasted file, a long answer quoted back): each
    turn should resume at the previous turn's end, however far back from the prompt's end it lies."""
    n = engine.spec.chunk_tokens
    conversation = rng.integers(0, VOCAB, system_tokens)
    rows = []
    previous_end = 0
    for turn in range(1, turns + 1):
        message = rng.integers(0, VOCAB, int(rng.integers(int(1.2 * n), 3 * n + 1)))
        prompt = np.concatenate([conversation, message])
        output = rng.integers(0, VOCAB, int(rng.integers(16, 200)))
        request = engine.run(prompt, output)
        rows.append({"turn": turn, "prompt_tokens": len(prompt), "hit_tokens": request.hit_tokens,
                     "previous_turn_end": previous_end, "lookup_ms": request.lookup_ms, **_moved(request)})
        conversation = np.concatenate([prompt, output])
        previous_end = len(conversation)
        progress.update()
    return rows


def branches(engine: SimulatedEngine, rng: np.random.Generator, document: np.ndarray, shares: Sequence[float],
             progress: tqdm) -> list[dict]:
    """Questions that branch off the long document at 10% .. 90% of it: each should resume within N tokens of its
    branch point (a state at every chunk boundary of the document)."""
    rows = []
    for share in shares:
        shared = int(share * len(document))
        prompt = np.concatenate([document[:shared], rng.integers(0, VOCAB, int(rng.integers(16, 64)))])
        request = engine.run(prompt)
        rows.append({"share": share, "shared_tokens": shared, "prompt_tokens": len(prompt),
                     "hit_tokens": request.hit_tokens, "lookup_ms": request.lookup_ms, **_moved(request)})
        progress.update()
    return rows


def long_context(engine: SimulatedEngine, document: np.ndarray, rng: np.random.Generator, questions: int,
                 progress: tqdm) -> list[dict]:
    document_tokens = len(document)
    rows = []
    for question in range(1, questions + 1):
        prompt = np.concatenate([document, rng.integers(0, VOCAB, int(rng.integers(16, 64)))])
        request = engine.run(prompt)
        rows.append({"question": question, "prompt_tokens": len(prompt), "document_tokens": document_tokens,
                     "hit_tokens": request.hit_tokens, "lookup_ms": request.lookup_ms, **_moved(request)})
        progress.update()
    return rows


def _moved(request: RequestResult) -> dict:
    return {"loaded_objects": request.loaded_objects, "loaded_bytes_by_tier": request.loaded_bytes_by_tier,
            "saved_objects": request.saved_objects, "saved_bytes_by_tier": request.saved_bytes_by_tier}


def run_cliff(client: Client, *, preset_name: str, repeats: int, turns: int, system_tokens: int,
              document_tokens: int, questions: int, lengths: Sequence[int], seed: int, show_progress: bool,
              tp_size: int = 1) -> dict:
    """`tp_size`: the engine runs the model tensor-parallel; this simulates rank 0, whose objects are 1/tp_size of
    the KV heads and recurrent state (each rank saves its own)."""
    spec = CacheSpec.for_layout(preset(preset_name, tp_size=tp_size))
    check_spec(client, spec, "bench cliff")  # a server that would refuse the states: one line now, not a failed run
    engine = SimulatedEngine(PrefixCache(client, spec), seed)
    rng = np.random.default_rng(seed)
    shares = [k / 10 for k in range(1, 10)]
    total = len(lengths) * repeats + 2 * turns + questions + len(shares)
    with tqdm(total=total, desc="bench cliff", unit="req", disable=not show_progress, file=sys.stderr) as progress:
        repeated = repeated_prompts(engine, rng, lengths, repeats, progress)
        chat = multi_turn(engine, rng, system_tokens, turns, progress)
        chat_long = multi_turn_long(engine, rng, system_tokens, turns, progress)
        document = rng.integers(0, VOCAB, document_tokens)
        long = long_context(engine, document, rng, questions, progress)
        branched = branches(engine, rng, document, shares, progress)
    warm = [row["lookup_ms"] for row in long[1:]] or [long[0]["lookup_ms"]]
    return {"preset": preset_name, "tp_size": tp_size, "model": spec.layout.model, "namespace": spec.namespace,
            "N": spec.chunk_tokens, "u": spec.match_unit, "state_bytes": spec.layout.state_bytes,
            "kv_chunk_bytes": spec.kv_chunk_bytes,
            "repeated": repeated, "multi_turn": chat, "multi_turn_long": chat_long, "long_context": long,
            "branches": branched,
            f"lookup_ms_{document_tokens}": statistics.median(warm),
            "lookup_ms_262144": statistics.median(warm) if document_tokens == 262144 else None,
            "server_stats": client.stats()}


def print_report(result: dict) -> None:
    n = result["N"]
    rank = f", rank 0 of TP {result['tp_size']}" if result["tp_size"] > 1 else ""
    print(f"{result['model']} ({result['preset']}{rank}): N={n}, u={result['u']}, state "
          f"{result['state_bytes'] / 2**20:.1f} MiB, kv chunk {result['kv_chunk_bytes'] / 2**20:.1f} MiB")
    print("\nrepeated prompts (hit ratio on repeats)")
    print(f"{'length':>7} {'tiercache':>10} {'full-block':>11}")
    for row in result["repeated"]:
        print(f"{row['length']:>7} {row['tiercache_hit_ratio']:>10.3f} {row['full_block_hit_ratio']:>11.3f}")
    print("\nmulti-turn chat")
    print(f"{'turn':>4} {'prompt':>7} {'hit':>7} {'prev end':>8}  loaded / saved MiB by tier")
    for row in result["multi_turn"]:
        print(f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['hit_tokens']:>7} {row['previous_turn_end']:>8}  "
              f"{_mib(row['loaded_bytes_by_tier'])} / {_mib(row['saved_bytes_by_tier'])}")
    print("\nmulti-turn chat, turns adding 1.2 N to 3 N tokens")
    print(f"{'turn':>4} {'prompt':>7} {'hit':>7} {'prev end':>8}")
    for row in result["multi_turn_long"]:
        print(f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['hit_tokens']:>7} {row['previous_turn_end']:>8}")
    print("\nlong shared context")
    print(f"{'q':>2} {'prompt':>7} {'hit':>7} {'lookup ms':>9}  loaded / saved MiB by tier")
    for row in result["long_context"]:
        print(f"{row['question']:>2} {row['prompt_tokens']:>7} {row['hit_tokens']:>7} {row['lookup_ms']:>9.1f}  "
              f"{_mib(row['loaded_bytes_by_tier'])} / {_mib(row['saved_bytes_by_tier'])}")
    print("\nquestions branching inside the document")
    print(f"{'share':>5} {'shared':>7} {'hit':>7} {'lookup ms':>9}")
    for row in result["branches"]:
        print(f"{row['share']:>5.1f} {row['shared_tokens']:>7} {row['hit_tokens']:>7} {row['lookup_ms']:>9.1f}")
    key = next(k for k in result if k.startswith("lookup_ms_") and result[k] is not None)
    print(f"\n{key}: {result[key]:.1f} (median over warm questions)")


def _mib(by_tier: dict[str, int]) -> str:
    return ", ".join(f"{t} {n / 2**20:.0f}" for t, n in sorted(by_tier.items())) or "-"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["repeated"]
    lengths = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(lengths, [r["tiercache_hit_ratio"] for r in rows], "o-", label="tiercache")
    ax.plot(lengths, [r["full_block_hit_ratio"] for r in rows], "s--", label=f"full blocks only (N={result['N']})")
    ax.axvline(result["N"], color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("token hit ratio of a repeated prompt")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{result['model']}: prefix reuse of repeated prompts")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cliff_command(args) -> int:
    """Entry point of `tiercache bench cliff` (flags parsed in tiercache.cli)."""
    from tiercache.process import ServerProcess

    lengths = REPEATED_LENGTHS if not args.quick else (32, 479, 543, 544, 545, 979, 1100)
    document_tokens = args.document_tokens or (262144 if not args.quick else 16384)
    preset(args.preset, tp_size=args.tp)  # a TP size the model's heads do not split by: one line, before any server
    server = None
    url = args.server
    if url is not None:
        require_server(url)  # a dead server is one line at once, not a run of misses and warnings
    else:
        host_mem = "4GiB" if not args.quick else "1GiB"
        server = ServerProcess("--host-mem", host_mem, "--disk-size", "16GiB").start()  # a scratch disk dir
        url = server.url
    try:
        with Client.from_url(url, timeout_s=600) as client:
            result = run_cliff(client, preset_name=args.preset, repeats=args.repeats, turns=args.turns,
                               system_tokens=args.system_tokens, document_tokens=document_tokens,
                               questions=args.questions, lengths=lengths, seed=args.seed,
                               show_progress=not args.no_progress, tp_size=args.tp)
    finally:
        if server is not None:
            server.stop()
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
