"""`make test-wheel` (scripts/test_wheel.sh): tiercache installed from its wheel into vLLM's CPU engine environment.
The tests run from a copy outside the checkout, so neither this process, the cache server nor the engines can import
the checkout's tiercache; test_hits.py's first test runs beside these on the real engine, and the harness checks that
every engine with the connector loaded it from the wheel. Skipped elsewhere (`make test-vllm-engine` runs the
editable install)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tiercache
from testkit.vllm_engine import ROOT, WHEEL_SITE

pytestmark = pytest.mark.skipif(WHEEL_SITE is None, reason="make test-wheel runs it, against the installed wheel")


def test_this_process_and_the_cache_server_import_the_installed_wheel(cache_server):
    assert Path(tiercache.__file__).is_relative_to(WHEEL_SITE), tiercache.__file__
    assert not (ROOT / "tiercache").exists(), "the tests run from a copy of tests/ alone"
    assert importlib.metadata.distribution("tiercache-llm").locate_file("tiercache").is_relative_to(WHEEL_SITE)
    # The server is `python -m tiercache` run by this interpreter, in a directory without a tiercache of its own.
    assert cache_server.process.args[:3] == [sys.executable, "-m", "tiercache"]
    assert not (Path(f"/proc/{cache_server.process.pid}/cwd").resolve() / "tiercache").exists()


def test_the_engine_environment_satisfies_the_wheels_requirements():
    """The wheel went in with --no-deps: vLLM's environment must already hold what it declares (no torch among them:
    the engine's own torch is never touched)."""
    required = [Requirement(r) for r in importlib.metadata.requires("tiercache-llm") or []]
    base = [r for r in required if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert base and not any(r.name == "torch" for r in base)
    for requirement in base:
        version = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement}: vLLM's env has {version}"

