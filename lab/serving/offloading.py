"""The arms with vLLM's own offloading: what a vLLM team that already offloads would run instead of tiercache's
connector, and tiercache as a tier behind it.

An arm's name says what it runs: `[two-]offload[-fs|-fs-shared|-tiercache][-restart][-again]`:
- `offload`: vLLM with the small KV cache and its CPU offloading (`OffloadingConnector`, `TieringOffloadingSpec`, no
  secondary tier) given tiercache's host bytes as its pool (`cpu_bytes_to_use`, the same in every engine);
- `-fs`: + vLLM's own `fs` tier on local disk, a directory per engine (`-fs-shared`: one for every engine);
- `-tiercache`: + tiercache as the secondary tier (`TierCacheTier`, the entry `tiercache vllm-tier` prints), one
  server shared by every engine, its host tier the same bytes as one pool, no disk tier;
- `two-`: two engines behind a round robin, each on half the cores; `-restart`: the first half of the slice on one
  engine, the second on a new one (what outlives the first is each tier's to keep); `-again`: the same arm twice in a
  round, the set's A/A pair.

Every engine offloads decode tokens too (`offload_prompt_only: false`). vLLM's CPU offloading worker refuses the CPU
build; testkit.offload_worker stands its four CUDA-only points in, in the served engine's processes (testkit/site),
as the tier's engine tests do (tests/vllm_engine/test_offload_tier.py). Memory and disk: the pool lives in the
engine's process (/dev/shm, gone with it); the `fs` tier writes with O_DIRECT (vLLM probes the directory; the page
cache is bypassed) and has no size limit; tiercache's host tier is an arena in /dev/shm, not the page cache.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path

from lab.serving.prometheus import prometheus_by_label, prometheus_sum, scrape
from testkit.offload_worker import STOOD_IN_LINE

MiB = 1 << 20
TIERS = ("fs", "fs-shared", "tiercache")
BASES = tuple(f"offload{'-' + t if t else ''}" for t in ("", *TIERS))
OFFLOAD_ARMS = tuple(f"{replicas}{base}{restart}{again}" for replicas in ("", "two-") for base in BASES
                     for restart in ("", "-restart") for again in ("", "-again")
                     if not (replicas == "" and base == "offload-fs-shared") and not (replicas and restart))

# vLLM's figures for offloading, by label: the prompt tokens each source served (device: its own prefix cache, host:
# the pool, disk: the fs tier, external_unspecified: a tier that names no medium, as tiercache's), each tier's chunk
# hits, queries, failed jobs, bytes and transfer seconds (bytes per job-second: run_figures says why no bandwidth), the
# scheduler's time in lookups (sync: in the step; async: until a lookup a tier answered later is settled), and the
# step time as requests see it (inter-token latency).
OFFLOAD_COUNTERS = {"cached_by_source": ("vllm:prompt_tokens_cached_by_source_total", "source"),
                    "tier_chunk_hits": ("vllm:kv_offload_tiering_chunk_hits_total", "tier"),
                    "tier_chunk_queries": ("vllm:kv_offload_tiering_chunk_queries_total", "tier"),
                    "tier_promotion_failures": ("vllm:kv_offload_tiering_promotion_job_failures_total", "tier"),
                    "tier_cascade_failures": ("vllm:kv_offload_tiering_cascade_job_failures_total", "tier"),
                    "tier_read_bytes": ("vllm:kv_offload_tiering_read_bytes_total", "tier"),
                    "tier_write_bytes": ("vllm:kv_offload_tiering_write_bytes_total", "tier"),
                    "tier_read_time_s": ("vllm:kv_offload_tiering_read_time_total", "tier"),
                    "tier_write_time_s": ("vllm:kv_offload_tiering_write_time_total", "tier")}
ACTIVE_JOBS = ("vllm:kv_offload_tiering_active_cascade_jobs", "vllm:kv_offload_tiering_active_promotion_jobs")
OFFLOAD_HISTOGRAMS = {"lookup_sync_delay_s": "vllm:kv_offload_lookup_sync_delay_seconds",
                      "lookup_async_delay_s": "vllm:kv_offload_lookup_async_delay_seconds",
                      "tier_lookup_sync_delay_s": "vllm:kv_offload_tiering_lookup_sync_delay_seconds",
                      "tier_lookup_async_delay_s": "vllm:kv_offload_tiering_lookup_async_delay_seconds",
                      "inter_token_s": "vllm:inter_token_latency_seconds"}


@dataclasses.dataclass(frozen=True)
class OffloadArm:
    replicas: int
    tier: str | None  # None, "fs", "fs-shared" or "tiercache"
    restart: bool

    @classmethod
    def parse(cls, name: str) -> "OffloadArm":
        if name not in OFFLOAD_ARMS:
            raise ValueError(f"not an offloading arm: {name!r}")
        base = name.removeprefix("two-").removesuffix("-again").removesuffix("-restart")
        tier = base.removeprefix("offload").removeprefix("-") or None
        return cls(2 if name.startswith("two-") else 1, tier, name.removesuffix("-again").endswith("-restart"))


def offloading(settings, pool_bytes: int, tiers: list[dict]):
    """`settings` with vLLM's offloading: a pool of `pool_bytes` and these secondary tiers, the worker stood in. A
    load that fails is recomputed, as in the connector's arms (vLLM's default for it is to fail the request)."""
    return own_pool(dataclasses.replace(
        settings, offload={"cpu_bytes_to_use": pool_bytes, "offload_prompt_only": False, "secondary_tiers": tiers},
        testkit={**settings.testkit, "TIERCACHE_OFFLOAD_WORKER": "1"},
        testkit_lines=(*settings.testkit_lines, STOOD_IN_LINE)))


def own_pool(settings):
    """The settings with a pool name of their own (vLLM names the pool file by it: two engines, or an engine and the
    one it replaces, must not share one); settings without offloading unchanged."""
    if settings.offload is None:
        return settings
    return dataclasses.replace(settings, offload_id=f"lab-{uuid.uuid4().hex[:12]}")


def fs_tier(root: Path) -> dict:
    return {"type": "fs", "root_dir": str(root)}


def tiercache_tier(model_dir: str, url: str) -> dict:
    """The entry a user's `tiercache vllm-tier` prints for this model (no flags that change its bytes here)."""
    from tiercache.cli.vllm_tier import tier_entry

    return tier_entry(model_dir, [], url)


O_DIRECT_REFUSED = "O_DIRECT is not supported"  # what vLLM's fs tier logs when it falls back to buffered I/O


class FsDirs:
    """The fs tier's directories of one run, each new and empty, removed when the run ends."""

    def __init__(self, work: Path, name: str) -> None:
        self.root = work / f"fs-{name}-{uuid.uuid4().hex[:8]}"

    def facts(self, logs: list[Path]) -> dict:
        """What the fs tier was stored on (the filesystem holding the directories) and whether vLLM wrote it with
        O_DIRECT (its logs say when it could not): a RAM or overlay filesystem is not the disk the docs describe."""
        refused = any(O_DIRECT_REFUSED in log.read_text(errors="replace") for log in logs if log.exists())
        return {"filesystem": filesystem_of(self.root), "o_direct": not refused}

    def __call__(self, replica: int | str) -> Path:
        path = self.root / str(replica)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def offload_figures(text: str) -> dict[str, dict[str, float]]:
    """vLLM's offloading figures from its /metrics text: counters by label, histograms' sum and count (summed over
    their labels)."""
    figures = {key: prometheus_by_label(text, metric, label) for key, (metric, label) in OFFLOAD_COUNTERS.items()}
    for key, metric in OFFLOAD_HISTOGRAMS.items():
        figures[key] = {"sum": prometheus_sum(text, metric + "_sum"), "count": prometheus_sum(text, metric + "_count")}
    return figures


def engine_figures(engine) -> dict[str, dict[str, float]]:
    """One served engine's offloading figures now (a VllmServer)."""
    return offload_figures(scrape(engine.url + "/metrics"))


def tier_activity(engine) -> tuple[float, float]:
    """(the tiers' jobs in flight, the bytes they have written): an engine whose tiers have settled runs no job and
    writes nothing more. vLLM counts a job's bytes only when the job is done, so bytes alone stand still while one
    long store runs: the gauges of jobs in flight say it is still running."""
    text = scrape(engine.url + "/metrics")
    running = sum(prometheus_sum(text, metric) for metric in ACTIVE_JOBS)
    return running, sum(prometheus_by_label(text, OFFLOAD_COUNTERS["tier_write_bytes"][0], "tier").values())


def figures_change(before: list[dict], after: list[dict]) -> dict[str, dict[str, float]]:
    """What the engines' offloading figures grew by over a replay, summed over the engines."""
    change: dict[str, dict[str, float]] = {}
    for old, new in zip(before, after):
        for key, values in new.items():
            into = change.setdefault(key, {})
            for label, value in values.items():
                into[label] = into.get(label, 0.0) + value - old.get(key, {}).get(label, 0.0)
    return {key: {label: round(v, 6) for label, v in values.items() if v} for key, values in change.items()}


def summed(*figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Figures of several phases or engines added up, label by label."""
    total: dict[str, dict[str, float]] = {}
    for each in figures:
        for key, values in each.items():
            into = total.setdefault(key, {})
            for label, value in values.items():
                into[label] = round(into.get(label, 0.0) + value, 6)
    return total


# -- the report ----------------------------------------------------------------------------------------------------

def run_figures(offload: dict) -> dict:
    """One run's (or phase's) offloading figures as the report gives them: hit tokens by source and chunk hits by
    tier; each tier's bytes per job-second (vLLM's accounted bytes over the sum of its jobs' transfer seconds: jobs
    overlap, and a chunk a tier already held counts its bytes at no cost, so this is no bandwidth; tier_bandwidth.py
    measures that); the mean delays (ms) of the scheduler's lookups and of a token; failed jobs."""
    def per_s(moved: dict, seconds: dict) -> dict:
        return {tier: round(moved[tier] / seconds[tier] / 1e9, 3) for tier in moved if seconds.get(tier)}

    def mean_ms(histogram: dict) -> float | None:
        return round(histogram["sum"] / histogram["count"] * 1e3, 3) if histogram.get("count") else None

    return {"hit_tokens_by_source": offload.get("cached_by_source", {}),
            "tier_chunk_hits": offload.get("tier_chunk_hits", {}),
            "tier_read_gb_s": per_s(offload.get("tier_read_bytes", {}), offload.get("tier_read_time_s", {})),
            "tier_write_gb_s": per_s(offload.get("tier_write_bytes", {}), offload.get("tier_write_time_s", {})),
            **{f"{key.removesuffix('_s')}_mean_ms": mean_ms(offload.get(key, {})) for key in OFFLOAD_HISTOGRAMS},
            "failed_jobs": sum(offload.get("tier_promotion_failures", {}).values())
            + sum(offload.get("tier_cascade_failures", {}).values())}


def summary(runs: list[dict]) -> dict:
    """Per offloading arm, each figure's median over its runs (and over their second phases, for a restart arm)."""
    from lab.serving.stats import median_of_runs

    def median(values: list):
        found = median_of_runs(values, lambda value: value)
        return None if found is None else round(found, 3)

    def medians(figures: list[dict]) -> dict:
        out: dict = {}
        for key in figures[0]:
            if isinstance(figures[0][key], dict):
                labels = sorted({label for f in figures for label in f[key]})
                out[key] = {label: median([f[key].get(label, 0.0) for f in figures]) for label in labels}
            else:
                out[key] = median([f[key] for f in figures])
        return out

    arms: dict[str, dict] = {}
    for name in dict.fromkeys(run["arm"] for run in runs):
        results = [run["result"] for run in runs if run["arm"] == name and "offload" in run["result"]]
        if results:
            arms[name] = {"all": {**medians([run_figures(r["offload"]) for r in results]),
                                  "runs_not_settled": sum(not r.get("offload_settled", True) for r in results)}}
            if all("phases" in r for r in results):
                arms[name]["after"] = medians([run_figures(r["phases"]["after"]["offload"]) for r in results])
    return arms


def report_lines(offload: dict) -> list[str]:
    if not offload:
        return []
    lines = ["", "vLLM's offloading (its counters; medians of runs): hit tokens by source, tier chunk hits, tier GB "
             "per job-second (read / write; no bandwidth), mean lookup delay ms (sync, async), mean inter-token ms, "
             "failed jobs:"]
    for name, phases in offload.items():
        for phase, f in phases.items():
            label = name if phase == "all" else "  after restart"
            lines.append(f"  {label:<30} hits {_labels(f['hit_tokens_by_source'])}; chunks "
                         f"{_labels(f['tier_chunk_hits'])}; GB/job-s {_labels(f['tier_read_gb_s'])} / "
                         f"{_labels(f['tier_write_gb_s'])}; lookups {f['lookup_sync_delay_mean_ms']}, "
                         f"{f['lookup_async_delay_mean_ms']} (tier {f['tier_lookup_sync_delay_mean_ms']}, "
                         f"{f['tier_lookup_async_delay_mean_ms']}); token {f['inter_token_mean_ms']}; failed "
                         f"{f['failed_jobs']}" + (f"; NOT SETTLED in {f['runs_not_settled']} runs"
                                                  if f.get("runs_not_settled") else ""))
    return lines


def _labels(values: dict) -> str:
    return ", ".join(f"{label} {value:,g}" for label, value in values.items() if value) or "-"


def filesystem_of(path: Path) -> str:
    """The type of the filesystem mounted at the longest prefix of `path` (/proc/mounts), or "unknown"."""
    path = str(path.resolve())
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")) \
                and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind
