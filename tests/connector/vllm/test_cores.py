"""The connector's threads, and the threads gRPC starts for it, stay off the cores a CPU engine computes on
(tiercache/connector/vllm/cores.py). A worker bound by vLLM's CPU backend to core 0 stands in for the engine: the
binding is the only thing that matters, and it is real (sched_setaffinity)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, python_env
from tiercache.connector.vllm.cores import born_off_compute_cores

# A fresh interpreter: gRPC starts its threads once per process, with its first channel.
WORKER = """
import json, os
os.sched_setaffinity(0, {0})  # what vLLM's CPU backend does to a worker's compute thread
from tiercache.client import Client
from tiercache.connector.vllm.cores import born_off_compute_cores
client = born_off_compute_cores(lambda: Client.from_url("grpc://127.0.0.1:1"))
threads = {}
for tid in os.listdir("/proc/self/task"):
    try:  # a short-lived thread may end between the listing and these reads: it computes on no core then
        with open(f"/proc/self/task/{tid}/comm") as comm:
            name = comm.read().strip()
        bound = sorted(os.sched_getaffinity(int(tid)))
    except (FileNotFoundError, ProcessLookupError):
        continue
    threads.setdefault(name, []).append(bound)
print(json.dumps({"threads": threads, "main": sorted(os.sched_getaffinity(0))}))
client.close()
"""

GRPC_THREADS = ("event_engine", "grpc_global_tim", "lifeguard")


def cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


@pytest.mark.skipif(len(cores()) < 2 or 0 not in cores(), reason="needs core 0 and another core to bind to")
def test_a_bound_workers_client_starts_grpcs_threads_off_its_compute_cores():
    answer = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, env=python_env(), capture_output=True,
                            text=True, timeout=60)
    assert answer.returncode == 0, answer.stderr
    seen = json.loads(answer.stdout)
    assert seen["main"] == [0]  # the engine's thread keeps its binding
    grpc_threads = [cpus for name, bound in seen["threads"].items() if name in GRPC_THREADS for cpus in bound]
    assert grpc_threads, f"gRPC started no thread this test knows by name: {sorted(seen['threads'])}"
    assert all(0 not in cpus for cpus in grpc_threads)


def test_what_the_call_raises_is_raised_to_the_caller():
    def refuse():
        raise ValueError("no such server")

    with pytest.raises(ValueError, match="no such server"):
        born_off_compute_cores(refuse)


def test_the_call_answers_what_it_made():
    assert born_off_compute_cores(lambda: 42) == 42
