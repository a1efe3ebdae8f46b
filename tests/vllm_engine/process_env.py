"""The environment of the vLLM processes tests/vllm_engine/test_early_refusals.py and test_block_size.py start
themselves: tiercache from this checkout, vLLM on the CPU, and every cache (tiercache's weight hashes, vLLM's,
Hugging Face's) under the test's tmp dir, never the user's home; no usage reports; the suite's CPU stood in, or
`cpu_level`'s (testkit/cpu_stand_in)."""

from __future__ import annotations

import os
from pathlib import Path

from testkit.cpu_stand_in import engine_env
from testkit.vllm_engine import ROOT


def process_env(tmp_path: Path, cpu_level: str | None = None) -> dict:
    return engine_env({**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_TARGET_DEVICE": "cpu",
                       "XDG_CACHE_HOME": str(tmp_path / "cache"), "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
                       "HF_HOME": str(tmp_path / "hf"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
                      str(ROOT), cpu_level)
