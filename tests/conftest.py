from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile

import pytest

from testkit.redis_processes import RedisProcess
from tiercache.config import (Config, DiskTierConfig, EventsConfig, HostTierConfig, MiB, RedisTierConfig,
                              SecurityConfig, ServerConfig)
from tiercache.server.app import CacheServer


def pytest_configure(config):
    """The whole session (and every server, engine and CLI it starts) gets a home of its own: no test reads or
    writes the user's ~/.cache/tiercache (the default disk tier, locked by a running `tiercache serve`) or anything
    else under their home. Workers of a session share their controller's."""
    if "TIERCACHE_TEST_HOME" not in os.environ:
        home = tempfile.mkdtemp(prefix="tiercache-tests-home-")
        os.environ.update(TIERCACHE_TEST_HOME=home, HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"))
        config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))


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


# -- skips, written down for CI ----------------------------------------------------------------------------------
# `.ci/run` points TIERCACHE_SKIPS_FILE at one file for every suite and then fails on a skip that is not on
# .ci/allowed-skips (scripts/check_skips.py): a test that cannot run in CI must say so there, not pass unseen.
_skipped: list[dict] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append({"test": report.nodeid, "reason": reason.removeprefix("Skipped: ")})


def pytest_sessionfinish(session):
    path = os.environ.get("TIERCACHE_SKIPS_FILE")
    if path and _skipped and not hasattr(session.config, "workerinput"):
        with open(path, "a") as out:
            out.writelines(json.dumps(skip) + "\n" for skip in _skipped)
