"""Fleet benchmark: K engines, each beside its own tiercache publishing KV events, behind a router that scores pods
from those events, replaying the Mooncake conversation trace: hit tokens and TTFT per routing policy (results and
how they were run: docs/benchmarks.md).

Pods (lab/fleet/pods.py): a SimulatedEngine of a hybrid layout (by default lab/layouts.py's Qwen3.5-0.8B
shape scaled ~31x down in bytes: 24 layers, every 4th full attention, N = 560) runs each request through PrefixCache
as a connector does (lookup -> load -> save, objects of the layout's real sizes, tokens and engine block hashes with
the kv chunks) into its own `tiercache serve --events` process with a small host tier (--host-mem: eviction
matters), registered as a pod. `--engine vllm` runs real vLLM CPU servers instead (lab/fleet/vllm_fleet.py).

Router (lab/fleet/router.py), one per policy, on real ZMQ sockets, with an index following llm-d's rules:
  round-robin  the next pod in turn;
  attention    the longest prefix of attention blocks, from servers that advertise every saved attention block
               (events.advertise: attention): what a router sees from a hybrid engine's own events;
  restorable   the longest prefix tiercache can restore (its default events);
  checkpoints  the same events, read by a router that also reads the checkpoints' `mamba` events
               (testkit/checkpoint_index.py): where the prompt can resume, to the token;
ties go to the least loaded pod, then in turn. Before each request is routed, the index has caught up with every
request served before it (two batches stamped after its saves; router.py says why that suffices).

Every policy replays the same slice (testkit/mooncake_trace.py: hash ids -> token ids, whole conversations kept
one in --conversations, the clock x --time-scale), in arrival order, on fresh pods. Requests are served one after
another, so when a request is routed every earlier one has saved (the caches and the router see the same past).

TTFT, simulated (lab/fleet/clock.py): lookup + load measured on the real servers, + the tokens not hit x
--prefill-ms-per-token, with each pod a first-come-first-served queue on the trace's clock. The default, 0.078 ms a
token, is a cold prefill per token of the engine serve_trace.py runs (vLLM CPU, tiny Qwen3-Next) on this project's
2-core machine: the 4,096-token prompt of benchmarks/vllm_engine.py, divided by its length (docs/benchmarks.md,
"vllm_engine.py", holds the measurement).

Ideal hit tokens: what one pod whose cache never forgets could reuse of the slice (mooncake_trace.shared_prefix_tokens:
prompts sharing hash ids, whole or up to an earlier prompt's end), and the same per pod given each policy's routing.

--diagnose adds to each request's row what the router believed of every pod (`scores`) and what every pod could have
restored (`restorable`: the query API, which touches nothing), asked when it was routed; the report then counts the
requests sent to a pod that could restore less than another ("missed": requests / tokens).

    .venv/bin/python -m lab.fleet_trace [--pods 2] [--max-requests 300] [--conversations 4]
        [--time-scale 0.4] [--host-mem 256MiB] [--json fleet.json] [--plot fleet.png] [--diagnose]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from lab.common import meta, percentiles, pyplot, write_report
from lab.fleet.clock import PodClocks
from lab.fleet.ideal import resumable_prefix
from lab.fleet.router import POLICIES, Router
from testkit import mooncake_trace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake-conversation.jsonl"
MODEL = "fleet/qwen3.5-shape-small"


def output_tokens(request: mooncake_trace.TraceRequest, vocab: int) -> np.ndarray:
    """The request's generated tokens: the same in every policy's run (seeded by its index)."""
    return np.random.default_rng(request.index).integers(mooncake_trace.FIRST_TOKEN, vocab, request.max_tokens)


def spec_for(args):
    from tiercache.prefix.objects import CacheSpec
    from tiercache.prefix.presets import preset

    if args.preset == "small":
        from lab.layouts import small_layout

        return CacheSpec.for_layout(small_layout())
    return CacheSpec.for_layout(preset(args.preset))


def block_tokens(args) -> int:
    """N: where the engine keeps recurrent checkpoints (besides prompt ends)."""
    if args.engine == "vllm":
        if args.block_size:
            return args.block_size
        from testkit.vllm_models import FOUR_LAYER

        return FOUR_LAYER.block_size
    return spec_for(args).chunk_tokens


def run_policy(policy: str, requests: list[mooncake_trace.TraceRequest], args) -> dict:
    """One policy on fresh simulated pods: a row per request, and the pods' tiers at the end."""
    from lab.fleet.pods import EventSettings, SimulatedPod

    spec = spec_for(args)
    names = [f"pod-{k}" for k in range(args.pods)]
    advertise = "attention" if policy == "attention" else "restorable"
    events = EventSettings(args.flush_interval, args.flush_interval)
    pods = {}
    router = Router(policy, names, MODEL, args.load_weight, args.prefill_ms_per_token / 1e3)
    try:
        for k, name in enumerate(names):
            pods[name] = SimulatedPod(name, MODEL, spec, advertise=advertise, host_mem=args.host_mem,
                                      disk_size=args.disk_size, seed=args.seed + k, events=events).start()
            router.follow(name, pods[name].endpoints.endpoint, pods[name].endpoints.replay_endpoint)
        clocks = PodClocks(names)
        done_at = {name: float("-inf") for name in names}
        rows = []
        started = time.monotonic()
        for request in requests:
            prompt = np.asarray(request.prompt)
            router.catch_up(done_at)
            pod, believed = router.pick(request.prompt, clocks.backlog(request.arrival_s))
            if args.diagnose:
                seen = diagnose(router, pods, request.prompt)
            served = pods[pod].serve(prompt, output_tokens(request, args.vocab))
            done_at[pod] = served.done_at
            service = served.wait_s + (served.prompt_tokens - served.hit_tokens) * args.prefill_ms_per_token / 1e3
            queue, ttft = clocks.admit(pod, request.arrival_s, service,
                                       request.max_tokens * args.decode_ms_per_token / 1e3)
            rows.append({"i": request.index, "arrival_s": round(request.arrival_s, 3), "pod": pod,
                         "prompt_tokens": served.prompt_tokens, "hit_tokens": served.hit_tokens,
                         "router_tokens": believed, "wait_ms": round(served.wait_s * 1e3, 2),
                         "queue_ms": round(queue * 1e3, 2), "ttft_ms": round(ttft * 1e3, 2)})
            if args.diagnose:
                rows[-1].update(seen)
            if args.progress and len(rows) % args.progress_every == 0:
                hit = sum(r["hit_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
                print(f"  {policy}: {len(rows)}/{len(requests)} requests, {time.monotonic() - started:.0f} s, "
                      f"hit {hit:.1%}", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - started
        tiers = {name: pod.tiers() for name, pod in pods.items()}
        return {"rows": rows, "tiers": tiers, "elapsed_s": round(elapsed, 1),
                "catch_up_s": round(router.caught_up_s, 1), "index_skipped": router.skipped()}
    finally:
        router.close()
        for pod in pods.values():
            pod.close()


def diagnose(router: Router, pods: dict, prompt) -> dict:
    """What the router believed each pod holds of `prompt`, and what each pod could restore of it (its server's query
    API: Lookup's hit rule, touching nothing), now."""
    scores = router.scores(prompt)
    restorable = {}
    for name, pod in pods.items():
        (hit,) = pod.client.query_pods(prompt, model_name=MODEL, pod_ids=[name])
        restorable[name] = hit.matched_tokens
    return {"scores": {name: min(scores.get(name, (0, 0.0))[0], len(prompt)) for name in pods},
            "restorable": restorable}


def summarize(policy: str, run: dict, requests: list[mooncake_trace.TraceRequest], pods: list[str], n: int) -> dict:
    rows = run["rows"]
    prompt = sum(r["prompt_tokens"] for r in rows)
    simulated = "hit_tokens" not in run  # real engines: hits from their counters, no per-request hit or wait
    hit = sum(r["hit_tokens"] for r in rows) if simulated else run["hit_tokens"]
    per_pod = {pod: sum(r["pod"] == pod for r in rows) for pod in pods}
    by_index = {r.index: r for r in requests}
    routed = {pod: [by_index[r["i"]] for r in rows if r["pod"] == pod] for pod in pods}
    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    queue = [r["queue_ms"] for r in rows if r["queue_ms"] is not None]
    believed = [(r["router_tokens"], r["hit_tokens"]) for r in rows if r["hit_tokens"] is not None]
    return {
        "policy": policy, "requests": len(rows), "prompt_tokens": prompt, "hit_tokens": hit,
        "hit_share": hit / prompt if prompt else 0.0,
        "ideal_given_routing": sum(sum(resumable_prefix(rs, n)) for rs in routed.values()),
        "shared_given_routing": sum(mooncake_trace.shared_prefix_tokens(rs) for rs in routed.values()),
        "requests_per_pod": per_pod,
        "busiest_over_mean": max(per_pod.values()) / (len(rows) / len(pods)) if rows else None,
        "prompt_tokens_per_pod": {pod: sum(r["prompt_tokens"] for r in rows if r["pod"] == pod) for pod in pods},
        "ttft_ms": {**percentiles(ttft, (50, 90, 99)),
                    "mean": round(statistics.fmean(ttft), 2) if ttft else None},
        "queue_ms": {**percentiles(queue, (50, 90)),
                     "mean": round(statistics.fmean(queue), 2) if queue else None},
        "wait_ms_mean": statistics.fmean(r["wait_ms"] for r in rows) if simulated and rows else None,
        "router_tokens": sum(r["router_tokens"] for r in rows),
        # tokens the router counted on the pod it chose that the request did not hit there
        "router_over": sum(max(0, b - h) for b, h in believed) if simulated else None,
        "router_overcounted_requests": sum(b > h for b, h in believed) if simulated else None,
        # the router counted at least a block more than the pod could restore (not just a shared partial block)
        "router_over_by_a_block": ({"requests": sum(b - h >= n for b, h in believed),
                                    "tokens": sum(b - h for b, h in believed if b - h >= n),
                                    "requests_hit_nothing": sum(b - h >= n and h == 0 for b, h in believed)}
                                   if simulated else None),
        **missed(rows),
        **{k: v for k, v in run.items() if k not in ("rows", "hit_tokens")},
    }


def missed(rows: list[dict]) -> dict:
    """With --diagnose: requests sent to a pod that could restore less than another one could, and the tokens."""
    if not rows or "restorable" not in rows[0]:
        return {}
    short = [max(r["restorable"].values()) - r["restorable"][r["pod"]] for r in rows]
    return {"missed": {"requests": sum(s > 0 for s in short), "tokens": sum(short)}}


ROW_COLUMNS = ("i", "arrival_s", "pod", "prompt_tokens", "hit_tokens", "router_tokens", "wait_ms", "queue_ms",
               "ttft_ms")
DIAGNOSIS_COLUMNS = ("scores", "restorable")


def write_json(result: dict, path: str) -> None:
    """One line per key; each policy's rows as columns + one list per request."""
    out = dict(result)
    out["rows"] = {}
    for policy, rows in result["rows"].items():
        columns = ROW_COLUMNS + (DIAGNOSIS_COLUMNS if rows and "restorable" in rows[0] else ())
        out["rows"][policy] = {"columns": columns, "values": [[r[c] for c in columns] for r in rows]}
    write_report(out, path, compact=True)


def print_report(result: dict) -> None:
    s = result["slice"]
    print(f"{result['engine']} engines, {result['pods']} pods; {s['requests']} requests (one conversation in "
          f"{s['conversations']}) over {s['span_s']:.0f} s, {s['prompt_tokens']:,} prompt tokens; host "
          f"{result['host_mem']} per pod; load weight {result['load_weight']}")
    print(f"shared with an earlier prompt: {s['shared_tokens']:,} tokens; ideal (one pod that never forgets, "
          f"resuming at N = {s['N']} or an earlier prompt's end): {s['ideal_tokens']:,} ({s['ideal_share']:.1%})")
    print(f"\n{'policy':<12} {'hit tokens':>12} {'hit %':>6} {'ideal|routing':>13} {'over >= N':>14} "
          f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'mean':>8}  requests per pod")
    for p in result["policies"].values():
        t = p["ttft_ms"]
        over = p["router_over_by_a_block"]
        over = f"{over['requests']} / {over['tokens']:,}" if over is not None else "-"
        print(f"{p['policy']:<12} {p['hit_tokens']:>12,} {p['hit_share']:>6.1%} {p['ideal_given_routing']:>13,} "
              f"{over:>14} {t['p50']:>7.0f}ms {t['p90']:>6.0f}ms {t['p99']:>6.0f}ms {t['mean']:>6.0f}ms  "
              + "/".join(str(n) for n in p["requests_per_pod"].values()))
    print("(over >= N: requests, and their tokens, for which the router counted at least a block more than the pod "
          "it chose could restore)")
    if any("missed" in p for p in result["policies"].values()):
        print("missed (another pod could restore more than the chosen one; requests / tokens): "
              + ", ".join(f"{p['policy']} {p['missed']['requests']} / {p['missed']['tokens']:,}"
                          for p in result["policies"].values() if "missed" in p))


def plot(result: dict, path: str) -> None:
    plt = pyplot()

    policies = list(result["policies"].values())
    names = [p["policy"] for p in policies]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    ax = axes[0]
    ax.bar(names, [100 * p["hit_share"] for p in policies], color="C0")
    ax.axhline(100 * result["slice"]["ideal_share"], color="grey", linestyle="--",
               label="ideal: one pod, never forgets")
    ax.set_ylabel("hit tokens, % of prompt tokens")
    ax.legend(fontsize=8)
    ax = axes[1]
    x = np.arange(len(names))
    for offset, key, color in ((-0.2, "p50", "C2"), (0.2, "p90", "C3")):
        ax.bar(x + offset, [p["ttft_ms"][key] for p in policies], 0.4, color=color, label=f"TTFT {key}")
    ax.set_xticks(x, names)
    ax.set_ylabel("modelled TTFT (ms)" if result["engine"] == "simulated" else "TTFT (ms)")
    ax.legend(fontsize=8)
    ax = axes[2]
    bottom = np.zeros(len(names))
    for k, pod in enumerate(policies[0]["requests_per_pod"]):
        counts = np.array([p["requests_per_pod"][pod] for p in policies])
        ax.bar(names, counts, bottom=bottom, color=f"C{k + 4}", label=pod)
        bottom += counts
    ax.set_ylabel("requests per pod")
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['pods']} pods, {result['slice']['requests']} trace requests, host {result['host_mem']} per "
                 f"pod ({result['engine']} engines)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["simulated", "vllm"], default="simulated")
    parser.add_argument("--pods", type=int, default=2, help="engines, each beside its own tiercache")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--start", type=int, default=0, help="first request of the trace taken")
    parser.add_argument("--max-requests", type=int, default=300, help="requests in the slice")
    parser.add_argument("--conversations", type=int, default=4, help="keep one conversation in this many")
    parser.add_argument("--time-scale", type=float, default=0.4, help="arrival times x this (0.5: twice the rate)")
    parser.add_argument("--max-input-tokens", type=int, default=8192, help="longer prompts keep their first tokens")
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--preset", default="small", help="'small' (lab.layouts.small_layout) or a tiercache preset")
    parser.add_argument("--host-mem", default="256MiB", help="each pod's tiercache host tier")
    parser.add_argument("--disk-size", default="0", help="each pod's tiercache disk tier (0: none)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.078,
                        help="modelled compute of a prompt token not hit (default: vLLM CPU, see above)")
    parser.add_argument("--decode-ms-per-token", type=float, default=0.0,
                        help="modelled time a pod is busy per output token after the first (default 0: not modelled)")
    parser.add_argument("--flush-interval", type=float, default=0.01,
                        help="the servers' events flush interval and heartbeat (s)")
    parser.add_argument("--load-weight", type=float, default=1.0,
                        help="the event routers' weight of a pod's queued work next to the prefill it would save "
                             "(0: longest prefix, ties to the least loaded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="a line on stderr every --progress-every requests")
    parser.add_argument("--progress-every", type=int, default=50)
    parser.add_argument("--diagnose", action="store_true",
                        help="simulated engines: record per request the router's belief and what every pod could "
                             "restore (see above)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    # --engine vllm
    parser.add_argument("--model-dir", help="vllm: the model (default: the tiny Qwen3-Next serve_trace.py builds)")
    parser.add_argument("--block-size", type=int, default=0, help="vllm: N of --model-dir's model")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="vllm: each engine's own KV cache")
    args = parser.parse_args(argv)
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policy_list if p not in POLICIES]
    if unknown or not args.policy_list:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if args.pods < 1:
        parser.error("--pods must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = mooncake_trace.SliceSpec(start=args.start, max_requests=args.max_requests, time_scale=args.time_scale,
                                    max_input_tokens=args.max_input_tokens, max_output_tokens=args.max_output_tokens,
                                    vocab=args.vocab, conversations=args.conversations)
    requests = mooncake_trace.load(args.trace, spec)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    n = block_tokens(args)
    shared = mooncake_trace.shared_prefix_tokens(requests)
    ideal = sum(resumable_prefix(requests, n))
    pods = [f"pod-{k}" for k in range(args.pods)]
    if args.engine == "vllm":
        from lab.fleet.vllm_fleet import run_policy as run
    else:
        run = run_policy
    runs = {}
    for policy in args.policy_list:
        runs[policy] = run(policy, requests, args)
    result = {
        "engine": args.engine, "pods": args.pods, "host_mem": args.host_mem, "disk_size": args.disk_size,
        "prefill_ms_per_token": args.prefill_ms_per_token, "decode_ms_per_token": args.decode_ms_per_token,
        "preset": args.preset, "seed": args.seed, "command": " ".join(sys.argv),
        "slice": {"trace": args.trace, "start": args.start, "requests": len(requests),
                  "conversations": args.conversations, "time_scale": args.time_scale,
                  "span_s": requests[-1].arrival_s, "max_input_tokens": args.max_input_tokens,
                  "prompt_tokens": prompt_tokens, "N": n, "shared_tokens": shared, "ideal_tokens": ideal,
                  "ideal_share": ideal / prompt_tokens if prompt_tokens else 0.0},
        "load_weight": args.load_weight, "meta": meta(),
        "policies": {policy: summarize(policy, run, requests, pods, n) for policy, run in runs.items()},
        "rows": {policy: run["rows"] for policy, run in runs.items()},
    }
    print_report(result)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
        print(f"plot: {args.plot}")
    if args.json:
        write_json(result, args.json)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
