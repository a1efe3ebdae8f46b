"""Real Redis servers for the tests and the lab (not part of the package): a `redis-server`
on a free loopback port (`RedisProcess`, awaited through PING) and a Redis Cluster of such servers
(`RedisClusterProcess`, created with redis-cli and awaited until every node reports cluster_state:ok).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile

from testkit.polling import wait_for
from tiercache.process import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def _ephemeral_start() -> int:
    """The first port the kernel hands to outgoing connections (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_port() -> int:
    """A free port p whose cluster-bus port p + 10000 is free too (Redis Cluster needs both), both below the ports
    the kernel gives outgoing connections: a port free now but in that range can be taken by any client's socket
    before the node binds it (seen in CI: a node exited at start)."""
    highest = max(_ephemeral_start() - 10001, 11000)
    for _ in range(200):
        port = random.randint(10000, highest)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisProcess:
    """A real redis-server on a free loopback port, in its own temp dir, with persistence off."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed: run scripts/install.sh")
        self.port = port or free_port()
        self.extra_args = extra_args
        self.dir = tempfile.mkdtemp(prefix="tiercache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        # jemalloc decay off: large values no longer fall off a cliff (docs/operations.md, "Redis servers";
        # the numbers are there); the deployment sets the same for its Redis servers.
        env = {**os.environ, "MALLOC_CONF": REDIS_MALLOC_CONF}
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        wait_for(self.ready, timeout_s=10, what=f"redis-server to answer PING on port {self.port}")
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


class RedisClusterProcess:
    """A real Redis Cluster on loopback: `masters` primaries with `replicas` replicas each, created with redis-cli
    and awaited until every node reports cluster_state:ok."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.nodes = [RedisProcess("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                                   "--cluster-config-file", f"nodes-{i}.conf", port=free_cluster_port())
                      for i in range(masters * (1 + replicas))]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @staticmethod
    def _start_node(node: RedisProcess, attempts: int = 3) -> None:
        """Start a node, on other free ports if its own were taken meanwhile (the cluster is not formed yet)."""
        for attempt in range(attempts):
            try:
                node.start()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                node.port = free_cluster_port()

    def start(self, timeout_s: float = 60.0) -> "RedisClusterProcess":
        redis_cli = shutil.which("redis-cli")
        if redis_cli is None:
            raise RuntimeError("redis-cli is not installed: run scripts/install.sh")
        try:
            for node in self.nodes:
                self._start_node(node)
            subprocess.run([redis_cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
            self.wait_ok(timeout_s)
            # A replica that never finished its first sync cannot take over: wait for every link to be up.
            replicas = len(self.nodes) - len(self.nodes) // (1 + self.replicas)
            wait_for(lambda: sum(self._synced(n) for n in self.nodes) >= replicas, timeout_s=timeout_s,
                     what="the Redis Cluster replicas to finish their first sync", interval_s=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _synced(node: RedisProcess) -> bool:
        info = node.client().info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        wait_for(lambda: all(self._ok(n) for n in self.live_nodes()), timeout_s=timeout_s,
                 what="the Redis Cluster to reach cluster_state:ok", interval_s=0.05)

    def kill_master(self, timeout_s: float = 30.0) -> RedisProcess:
        """SIGKILL one primary and wait until a replica has taken over its slots on every live node's view."""
        victim = self.masters()[0]
        victim.kill()
        wait_for(lambda: all(self._ok(n) and not self._serves(n, victim.port) for n in self.live_nodes()),
                 timeout_s=timeout_s, what=f"a replica to take over the slots of port {victim.port}", interval_s=0.05)
        return victim

    @staticmethod
    def _serves(node: RedisProcess, port: int) -> bool:
        """Whether `node` still routes some slot to the server on `port`."""
        try:
            slots = node.client().cluster("SLOTS")
        except Exception:  # noqa: BLE001
            return True
        return any(entry[2][1] == port for entry in slots)

    def live_nodes(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def masters(self) -> list[RedisProcess]:
        return [n for n in self.live_nodes() if n.client().info("replication").get("role") == "master"]

    @staticmethod
    def _ok(node: RedisProcess) -> bool:
        try:
            return node.client().cluster("INFO").get("cluster_state") == "ok"
        except Exception:  # noqa: BLE001 - a node still starting or failing over
            return False

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
