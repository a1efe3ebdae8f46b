"""The product's tests' fixtures: Redis servers, in-process cache servers on free ports, a port nobody answers. The
session's own home and its skips' record come from testkit.pytest_session, which lab/tests loads too."""

from __future__ import annotations

import socket

import pytest

from testkit.redis_processes import RedisProcess
from tiercache.config import (Config, DiskTierConfig, EventsConfig, HostTierConfig, MiB, RedisTierConfig,
                              SecurityConfig, ServerConfig)
from tiercache.server.app import CacheServer

pytest_plugins = ("testkit.pytest_session",)


@pytest.fixture
def redis_proc():
    proc = RedisProcess().start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def shared_redis():
    """One redis-server for tests that only need a working Redis; each test flushes it first."""
    proc = RedisProcess().start()
    yield proc
    proc.stop()


@pytest.fixture
def redis_url(shared_redis):
    shared_redis.client().flushall()
    return shared_redis.url


def make_config(tmp_path, *, host_bytes=64 * MiB, disk_bytes=128 * MiB, redis_url=None, write_through=False,
                shared_memory=True, redis_cluster=False, security=SecurityConfig(), redis_options=None,
                disk_options=None, events=EventsConfig(), **server) -> Config:
    return Config(
        server=ServerConfig(**{"port": 0, **server}),
        host=HostTierConfig(capacity_bytes=host_bytes, shared_memory=shared_memory),
        disk=DiskTierConfig(**{"path": str(tmp_path / "disk"), "capacity_bytes": disk_bytes, **(disk_options or {})}),
        redis=RedisTierConfig(url=redis_url, write_through=write_through, max_backoff_s=0.5, cluster=redis_cluster,
                              **(redis_options or {})),
        security=security,
        events=events,
    )


@pytest.fixture
def hung_port():
    """A listening socket nobody ever reads: the kernel completes TCP handshakes, the 'server' answers nothing."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    yield listener.getsockname()[1]
    listener.close()


@pytest.fixture
def start_server(tmp_path):
    """Start in-process servers on free ports: start_server(**make_config options) -> CacheServer."""
    servers = []

    def start(**options) -> CacheServer:
        # Each server its own disk directory, as each node has its own disk: the disk tier locks its directory, and
        # two "nodes" of a test on one directory would have indexed and evicted each other's files.
        disk = tmp_path / ("disk" if not servers else f"disk-{len(servers) + 1}")
        options["disk_options"] = {"path": str(disk), **(options.get("disk_options") or {})}
        server = CacheServer(make_config(tmp_path, **options)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0)

