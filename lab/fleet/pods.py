"""Simulated pods of the fleet benchmark: each a SimulatedEngine (tiercache.bench: lookup -> load -> save through
PrefixCache, the connector's real path, objects of the layout's real byte sizes, the anchor group's kv chunks with
their tokens and a stand-in engine block hash, as the vLLM connector sends them) beside its own `tiercache serve
--events` process, registered as a pod, so a router can follow its KV events on real ZMQ sockets.

`advertise` is the server's events.advertise: "restorable" (what tiercache can restore: the hit rule) or
"attention" (every saved attention block, checkpoints ignored: what a hybrid engine's own events tell a router).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiercache.bench import SimulatedEngine
from tiercache.client import Client
from tiercache.connector.prefix_cache import PrefixCache
from tiercache.prefix.objects import CacheSpec
from tiercache.process import ServerProcess


class TimedCache(PrefixCache):
    """PrefixCache that measures what a request waits for before its first token can be computed: the lookup and
    the load of the hit (saves happen after, off the first token's path)."""

    def lookup(self, tokens):
        start = time.perf_counter()
        try:
            return super().lookup(tokens)
        finally:
            self.lookup_s = time.perf_counter() - start

    def load_with_tiers(self, hit):
        start = time.perf_counter()
        try:
            return super().load_with_tiers(hit)
        finally:
            self.load_s = time.perf_counter() - start


@dataclass(frozen=True)
class ServedRequest:
    prompt_tokens: int
    hit_tokens: int
    wait_s: float  # lookup + load, measured
    done_at: float  # time.time() when its saves had returned (the router catches up to this)


@dataclass(frozen=True)
class EventSettings:
    """The servers' events section. A flush at most every `flush_interval_s`, and a batch on every stream at least
    every `heartbeat_s`: a router knows it has caught up with a request's saves once it holds two batches stamped
    after them (lab/fleet/router.py), so short intervals keep that wait short."""

    flush_interval_s: float = 0.01
    heartbeat_s: float = 0.01

    def write(self, path: Path) -> Path:
        path.write_text(f"events:\n  flush_interval_s: {self.flush_interval_s}\n"
                        f"  heartbeat_s: {self.heartbeat_s}\n")
        return path


class SimulatedPod:
    def __init__(self, name: str, model: str, spec: CacheSpec, *, advertise: str, host_mem: str, disk_size: str,
                 seed: int, events: EventSettings = EventSettings()) -> None:
        self.name, self.model, self.spec = name, model, spec
        self.work = tempfile.mkdtemp(prefix=f"tiercache-fleet-{name}-")
        config = events.write(Path(self.work) / "events.yaml")
        self.server = ServerProcess("--config", str(config), "--disk-dir", str(Path(self.work) / "disk"), "--events",
                                    "--events-advertise", advertise, "--host-mem", host_mem,
                                    "--disk-size", disk_size, "--stats-log-interval", "0")
        self.client: Client | None = None
        self.seed = seed

    def start(self) -> "SimulatedPod":
        self.server.start()
        self.client = Client.from_url(self.server.url, timeout_s=120)
        self.cache = TimedCache(self.client, self.spec, report=False)
        self.engine = SimulatedEngine(self.cache, self.seed, engine_blocks=True)
        self.endpoints = self.client.register_pod(self.name, self.model, self.cache.rank_namespaces(),
                                                  self.spec.shape, range(len(self.spec.shape.kinds)))
        return self

    def serve(self, prompt: np.ndarray, output: np.ndarray) -> ServedRequest:
        request = self.engine.run(prompt, output)
        return ServedRequest(request.prompt_tokens, request.hit_tokens, self.cache.lookup_s + self.cache.load_s,
                             time.time())

    def tiers(self) -> dict:
        keep = ("evictions", "demotions", "used_bytes", "capacity_bytes")
        return {t["name"]: {k: t[k] for k in keep} for t in self.client.stats()["tiers"]}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.server.kill()
        shutil.rmtree(self.work, ignore_errors=True)
