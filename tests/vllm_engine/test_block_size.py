"""`tiercache layout --platform cpu` prints the N vLLM's CPU engine chooses, before the engine starts
(tiercache.prefix.block_size): for both test models, and for a flag that changes it (a bf16 GDN state, which the
CPU kernel keeps), on this machine's CPU and on an AVX2 one stood in (testkit/cpu_stand_in: vLLM's capability checks
answer as on an AVX2 server), so one machine proves both of vLLM's CPU branches (on an AVX2 machine, or with the
suite's CPU stood in at AVX2, the first runs are AVX2's already and the stood-in ones are not repeated). The
engine's own word is the connector's start line (`N=` is the block size of vLLM's KVCacheConfig) and, where vLLM
raised its block size above the CPU default of 128, its "Setting attention block size to N tokens" line.
Each engine's N is also written to the file TIERCACHE_ENGINE_NS names, which .ci/run prints.

The engines are the suite's (forked where they can be, testkit/vllm_zygote.py; their caches under the session's home);
`tiercache layout` keeps its caches under the test's tmp dir (tests/vllm_engine/process_env.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from testkit.cpu_stand_in import ENV, engine_cpu
from testkit.vllm_engine import EngineProcess
from testkit.vllm_models import FOUR_LAYER, SIX_LAYER
from tests.vllm_engine.process_env import process_env

CPU_DEFAULT_BLOCK = 128  # CpuPlatform.check_and_update_config, without --block-size


def engine_log(tmp_path, model_dir: str, url: str, options: dict, cpu_level: str | None = None) -> str:
    """Start an engine with the connector, wait until it is ready (the connector is made once vLLM sized its KV
    cache), stop it, and return its log. Forked from the suite's zygote unless a CPU is stood in for it (that one
    starts from scratch: the stand-in is loaded at interpreter start)."""
    log_path = tmp_path / "engine.log"
    engine = EngineProcess(model_dir, url, log_path, cpu_level=cpu_level, prefix_cache_retention_interval=0,
                           **options)
    engine.close()
    return log_path.read_text(errors="replace")


@pytest.mark.timeout(900)  # a whole engine start (the connector is made last), on a shared CI machine
@pytest.mark.parametrize("model,options,flags,cpu_level", [
    pytest.param(FOUR_LAYER, {}, [], None, id="4-layer"),
    pytest.param(SIX_LAYER, {}, [], None, id="6-layer"),
    pytest.param(FOUR_LAYER, {"mamba_ssm_cache_dtype": "bfloat16"}, ["--mamba-ssm-cache-dtype", "bfloat16"], None,
                 id="4-layer-bf16-state"),
    # AVX2 stood in, where the engines above ran on another CPU (on an AVX2 one they were these runs already); a bf16
    # state there: the flag above changes nothing on AVX2
    *[pytest.param(model, {}, [], "avx2", id=f"{name}-avx2-stood-in") for model, name in
      ((FOUR_LAYER, "4-layer"), (SIX_LAYER, "6-layer")) if engine_cpu().name != "avx2"],
])
def test_layout_prints_the_n_the_engine_chooses(tmp_path, models_dir, cache_server, model, options, flags,
                                                cpu_level):
    model_dir = model.write(models_dir)
    log = engine_log(tmp_path, model_dir, cache_server.url, options, cpu_level)
    started = re.search(r"TierCacheConnector \(SCHEDULER\) on \S+: namespace \S+, N=(\d+), u=(\d+)", log)
    assert started, log[-3000:]
    engine_n, engine_u = int(started.group(1)), int(started.group(2))
    raised = re.findall(r"Setting attention block size to (\d+) tokens", log)
    assert raised == ([str(engine_n)] if engine_n > CPU_DEFAULT_BLOCK else []), raised
    level = cpu_level or os.environ.get(ENV)  # the CPU the engine saw: layout is told it, else reads this machine's
    layout = subprocess.run([sys.executable, "-m", "tiercache", "layout", "--platform", "cpu", "--json", model_dir,
                             *flags, *(["--cpu-features", level] if level else [])],
                            capture_output=True, text=True, timeout=120, env=process_env(tmp_path))
    assert layout.returncode == 0, layout.stderr
    report = json.loads(layout.stdout)
    _record(f"{model.name}{''.join(' ' + f for f in flags)} on {report['cpu']} ({report['cpu_rule'].split(':')[0]}): "
            f"engine N={engine_n}, layout N={report['block_tokens']}")
    assert (report["block_tokens"], report["match_unit"]) == (engine_n, engine_u), report["cpu_rule"]
    assert engine_u == 16
    if not options:  # the N the other engine tests assume for this CPU (testkit/vllm_models.py)
        assert engine_n == model.sizing(cpu_level).block_tokens
    # vLLM took the branch of the CPU it was given (so a stand-in that did not take cannot pass where N is equal)
    accelerated = engine_cpu(cpu_level).accelerated_gdn
    assert ("Reset SSM cache type to float32" in log) == (accelerated and not options), log[-3000:]
    assert ("Using bfloat16 SSM state storage" in log) == (accelerated and bool(options)), log[-3000:]


def _record(line: str) -> None:
    path = os.environ.get("TIERCACHE_ENGINE_NS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
