"""`tiercache layout --platform cpu` prints the N vLLM's CPU engine chooses, before the engine starts
(tiercache.prefix.block_size): for both test models, and for a flag that changes it (a bf16 GDN state, which the
CPU kernel keeps, halves the 4-layer model's N). The engine's own word is the connector's start line (`N=` is the
block size of vLLM's KVCacheConfig) and, where vLLM raised its block size above the CPU default of 128, its
"Setting attention block size to N tokens" line.

The engines keep their caches under the test's tmp dir (tests/vllm_engine/process_env.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest

from tests.engine_lines import ask
from tests.vllm_engine.harness import ENGINE_SCRIPT
from tests.vllm_engine.models import FOUR_LAYER, SIX_LAYER
from tests.vllm_engine.process_env import process_env

CPU_DEFAULT_BLOCK = 128  # CpuPlatform.check_and_update_config, without --block-size


def engine_log(tmp_path, model_dir: str, url: str, options: dict) -> str:
    """Start an engine with the connector, wait until it is ready (the connector is made once vLLM sized its KV
    cache), stop it, and return its log."""
    settings = {"model": model_dir, "connector": {"url": url}, "prefix_cache_retention_interval": 0, **options}
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), json.dumps(settings)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True, env=process_env(tmp_path))
        try:
            ask(process, threading.Lock(), None, 600, engine="vLLM", kill=process.kill,
                log_tail=lambda: log_path.read_text(errors="replace")[-3000:])
            process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            process.stdin.close()
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return log_path.read_text(errors="replace")


@pytest.mark.timeout(900)  # a whole engine start (the connector is made last), on a shared CI machine
@pytest.mark.parametrize("model,options,flags,n", [
    (FOUR_LAYER, {}, [], 256),
    (SIX_LAYER, {}, [], 128),
    (FOUR_LAYER, {"mamba_ssm_cache_dtype": "bfloat16"}, ["--mamba-ssm-cache-dtype", "bfloat16"], 128),
], ids=["4-layer", "6-layer", "4-layer-bf16-state"])
def test_layout_prints_the_n_the_engine_chooses(tmp_path, models_dir, cache_server, model, options, flags, n):
    model_dir = model.write(models_dir)
    log = engine_log(tmp_path, model_dir, cache_server.url, options)
    started = re.search(r"TierCacheConnector \(SCHEDULER\) on \S+: namespace \S+, N=(\d+), u=(\d+)", log)
    assert started, log[-3000:]
    engine_n, engine_u = int(started.group(1)), int(started.group(2))
    raised = re.findall(r"Setting attention block size to (\d+) tokens", log)
    assert raised == ([str(engine_n)] if engine_n > CPU_DEFAULT_BLOCK else []), raised
    layout = subprocess.run([sys.executable, "-m", "tiercache", "layout", "--platform", "cpu", "--json", model_dir,
                             *flags], capture_output=True, text=True, timeout=120, env=process_env(tmp_path))
    assert layout.returncode == 0, layout.stderr
    report = json.loads(layout.stdout)
    assert (report["block_tokens"], report["match_unit"]) == (engine_n, engine_u) == (n, 16)
