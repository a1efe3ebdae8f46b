"""Soak of the hybrid prefix cache with the tiers full: hit tokens over time, before and after eviction starts.

A simulated engine (tiercache.bench.SimulatedEngine: lookup -> load -> save through PrefixCache, exactly like a
connector, objects of the layout's real byte sizes) sends a mixed workload, deterministic from --seed, to one server
process whose host and disk tiers the workload overflows within the first ~20-30% of the run:
  chat    --conversations interleaved multi-turn conversations; each turn adds a user message of 1.2N..3N tokens and
          a model reply of 16..200 tokens (saved at the request's end, run(prompt, output)); after 4..16 turns a
          conversation ends and a new one takes its place;
  doc     the first read of a long document (8N..40N tokens) followed by a question (20..60 tokens);
  branch  a question that branches off a document already read at a random point x: document[:x] + question;
          --documents documents are open at once, each gets 4..24 questions, then a new document takes its place;
  repeat  an exact repeat of one of the last --repeat-window prompts (--repeat-share of the requests).

For every request, `ideal` is what an unbounded cache would hit, from the workload's own knowledge (never from the
server): chat turn: the previous turn's end (prompt + reply, 0 for a first turn); doc: 0; branch: x // N * N (the
boundary state and kv chunks a first read saved below the branch point); repeat: L - 1. The figure is hit tokens /
ideal tokens per window of requests, before and after the request at which the last tier starts evicting (bytes
leave the cache; the host tier's evictions before that are demotions to disk). When a hit falls short of `ideal`,
the objects tiercache.prefix.hit.required_objects names for `ideal` were located (client.locate, no recency change)
just before the request, so the report says which kind of object was missing (kv chunk, tail, state); when the
lookup found the hit but loading it failed (SimulatedEngine then recomputes everything), where the hit's objects were
right after the failed load (`load_failed`).

The default layout is Qwen3.5-0.8B's shape scaled down ~31x in bytes (24 layers, every 4th full attention, the same
state : kv-chunk ratio of 2.9, N = 560), so that a few thousand requests run in minutes on two cores; --preset takes
a real one (then raise --host-mem / --disk-size with it).

    .venv/bin/python -m benchmarks.hybrid_soak [--requests 6000] [--seconds 0] [--seed 0] [--preset small]
                                               [--host-mem 512MiB] [--disk-size 4GiB] [--conversations 48]
                                               [--documents 16] [--window 200] [--progress]
                                               [--json-out docs/hybrid_soak.json] [--plot docs/hybrid_soak.png]

With the defaults the workload writes ~2.4 MiB per request (~3x the tiers' capacity over the run) and the disk tier
starts evicting ~20% into the run (its state budget, half its capacity, fills first: states are 3/4 of the bytes);
what the open conversations and documents need fits, so eviction must pick the stale objects to keep hit / ideal
near 1. `--host-mem 64MiB --disk-size 512MiB --requests 3000` overflows the tiers ~25x instead: the working set no
longer fits and hit / ideal settles lower (a plateau, not a collapse, is the expected shape).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time

import numpy as np

from lab.common import write_report
from lab.layouts import small_layout
from tiercache.bench import SimulatedEngine
from tiercache.client import Client
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.hit import required_objects
from tiercache.prefix.objects import CacheSpec, ObjectKind
from tiercache.prefix.presets import preset
from tiercache.process import ServerProcess

from benchmarks.soak_workload import KINDS, Item, Workload


def where_objects(refs, where, n: int) -> dict:
    """Per object kind: how many each tier holds, how many are missing, and the missing kv chunks (1-based ranges)."""
    out: dict = {}
    for ref, tier in zip(refs, where):
        entry = out.setdefault(ObjectKind(ref.kind).name.lower(), {"missing": 0})
        if tier is None:
            entry["missing"] += 1
            if ref.kind is ObjectKind.KV:
                entry.setdefault("missing_chunks", []).append(ref.position // n)
        else:
            entry[tier] = entry.get(tier, 0) + 1
    for entry in out.values():
        if "missing_chunks" in entry:
            entry["missing_chunks"] = _ranges(sorted(set(entry["missing_chunks"])))
    return out


def _ranges(values: list[int]) -> str:
    """'1-15,17' for [1, ..., 15, 17]."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def ideal_objects(client: Client, spec: CacheSpec, item: Item) -> dict:
    """Where the objects the ideal hit needs (tiercache.prefix.hit.required_objects) are, just before the request."""
    refs = required_objects(spec, spec.hashes(item.prompt), item.ideal)
    return where_objects(refs, client.locate(spec.namespace, [r.key for r in refs]), spec.chunk_tokens)


class TracingCache(PrefixCache):
    """PrefixCache that remembers the last lookup's hit and, when loading a hit fails (an object of it vanished
    between lookup and load: SimulatedEngine then recomputes everything), where the hit's objects are right after."""

    def lookup(self, tokens):
        lookup = super().lookup(tokens)
        self.lookup_hit, self.load_failure = lookup.hit.tokens, None
        return lookup

    def load_with_tiers(self, hit):
        loaded = super().load_with_tiers(hit)
        if loaded is None and hit.objects:
            refs = [o.ref for o in hit.objects]
            self.load_failure = where_objects(refs, self.client.locate(self.namespace, [r.key for r in refs]),
                                              self.spec.chunk_tokens)
        return loaded


def tier_sample(client: Client, index: int, started: float) -> dict:
    stats = client.stats()
    keep = ("evictions", "demotions", "used_bytes", "capacity_bytes", "state_bytes", "state_budget_bytes", "chunks")
    return {"request": index, "t_s": round(time.monotonic() - started, 2),
            "tiers": {t["name"]: {k: t[k] for k in keep} for t in stats["tiers"]}}


def run_soak(client: Client, spec: CacheSpec, args) -> dict:
    rng = np.random.default_rng(args.seed)
    workload = Workload(rng, spec.chunk_tokens, args.conversations, args.documents, args.repeat_share,
                        args.repeat_window)
    cache = TracingCache(client, spec)
    engine = SimulatedEngine(cache, args.seed)
    rows, samples = [], []
    started = time.monotonic()
    samples.append(tier_sample(client, 0, started))
    deadline = started + args.seconds if args.seconds else None
    index = 0
    while index < args.requests and (deadline is None or time.monotonic() < deadline):
        item = workload.next()
        where = ideal_objects(client, spec, item) if item.ideal and not args.no_diagnose else None
        request = engine.run(item.prompt, item.output)
        row = {"i": index, "t_s": round(time.monotonic() - started, 3), "kind": item.kind, "source": item.source,
               "prompt_tokens": request.prompt_tokens, "hit_tokens": request.hit_tokens, "ideal_tokens": item.ideal,
               "lookup_ms": round(request.lookup_ms, 2),
               "saved_bytes": sum(request.saved_bytes_by_tier.values()),
               "loaded_bytes": sum(request.loaded_bytes_by_tier.values())}
        if request.hit_tokens < item.ideal:
            row["lookup_hit_tokens"] = cache.lookup_hit
            if where is not None:
                row["ideal_objects"] = where
            if cache.load_failure is not None:
                row["load_failed"] = cache.load_failure
        rows.append(row)
        workload.done(index, item)
        index += 1
        if index % args.sample_every == 0:
            samples.append(tier_sample(client, index, started))
        if args.progress and index % 100 == 0:
            print(f"  {index} requests, {time.monotonic() - started:.0f} s, window ratio "
                  f"{_ratio(rows[-100:]):.3f}", file=sys.stderr, flush=True)
    if samples[-1]["request"] != index:
        samples.append(tier_sample(client, index, started))
    return {"rows": rows, "samples": samples, "elapsed_s": round(time.monotonic() - started, 1)}


def _ratio(rows: list[dict]) -> float:
    ideal = sum(r["ideal_tokens"] for r in rows)
    return sum(min(r["hit_tokens"], r["ideal_tokens"]) for r in rows) / ideal if ideal else float("nan")


def first_eviction(samples: list[dict], tier: str) -> int | None:
    """The first request index by which `tier` had evicted (resolution: --sample-every)."""
    for before, after in zip(samples, samples[1:]):
        if after["tiers"].get(tier, {}).get("evictions", 0) > 0:
            return before["request"]
    return None


def summarize(run: dict, spec: CacheSpec, args) -> dict:
    rows, samples = run["rows"], run["samples"]
    tier_names = list(samples[0]["tiers"])
    last_tier = tier_names[-1]
    start = first_eviction(samples, last_tier)
    demotion_start = first_eviction(samples, tier_names[0]) if len(tier_names) > 1 else None
    windows = []
    for begin in range(0, len(rows), args.window):
        chunk = rows[begin:begin + args.window]
        windows.append({"first": begin, "last": chunk[-1]["i"], "t_s": chunk[-1]["t_s"], "ratio": _ratio(chunk),
                        "hit_tokens": sum(r["hit_tokens"] for r in chunk),
                        "ideal_tokens": sum(r["ideal_tokens"] for r in chunk),
                        "by_kind": {k: _ratio([r for r in chunk if r["kind"] == k]) for k in KINDS if k != "doc"}})
    split = start if start is not None else len(rows)
    before, after = rows[:split], rows[split:]
    tail = rows[len(rows) * 3 // 4:]
    short = [r for r in after if r["hit_tokens"] < r["ideal_tokens"]]
    above = [r for r in rows if r["hit_tokens"] > r["ideal_tokens"]]
    missing = collections.Counter()
    for r in short:
        objects = r.get("ideal_objects")
        if "load_failed" in r:
            missing["lookup hit, load failed"] += 1
        elif objects is None:
            missing["not located"] += 1
        else:
            kinds = sorted(k for k, v in objects.items() if v["missing"])
            missing["+".join(kinds) if kinds else "nothing missing"] += 1
    saved = sum(r["saved_bytes"] for r in rows)
    capacity = sum(t["capacity_bytes"] for t in samples[-1]["tiers"].values())
    return {
        "model": spec.layout.model, "N": spec.chunk_tokens, "u": spec.match_unit,
        "state_bytes": spec.layout.state_bytes, "kv_chunk_bytes": spec.kv_chunk_bytes,
        "host_mem": args.host_mem, "disk_size": args.disk_size, "capacity_bytes": capacity, "seed": args.seed,
        "requests": len(rows), "elapsed_s": run["elapsed_s"], "window": args.window,
        "requests_by_kind": dict(collections.Counter(r["kind"] for r in rows)),
        "saved_bytes": saved, "saved_over_capacity": round(saved / capacity, 2) if capacity else None,
        "demotion_start_request": demotion_start, "eviction_start_request": start,
        "eviction_start_fraction": round(start / len(rows), 3) if start is not None and rows else None,
        "ratio_before": _ratio(before), "ratio_after": _ratio(after),
        "after_over_before": _ratio(after) / _ratio(before) if before and after else None,
        "ratio_last_quarter": _ratio(tail),
        "min_window_ratio_after": min((w["ratio"] for w in windows if w["first"] >= split), default=None),
        "by_kind": {k: {"before": _ratio([r for r in before if r["kind"] == k]),
                        "after": _ratio([r for r in after if r["kind"] == k])} for k in KINDS if k != "doc"},
        "short_after": len(short), "short_after_missing": dict(missing), "above_ideal": len(above),
        "short_after_mean_chunks": (sum(r["ideal_tokens"] - r["hit_tokens"] for r in short) / len(short)
                                    / spec.chunk_tokens if short else 0.0),
        "final_tiers": samples[-1]["tiers"],
        "windows": windows, "samples": samples, "rows": rows,
    }


ROW_COLUMNS = ("i", "t_s", "kind", "source", "prompt_tokens", "hit_tokens", "ideal_tokens", "lookup_ms", "saved_bytes")


def write_json(result: dict, path: str) -> None:
    """One line per top-level key; the per-request rows as columns + one list per request (a 6,000-request run
    stays well under 1 MB), with the located objects of every short hit in `short_rows`."""
    out = dict(result)
    rows = out.pop("rows")
    out["short_rows"] = [r for r in rows if r["hit_tokens"] < r["ideal_tokens"]]
    out["rows"] = {"columns": ROW_COLUMNS, "values": [[r[c] for c in ROW_COLUMNS] for r in rows]}
    write_report(out, path, compact=True)


def print_report(result: dict) -> None:
    mib = 2 ** 20
    print(f"{result['model']}: N={result['N']}, state {result['state_bytes'] / mib:.2f} MiB, kv chunk "
          f"{result['kv_chunk_bytes'] / mib:.2f} MiB; host {result['host_mem']}, disk {result['disk_size']}")
    print(f"{result['requests']} requests in {result['elapsed_s']:.0f} s {result['requests_by_kind']}; saved "
          f"{result['saved_bytes'] / mib:,.0f} MiB = {result['saved_over_capacity']}x the tiers' capacity")
    print(f"host tier demotes from request {result['demotion_start_request']}; the last tier evicts from request "
          f"{result['eviction_start_request']} ({result['eviction_start_fraction']} of the run)\n")
    kinds = [k for k in KINDS if k != "doc"]
    print(f"{'requests':>11} {'t (s)':>6} {'hit/ideal':>9} " + " ".join(f"{k:>7}" for k in kinds)
          + f" {'evictions':>22}")
    samples = result["samples"]
    for w in result["windows"]:
        sample = next((s for s in samples if s["request"] >= w["last"] + 1), samples[-1])
        evictions = "/".join(str(t["evictions"]) for t in sample["tiers"].values())
        marker = " <- evictions start" if result["eviction_start_request"] is not None and \
            w["first"] <= result["eviction_start_request"] <= w["last"] else ""
        print(f"{w['first']:>5}-{w['last']:<5} {w['t_s']:>6.0f} {w['ratio']:>9.3f} "
              + " ".join(f"{w['by_kind'][k]:>7.3f}" for k in kinds) + f" {evictions:>22}{marker}")
    print(f"\n(evictions: cumulative, {'/'.join(samples[-1]['tiers'])})")
    print(f"hit / ideal before eviction starts {result['ratio_before']:.3f}, after {result['ratio_after']:.3f} "
          f"(after / before {result['after_over_before'] or float('nan'):.3f}); last quarter "
          f"{result['ratio_last_quarter']:.3f}; lowest window after {result['min_window_ratio_after'] or 0:.3f}")
    for kind, v in result["by_kind"].items():
        print(f"  {kind:<7} before {v['before']:.3f}  after {v['after']:.3f}")
    print(f"requests after eviction starts whose hit fell short of ideal: {result['short_after']}, "
          f"by {result['short_after_mean_chunks']:.1f} N on average; missing objects: "
          f"{result['short_after_missing']}; hits above ideal: {result['above_ideal']}")


def plot(result: dict, path: str) -> None:
    from lab.common import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 5.2))
    windows = result["windows"]
    mid = [(w["first"] + w["last"]) / 2 for w in windows]
    ax.plot(mid, [w["ratio"] for w in windows], "o-", color="C0", linewidth=2, label="all requests")
    for color, kind in zip(("C2", "C4", "C5"), ("chat", "branch", "repeat")):
        ax.plot(mid, [w["by_kind"][kind] for w in windows], "-", color=color, linewidth=0.9, alpha=0.8, label=kind)
    if result["demotion_start_request"] is not None:
        ax.axvline(result["demotion_start_request"], color="grey", linestyle=":", label="host tier starts demoting")
    if result["eviction_start_request"] is not None:
        ax.axvline(result["eviction_start_request"], color="red", linestyle="--", label="cache starts evicting")
    ax.set_xlabel("request")
    ax.set_ylabel(f"hit tokens / ideal tokens (windows of {result['window']})")
    ax.set_ylim(0, 1.05)
    axis = ax.twinx()
    samples = result["samples"]
    last = list(samples[0]["tiers"])[-1]
    for style, name in zip(("-", "-."), samples[0]["tiers"]):
        axis.plot([s["request"] for s in samples], [s["tiers"][name]["evictions"] for s in samples], style,
                  color="C1", alpha=0.7, label=f"{name} evictions" + (" (dropped)" if name == last else
                                                                       " (demoted)"))
    axis.set_ylabel("evictions (cumulative)", color="C1")
    lines = ax.get_legend_handles_labels()
    more = axis.get_legend_handles_labels()
    fig.legend(lines[0] + more[0], lines[1] + more[1], loc="lower center", fontsize=8, ncol=4)
    ax.set_title(f"{result['model']} (N={result['N']}), host {result['host_mem']} + disk {result['disk_size']}: "
                 f"hit / ideal {result['ratio_before']:.3f} before, {result['ratio_after']:.3f} after", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=6000, help="requests to send (at most)")
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="small", help="'small' (the default layout) or a tiercache preset")
    parser.add_argument("--host-mem", default="512MiB")
    parser.add_argument("--disk-size", default="4GiB")
    parser.add_argument("--conversations", type=int, default=48, help="conversations open at once")
    parser.add_argument("--documents", type=int, default=16, help="documents open at once")
    parser.add_argument("--repeat-share", type=float, default=0.1)
    parser.add_argument("--repeat-window", type=int, default=64, help="repeats pick among this many last prompts")
    parser.add_argument("--window", type=int, default=200, help="requests per point of the hit-ratio curve")
    parser.add_argument("--sample-every", type=int, default=10, help="requests between two Stats samples")
    parser.add_argument("--no-diagnose", action="store_true", help="do not locate the ideal hit's objects")
    parser.add_argument("--progress", action="store_true", help="a line on stderr every 100 requests")
    parser.add_argument("--json-out")
    parser.add_argument("--plot")
    args = parser.parse_args()

    layout = small_layout() if args.preset == "small" else preset(args.preset)
    spec = CacheSpec.for_layout(layout)
    work = tempfile.mkdtemp(prefix="tiercache-hybrid-soak-")
    server = ServerProcess("--host-mem", args.host_mem, "--disk-dir", work, "--disk-size", args.disk_size).start()
    try:
        with Client.from_url(server.url, timeout_s=120) as client:
            run = run_soak(client, spec, args)
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    result = summarize(run, spec, args)
    print_report(result)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
        print(f"plot: {args.plot}")
    if args.json_out:
        write_json(result, args.json_out)
        print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
