"""Which CPU the engine tests run vLLM's CPU build as: this machine's, or a lower level stood in
(`TIERCACHE_TEST_CPU`, testkit/site/sitecustomize.py), so one machine proves both of vLLM's CPU branches
(tests/vllm_engine/test_block_size.py) and the whole engine suite can run as on an AVX2 server
(`make test-vllm-engine TEST_CPU=avx2`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tiercache.prefix.cpu_features import CpuFeatures, detect, parse

ENV = "TIERCACHE_TEST_CPU"
SITE = Path(__file__).resolve().parents[1] / "site"  # testkit/site: its sitecustomize


def engine_cpu(level: str | None = None) -> CpuFeatures:
    """The CPU vLLM sees in an engine started with `level` stood in (default: the suite's, else this machine)."""
    if level:
        return dataclasses.replace(parse(level), source=f"{level} stood in")
    suite = os.environ.get(ENV)
    return dataclasses.replace(parse(suite), source=f"{ENV}={suite}, stood in") if suite else detect()


def engine_env(env: dict, pythonpath: str, level: str | None = None) -> dict:
    """`env` for an engine process with `pythonpath` first and the stand-in after it: `level`, else the suite's."""
    level = level or os.environ.get(ENV)
    if not level:
        return {**env, "PYTHONPATH": pythonpath}
    return {**env, ENV: level, "PYTHONPATH": os.pathsep.join([pythonpath, str(SITE)])}
