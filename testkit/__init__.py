"""The engine patches tests and the lab's served engines both need, in one place: never shipped (the package never
imports it; tests/test_architecture.py holds that line), imported by tests/ and benchmarks/ alike.

`offload_worker`: vLLM's CPU offloading worker on vLLM's CPU platform (its four CUDA-only points stood in).
"""
