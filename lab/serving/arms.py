"""The serving benchmark's arms: what a serving team would run, each on the same slice with fresh servers.

Memory: vLLM's KV cache and tiercache's host tier are the same DRAM on a CPU host, so every arm that runs without
tiercache but stands for "what a user would run instead" gets tiercache's bytes as KV cache (`alone-equal`,
`alone-restart`, `two-alone`); `alone` (the small cache alone) stands in for an engine short of GPU memory, where the
host bytes could not become KV cache. The arms with vLLM's own offloading give the host bytes to its pool instead
(offloading.py). Cores: every engine computes on the cores compute_cpus names; the cache server, vLLM's API servers
and the client share the rest. Two engines take half the cores each (halves); on 2 cores the second shares its core
with the cache server where there is one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from lab.serving.engines import EngineSettings, VllmServer
from lab.serving.exact import fault_settings
from lab.serving.measure import measure, merge
from lab.serving.offloading import OFFLOAD_ARMS

MiB = 1 << 20
ARMS = ("alone", "alone-equal", "alone-equal-again", "tiercache", "restart", "alone-restart", "two",
        "two-conv", "two-alone", "two-alone-conv", "noreuse", "connector", "connector-restart", "two-connector",
        *OFFLOAD_ARMS)
NOREUSE_ARMS = ("noreuse-alone", "noreuse-alone-equal", "noreuse-tiercache", "noreuse-offload")
# What runs without --arms: the single-engine, restart, two-instance and nothing-reused comparisons; the sets against
# vLLM's offloading name their arms (docs/benchmarks.md gives each set's command).
DEFAULT_ARMS = ("alone", "alone-equal", "alone-equal-again", "offload", "tiercache", "restart", "alone-restart", "two",
                "two-conv", "two-alone", "two-alone-conv", "noreuse")
# tiercache's connector, under the names the sets against vLLM's offloading give it: the same runs as `tiercache`,
# `restart` and `two`, its server given as many host bytes as the offloading arms' pools (one per engine).
CONNECTOR = {"connector": "tiercache", "connector-restart": "restart", "two-connector": "two"}


@dataclasses.dataclass
class Bench:
    args: object  # serve_trace's parsed arguments
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

    @property
    def equal_kv_bytes(self) -> int:
        """vLLM's KV cache given tiercache's host bytes as well: the same total memory as vLLM + tiercache."""
        return (self.args.kv_cache_mib + self.args.host_mib) * MiB

    def connector(self, cache) -> dict:
        return {"url": cache.url, "model_name": "serve-trace", "lookup_timeout_s": 2.0,
                **json.loads(self.args.connector_config)}

    def with_cache(self, settings: EngineSettings, cache, arm: str) -> EngineSettings:
        """The settings with TierCacheConnector on `cache`, and the faults --plant-fault plants in it (exact.py)."""
        return dataclasses.replace(settings, connector=self.connector(cache), **fault_settings(self, arm))

    def cache_server(self, host_mib: int | None = None):
        """tiercache's server (a host tier of --host-mib, or `host_mib`; no disk tier) on the cores the engines do not
        compute on (inherited from this process at its start), as docs/vllm.md advises for CPU inference."""
        from tiercache.process import ServerProcess, free_port

        metrics = free_port()
        server = ServerProcess("--host-mem", f"{host_mib or self.args.host_mib}MiB", "--disk-size", "0",
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
        """A server on these settings; with vLLM's offloading, its own pool (a restarted engine never shares a pool
        file with the one it replaces: offloading.own_pool)."""
        from lab.serving.offloading import own_pool

        return VllmServer(own_pool(settings), self.work / f"{name}.log").start()


# -- one engine ----------------------------------------------------------------------------------------------------

def one_engine(bench: Bench, name: str, requests, settings: EngineSettings, with_cache: bool, drive=None,
               attach=None) -> dict:
    """`attach(settings, cache) -> settings`: how the engine uses the cache server (default: tiercache's connector,
    Bench.with_cache; the offloading arms make it a tier)."""
    cache = bench.cache_server() if with_cache else None
    try:
        if cache is not None:
            settings = (attach or _connector(bench, name))(settings, cache)
        engine = bench.start(name, settings)
        try:
            return measure(bench, name, [engine], requests, cache, drive=drive)
        finally:
            engine.stop()
    finally:
        if cache is not None:
            cache.terminate()


def _connector(bench: Bench, name: str):
    return lambda settings, cache: bench.with_cache(settings, cache, name)


def arm_offloading(bench: Bench, name: str, requests, drive=None, parts=None) -> dict:
    """An arm with vLLM's own offloading (lab/serving/offloading.py says what each name runs); `drive` and
    `parts` as one_engine's and restarted's (the chat's closed loop)."""
    from lab.serving.offloading import FsDirs, OffloadArm, fs_tier, offloading, tiercache_tier

    arm, dirs = OffloadArm.parse(name.removeprefix("noreuse-")), FsDirs(bench.work, name)
    pool = bench.args.host_mib * MiB

    def settings(replica: int = 0, cpus: str | None = None) -> EngineSettings:
        tiers = {"fs": lambda: [fs_tier(dirs(replica))], "fs-shared": lambda: [fs_tier(dirs("shared"))]}
        base = bench.engine() if cpus is None else bench.engine(cpus=cpus)
        return offloading(base, pool, tiers.get(arm.tier, list)())

    def as_tier(settings: EngineSettings, cache) -> EngineSettings:
        tier = tiercache_tier(bench.model_dir, cache.url)
        return dataclasses.replace(settings, offload={**settings.offload, "secondary_tiers": [tier]})

    with_cache = arm.tier == "tiercache"
    try:
        if arm.replicas == 2:
            result = two_engines(bench, name, requests, with_cache, "round-robin", settings_for=settings,
                                 attach=as_tier)
        elif arm.restart:
            result = restarted(bench, name, requests, settings(), with_cache, parts=parts, attach=as_tier)
        else:
            result = one_engine(bench, name, requests, settings(), with_cache, drive=drive, attach=as_tier)
        if arm.tier in ("fs", "fs-shared"):
            logs = [bench.work / f"{name}{part}.log" for part in ("", "-before", "-after", "-0", "-1")]
            result["fs_tier"] = dirs.facts(logs)
        return result
    finally:
        dirs.remove()


# -- restarts ------------------------------------------------------------------------------------------------------

def restarted(bench: Bench, name: str, requests, settings: EngineSettings, with_cache: bool,
              parts=None, attach=None) -> dict:
    """The first half on one vLLM, then vLLM is stopped (SIGTERM, as a deploy does) and a new one serves the second
    half, its own prefix cache empty. With tiercache, the cache server lives on; without, nothing is kept (the
    baseline for "after a restart"). Each phase is reported on its own: a figure over both is not "after".
    `parts`: the (requests, drive) of each phase, for a closed loop that goes on after the restart where it stopped
    (chat_rounds.py; measure's `drive`); else the halves of `requests`, replayed. `attach` as one_engine's."""
    half = len(requests) // 2 if parts is None else len(parts[0][0])
    parts = parts or ((requests[:half], None), (shifted(requests[half:]), None))
    cache = bench.cache_server() if with_cache else None
    if cache is not None:
        settings = (attach or _connector(bench, name))(settings, cache)
    try:
        phases = {}
        for phase, (part, drive) in zip(("before", "after"), parts):
            engine = bench.start(f"{name}-{phase}", settings)
            try:
                phases[phase] = measure(bench, f"{name}-{phase}", [engine], part, cache, drive=drive)
            finally:
                engine.stop()
    finally:
        if cache is not None:
            cache.terminate()
    merged = merge(phases["before"], phases["after"])
    merged["restart_at"] = half
    merged["phases"] = {phase: {k: v for k, v in result.items() if k != "outcomes"} for phase, result in phases.items()}
    return merged


# -- two instances -------------------------------------------------------------------------------------------------

def two_engines(bench: Bench, name: str, requests, with_cache: bool, route: str, settings_for=None,
                attach=None, host_mib: int | None = None) -> dict:
    """Two vLLM servers, each on half the cores. With tiercache: each keeps the small KV cache and both share one
    cache server. Without: each gets half of tiercache's host bytes as KV cache (the same total memory).
    `settings_for(replica, cpus) -> settings`: each engine's own (the offloading arms'); `attach` as one_engine's;
    `host_mib`: the server's host tier (default --host-mib)."""
    cache = bench.cache_server(host_mib) if with_cache else None
    engines = []
    try:
        for i, cpus in enumerate(halves(os.cpu_count() or 2)):
            if settings_for is not None:
                settings = settings_for(i, cpus)
            else:
                settings = bench.engine(cpus=cpus)
                if cache is None:
                    settings = dataclasses.replace(settings, kv_cache_bytes=(bench.args.kv_cache_mib
                                                                             + bench.args.host_mib // 2) * MiB)
            if cache is not None:
                settings = (attach or _connector(bench, name))(settings, cache)
            engines.append(bench.start(f"{name}-{i}", settings))
        return measure(bench, name, engines, requests, cache, route=route)
    finally:
        for engine in engines:
            engine.stop()
        if cache is not None:
            cache.terminate()


def run_arm(bench: Bench, name: str) -> dict:
    requests = bench.fresh if name.startswith("noreuse-") else bench.requests
    base = CONNECTOR.get(name, name.removeprefix("noreuse-"))
    equal = dataclasses.replace(bench.engine(), kv_cache_bytes=bench.equal_kv_bytes)
    runners = {
        "alone": lambda: one_engine(bench, name, requests, bench.engine(), with_cache=False),
        "alone-equal": lambda: one_engine(bench, name, requests, equal, with_cache=False),
        # The baseline run twice in each round: the set's A/A pair (report.AA).
        "alone-equal-again": lambda: one_engine(bench, name, requests, equal, with_cache=False),
        "tiercache": lambda: one_engine(bench, name, requests, bench.engine(), with_cache=True),
        "restart": lambda: restarted(bench, name, requests, bench.engine(), with_cache=True),
        "alone-restart": lambda: restarted(bench, name, requests, equal, with_cache=False),
        "two": lambda: two_engines(bench, name, requests, True, "round-robin",
                                   host_mib=2 * bench.args.host_mib if name == "two-connector" else None),
        "two-conv": lambda: two_engines(bench, name, requests, True, "conversation"),
        "two-alone": lambda: two_engines(bench, name, requests, False, "round-robin"),
        "two-alone-conv": lambda: two_engines(bench, name, requests, False, "conversation"),
    }
    result = arm_offloading(bench, name, requests) if base in OFFLOAD_ARMS else runners[base]()
    if getattr(bench.args, "sequential", False) and getattr(bench.args, "exact_check", True) \
            and "outcomes" in result and not name.startswith("noreuse-"):
        from lab.serving.exact import check_run

        result["exact"] = check_run(bench, name, result)
    return result


def work_and_model(args, prefix: str) -> tuple[Path, str, int, str]:
    """The work folder (engine logs) and the model: --model-dir with its --block-size, else a tiny random-weight
    Qwen3-Next written there. (work, model_dir, N, a name for reports)"""
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    if args.model_dir is None:
        from testkit.vllm_models import FOUR_LAYER

        return work, FOUR_LAYER.write(work), FOUR_LAYER.block_size, "tiny random-weight Qwen3-Next (4 layers)"
    if not args.block_size:
        raise SystemExit("--model-dir needs --block-size (vLLM's unified block size N for that model)")
    return work, args.model_dir, args.block_size, args.model_dir


def interleaved(arms: list[str], repeats: int, run_one, build, json_path: str | None, seed: int | None = None,
                drop_caches: bool = False) -> dict:
    """Every arm `repeats` times in rounds, each round in its own random order (recorded: a run's `position`), each run
    kept with its provenance (the code it ran, lab.common.code; the machine's load: lab/serving/provenance.py); the
    report rebuilt and written after every run, so an interrupted benchmark keeps what it measured. `run_one(name) ->
    result`, `build(runs) -> report`. The code may not change while a set runs: a run whose code differs from the
    first's stops the set. `drop_caches`: the page cache dropped before every run (provenance.drop_page_cache; a
    system-wide step, so only when asked), recorded either way."""
    import random
    import time

    from lab.common import code
    from lab.serving.provenance import LoadSampler, drop_page_cache

    order = random.Random(seed)
    runs, first_code = [], code()
    for round_ in range(repeats):
        for position, name in enumerate(order.sample(arms, len(arms))):
            page_cache = drop_page_cache() if drop_caches else {"dropped": False, "why": "not asked"}
            if drop_caches and not page_cache["dropped"]:
                raise SystemExit(f"--drop-page-cache: the page cache could not be dropped ({page_cache['why']}); "
                                 f"run as root, or without the flag (each run then records that it was not)")
            started = time.monotonic()
            with LoadSampler() as load:
                result = run_one(name)
            result["arm_s"] = round(time.monotonic() - started, 1)
            version = code()
            runs.append({"arm": name, "round": round_, "position": position, "result": result,
                         "provenance": {**version, "load": load.summary(), "page_cache": page_cache}})
            if json_path:
                Path(json_path).write_text(json.dumps(build(runs), indent=1))
            if version != first_code:
                raise SystemExit(f"the code changed while the set ran ({first_code} -> {version}): the runs so far "
                                 f"are in {json_path or 'no file'}; start a new set")
    return build(runs)


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


def shifted(requests) -> list:
    """The requests with their arrival times starting at 0 (the second half of a slice, replayed after a restart)."""
    origin = requests[0].arrival_s if requests else 0.0
    return [dataclasses.replace(r, arrival_s=r.arrival_s - origin) for r in requests]
