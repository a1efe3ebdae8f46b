"""`make test-wheel` (scripts/test_wheel.sh) builds the sdist and the wheel from a copy of the checkout's files,
installs the wheel into a fresh venv, and runs these tests with TIERCACHE_WHEEL_DIR naming that work directory:

  src/        the copy that was built (tracked and not ignored files: no generated stubs)
  dist/       the sdist and the wheel built from it
  venv/       a fresh venv with the wheel and its declared dependencies

Anywhere else this folder is skipped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

WHEEL_DIR = os.environ.get("TIERCACHE_WHEEL_DIR")

if WHEEL_DIR is None:
    collect_ignore_glob = ["*.py"]


@pytest.fixture(scope="session")
def work() -> Path:
    return Path(WHEEL_DIR)


@pytest.fixture(scope="session")
def wheel(work) -> Path:
    (found,) = (work / "dist").glob("*.whl")
    return found


@pytest.fixture(scope="session")
def sdist(work) -> Path:
    (found,) = (work / "dist").glob("*.tar.gz")
    return found


def serving(port: int) -> bool:
    """The server on this loopback port answers SERVING to a health check."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def run(*command, **options) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, **options)
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result
