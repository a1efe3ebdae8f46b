"""Real processes on free loopback ports, awaited for readiness (never a fixed sleep): `tiercache serve` (through
the gRPC health service) and `redis-server` (through PING). Used by `tiercache bench`, `tiercache demo`, the
benchmarks and the tests.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.args = ["--port", str(self.port), *args]
        self.env = env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "ServerProcess":
        self.process = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", *self.args], env=self.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while not self.serving():
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"tiercache serve did not become ready on port {self.port} in {timeout_s}s")
            time.sleep(0.02)
        return self

    def serving(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"tiercache serve exited with {self.process.returncode}: {self.process.stderr.read()}")
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self, timeout_s: float = 15.0) -> tuple[int, str]:
        """SIGTERM, wait for a graceful exit; returns (exit code, stderr)."""
        self.process.terminate()
        _, err = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, err

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


class RedisProcess:
    """A real redis-server on a free loopback port, in its own temp dir, with persistence off."""

    def __init__(self, *extra_args: str) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed: run scripts/install.sh")
        self.port = free_port()
        self.extra_args = extra_args
        self.dir = tempfile.mkdtemp(prefix="tiercache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.01)
        return self

    def ready(self) -> bool:
        import redis

        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.process.returncode}")
        try:
            return redis.Redis(port=self.port, socket_timeout=0.5).ping()
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self):
        import redis

        return redis.Redis(port=self.port)
