"""One replay of an arm, measured: the engines warmed up, the requests replayed, and the counters' change — vLLM's
own (its prefix cache's hits, and what a connector told it it could load) and the tiercache server's (what the
engines loaded from it: delivered hits; loads that failed; saves that never arrived; what lookups found).

A hit is counted where it happened: `hit_tokens` is vLLM's own prefix cache plus what tiercache *delivered*
(the server's tiercache_delivered_tokens_total, counted when the engine's workers report a load done), not what vLLM
was promised at scheduling (its external-hit counter, kept beside it as `connector_promised`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import sys
import time

from lab.serving import exact
from lab.serving.engines import EngineFailed, VllmServer
from lab.serving.prometheus import prometheus_sum, scrape
from lab.serving.offloading import engine_figures, figures_change, summed, tier_activity
from lab.serving.replay import ROUTES, Outcome, replay, summary
from testkit.mooncake_trace import FIRST_TOKEN, TraceRequest

PUT_METHODS = re.compile(r'method="(Put|Commit|DataPut)"')  # the calls that store a chunk, however it travels
TIERCACHE_COUNTERS = {"delivered": "tiercache_delivered_tokens_total", "loads": "tiercache_delivered_loads_total",
                      "failed_loads": "tiercache_failed_loads_total",
                      "failed_load_tokens": "tiercache_failed_load_tokens_total",
                      "found": "tiercache_lookup_found_tokens_total", "saves_dropped": "tiercache_saves_dropped_total"}


def measure(bench, name: str, engines: list[VllmServer], requests, cache=None, route: str = "round-robin",
            drive=None) -> dict:
    """Warm each engine up (lazy initialisation is not what users wait for), replay, and read the counters' change.
    `drive`: a closed loop that sends the requests itself instead (chat_rounds.py: each prompt made from the replies
    before it), called as drive(servers, model, on_done=) -> (outcomes, wall); `requests` then has the loop's length
    and, once it has run, iterates over the requests it sent."""
    for engine in engines:
        warm_up(engine, bench)
    offloads = engines[0].settings.offload is not None  # vLLM's offloading (offloading.py), tiercache a tier if any
    if cache is not None:
        settle(cache, tiercache_counters(cache))  # the warm-up's saves and reports land before the counters are read
    settled = settle_offloading(engines) if offloads else True
    before = [engine.counters() for engine in engines]
    offload_before = [engine_figures(engine) for engine in engines] if offloads else []
    cache_before = tiercache_counters(cache)
    sequential = getattr(bench.args, "sequential", False)
    named = exact.named if getattr(bench.args, "plant_fault", None) else (lambda request: None)
    send = drive or functools.partial(replay, requests, route=ROUTES[route], sequential=sequential, extra=named)
    outcomes, wall = asyncio.run(send([e.url for e in engines], bench.model_dir,
                                      on_done=progress(name, len(requests), bench.args.progress)))
    if cache is not None:
        settle(cache, cache_before)
    settled = (settle_offloading(engines) if offloads else True) and settled
    after = [engine.counters() for engine in engines]
    counted = {key: sum(a[key] - b[key] for a, b in zip(after, before)) for key in before[0]}
    cache_after = tiercache_counters(cache)
    served = {key: int(cache_after[key] - cache_before[key]) for key in TIERCACHE_COUNTERS}
    result = summary(outcomes, wall)
    result["route"] = route
    if drive is None and not sequential:
        result["drain_s"] = drain_s(requests, wall)
    result["prompt_tokens"] = sum(len(r.prompt) for r in requests)
    own = int(counted["local_hit_tokens"])
    promised = int(counted["external_hit_tokens"])
    # With tiercache's connector, what it delivered; with vLLM's offloading (tiercache a tier of it or not), vLLM's
    # count is all there is, by source in `offload` (a tier's failed loads there too).
    result["hit_tokens"] = own + (served["delivered"] if cache is not None and not offloads else promised)
    # The server's counts are its connector's (delivered, failed loads): a tier behind vLLM's offloading reports
    # none, and its hits are vLLM's, by source, in `offload`.
    result["hits"] = {"vllm_prefix_cache": own, "connector_promised": promised, **(
        {f"tiercache_{key}": n for key, n in served.items()} if cache is not None and not offloads else {})}
    if offloads:
        result["offload"] = figures_change(offload_before, [engine_figures(engine) for engine in engines])
        result["offload_settled"] = settled  # false: a tier was still storing when the figures were read
    result["preemptions"] = int(counted["preemptions"])
    result["outcomes"] = [dataclasses.asdict(o) for o in outcomes]
    errors = sorted({o.error for o in outcomes if not o.ok})
    if errors:
        result["error_kinds"] = errors[:5]
    return result


def merge(first: dict, second: dict) -> dict:
    """One arm's figures from two phases replayed one after the other (outcomes keep their slice positions)."""
    outcomes = [Outcome(**o) for o in first["outcomes"] + second["outcomes"]]
    merged = summary(outcomes, first["wall_s"] + second["wall_s"])
    merged["route"] = first.get("route", "round-robin")
    if "drain_s" in first and "drain_s" in second:
        merged["drain_s"] = max(first["drain_s"], second["drain_s"])
    for key in ("prompt_tokens", "hit_tokens", "preemptions"):
        merged[key] = first[key] + second[key]
    merged["hits"] = {k: first["hits"][k] + second["hits"][k] for k in first["hits"]}
    if "offload" in first:
        merged["offload"] = summed(first["offload"], second["offload"])
        merged["offload_settled"] = first.get("offload_settled", True) and second.get("offload_settled", True)
    offset = first_phase_end(first)
    # The second phase started after the first's last answer. Not rounded: a rounded send time could fall before it.
    later = [{**o, "sent_s": None if o.get("sent_s") is None else o["sent_s"] + offset} for o in second["outcomes"]]
    merged["outcomes"] = first["outcomes"] + later
    return merged


def first_phase_end(first: dict) -> float:
    """Seconds from the first phase's start to its last answer: its wall time, which the report rounds to 10 ms, or
    its latest answer's end where rounding put that later (lab/tests/vllm_engine/test_lab_smokes.py checks that
    the second phase is sent after it)."""
    ends = [o["sent_s"] + o["e2e_s"] for o in first["outcomes"] if o.get("sent_s") is not None]
    return max([first["wall_s"], *ends])


def drain_s(requests, wall_s: float) -> float:
    """Seconds from the last arrival to the last answer. An open-loop replay the engines keep up with drains in about
    one request's time; a saturated one drains its queue, which grows with the slice (docs/benchmarks.md states the
    clock of the two-instance arms by it)."""
    return round(wall_s - max((r.arrival_s for r in requests), default=0.0), 2)


def warm_up(engine: VllmServer, bench) -> None:
    """Two prompts no trace request shares, outside the measured counters; new ones for every engine started (an
    engine restarted beside the same cache server must not find the last one's warm-up there)."""
    import numpy as np

    rng = np.random.default_rng()
    warm = [TraceRequest(i, 0.0, tuple(int(t) for t in rng.integers(FIRST_TOKEN, bench.args.vocab, length)), 2, ())
            for i, length in enumerate((300, 1000))]
    for request in warm:
        outcomes, _ = asyncio.run(replay([request], [engine.url], bench.model_dir))
        if not outcomes[0].ok:
            raise EngineFailed(f"warm-up request failed: {outcomes[0].error}\n{engine.log_tail()}")


def tiercache_counters(cache) -> dict[str, float]:
    if cache is None:
        return {"puts": 0.0, **{key: 0.0 for key in TIERCACHE_COUNTERS}}
    text = scrape(cache.metrics_url)
    puts = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tiercache_rpc_duration_seconds_count") and PUT_METHODS.search(line))
    return {"puts": puts, **{key: prometheus_sum(text, metric) for key, metric in TIERCACHE_COUNTERS.items()}}


def settle(cache, before: dict, quiet_s: float = 2.0, timeout_s: float = 30.0) -> None:
    """Wait until the engines' saves and delivery reports have stopped arriving (neither changed for `quiet_s`: the
    connectors report every second), so the counters read next are complete and the next phase sees the saves."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = tiercache_counters(cache)
        seen = (now["puts"], now["loads"], now["failed_loads"], now["saves_dropped"])
        if seen != last:
            last, since = seen, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def settle_offloading(engines: list[VllmServer], quiet_s: float = 2.0, timeout_s: float = 120.0) -> bool:
    """Wait until the engines' offloading has settled: no tier job in flight and no byte written for `quiet_s`, so a
    restart finds what the engine stored (vLLM's fs tier drops its queued stores at shutdown) and the figures read next
    are complete. False if it had not settled by `timeout_s` (the run records it)."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = [tier_activity(e) for e in engines]
        if now != last or any(running for running, _ in now):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
        time.sleep(0.2)
    return False


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
