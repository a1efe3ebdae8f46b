"""Real-engine tests: SGLang 0.5.23's own engine on the CPU (scheduler, model runner, radix caches, HiCache
controller, storage prefetch and backup) with tiny random-weight models, through TierCacheStorage and a real
`tiercache serve`.

They run in .venv-sglang with the engine's extra packages (`make install-sglang-engine`; `make test-sglang-engine`
runs them); anywhere else this folder is skipped. What the engines load to run on this CPU is testkit/sglang_site
(sitecustomize).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.sglang_engine.scenarios import build
from tiercache.process import ServerProcess

_ENGINE = all(importlib.util.find_spec(name) is not None for name in ("sglang", "uvloop", "fastapi", "xgrammar"))

if not _ENGINE:
    collect_ignore_glob = ["*.py"]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def scenario_server():
    """The cache server of the session's scenarios (scenarios.py): host memory only."""
    proc = ServerProcess("--host-mem", "256MiB", "--disk-size", "0").start()
    yield proc
    proc.kill()


def _scenario(kind: str, models_dir, scenario_server, tmp_path_factory):
    scenario = build(kind, models_dir, scenario_server.url, tmp_path_factory.mktemp(f"{kind}-engine-logs"),
                     tmp_path_factory.mktemp(f"{kind}-hicache-file"))
    yield scenario
    scenario.reader.close()


@pytest.fixture(scope="session")
def dense_scenario(models_dir, scenario_server, tmp_path_factory):
    """The dense restore (scenarios.py), its tiercache reader up until the session ends (test_planted_faults.py)."""
    yield from _scenario("dense", models_dir, scenario_server, tmp_path_factory)


@pytest.fixture(scope="session")
def hybrid_scenario(models_dir, scenario_server, tmp_path_factory):
    """The hybrid restore (scenarios.py), its tiercache reader up until the session ends."""
    yield from _scenario("hybrid", models_dir, scenario_server, tmp_path_factory)


@pytest.fixture(scope="module")
def server():
    """A cache server for one module's engines: host memory only (a module that needs a disk or tenants starts its
    own under this name)."""
    proc = ServerProcess("--host-mem", "256MiB", "--disk-size", "0").start()
    yield proc
    proc.kill()
