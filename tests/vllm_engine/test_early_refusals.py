"""A configuration TierCacheConnector refuses is refused while vLLM validates its config, before an engine core
exists (tiercache.connector.vllm.preflight): the refusal is the last line of the only traceback, said once, and the
model is never loaded. Before, it came ~90 s into the start inside the engine core, under vLLM's "Engine core
initialization failed". Shown on vLLM's CPU engine both ways a user starts one: `LLM(...)` (the harness's engine
process) and the OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs). And
`tiercache check-vllm`, given the same flags, says the same line before anything starts.

The harness's engine is forked from the suite's zygote (testkit/vllm_zygote.py), as the suite's engines are; the
OpenAI server and `tiercache check-vllm` keep their caches under the test's tmp dir
(tests/vllm_engine/process_env.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.vllm_engine import process_env as engine_env
from testkit.vllm_models import FOUR_LAYER
from testkit.vllm_zygote import spawn
from tests.helpers import free_port
from tests.vllm_engine.process_env import process_env

CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
NO_PREFIX_CACHING = ("TierCacheConnector needs vLLM's Mamba cache mode 'align', got 'none' (no state kept per block): "
                     "start vLLM with --enable-prefix-caching (vLLM {version} derives the mode from it")
UNKNOWN_KEY = "unknown kv_connector_extra_config keys for TierCacheConnector: urll"
# Lines an engine core logs as it starts, and its worker as it loads the model: none may appear before a refusal.
ENGINE_STARTED = ("Initializing a V1 LLM engine", "Starting to load model", "Engine core initialization failed",
                  "(EngineCore")


def assert_refused_early(log: str, refusal: str) -> None:
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines[-1].startswith(f"tiercache.errors.InvalidArgument: {refusal}"), log[-3000:]
    assert log.count(refusal) == 1, log[-3000:]
    assert not [marker for marker in ENGINE_STARTED if marker in log], log[-3000:]


def check_vllm(tmp_path: Path, model_dir: str, *flags: str) -> list[str]:
    """`tiercache check-vllm --platform cpu MODEL FLAGS` in this venv (beside vLLM, which it does not import)."""
    result = subprocess.run([sys.executable, "-m", "tiercache", "check-vllm", "--platform", "cpu", model_dir, *flags],
                            capture_output=True, text=True, timeout=120, env=process_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    return [line.removeprefix("refused: ") for line in result.stdout.splitlines() if line.startswith("refused: ")]


@pytest.fixture(scope="module")
def model_dir(models_dir):
    return FOUR_LAYER.write(models_dir)


@pytest.mark.parametrize("case", ["no-prefix-caching", "unknown-key"])
def test_llm_refuses_before_its_engine_core_starts(tmp_path, model_dir, case):
    import vllm

    extra = {"url": f"grpc://127.0.0.1:{free_port()}", **({"urll": 1} if case == "unknown-key" else {})}
    settings = {"model": model_dir, "connector": extra, "prefix_cache_retention_interval": 0,
                "enable_prefix_caching": case != "no-prefix-caching"}
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        engine = spawn(json.dumps(settings), engine_env(), log)  # forked from the suite's zygote
        engine.stdin.close()
        said = engine.stdout.read()
        engine.wait(timeout=600)
    assert engine.returncode != 0 and said == ""  # never ready
    refusal = NO_PREFIX_CACHING.format(version=vllm.__version__) if case == "no-prefix-caching" else UNKNOWN_KEY
    assert_refused_early(log_path.read_text(errors="replace"), refusal)
    # The preflight says it from the flags alone.
    flags = ["--kv-transfer-config", json.dumps({**CONNECTOR, "kv_connector_extra_config": extra})]
    if case == "no-prefix-caching":
        flags.append("--no-enable-prefix-caching")
    [said] = check_vllm(tmp_path, model_dir, *flags)
    assert said.startswith(refusal)


def test_the_openai_server_refuses_before_its_engine_core_starts(tmp_path, model_dir):
    import vllm

    transfer = {**CONNECTOR, "kv_connector_extra_config": {"url": f"grpc://127.0.0.1:{free_port()}"}}
    flags = ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(transfer)]
    # The memory flags are the harness's: were the refusal late, the engine core would start and reach the connector.
    server = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                             "--host", "127.0.0.1", "--port", str(free_port()), "--skip-tokenizer-init",
                             "--max-model-len", "4096", "--kv-cache-memory-bytes", str(256 << 20), *flags],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
                            env=process_env(tmp_path), cwd=tmp_path)
    assert server.returncode != 0
    refusal = NO_PREFIX_CACHING.format(version=vllm.__version__)
    assert_refused_early(server.stdout + server.stderr, refusal)
    [said] = check_vllm(tmp_path, model_dir, *flags)
    assert said.startswith(refusal)
