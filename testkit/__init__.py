"""What the tests and the lab (lab/, benchmarks/) both need, in one place: never shipped (the package never imports it;
tests/test_architecture.py holds that line), imported by tests/, lab/ and benchmarks/ alike; it imports none of them.

The pytest plugin both suites load (tests/conftest.py, lab/tests/conftest.py): `pytest_session`, a home of the
session's own and its skips recorded for CI.

Processes the tests and the lab start:
- `redis_processes`: real redis-servers and Redis Clusters on free loopback ports; `polling`: waiting on them.

vLLM's CPU engine, each in a process of its own (the engine tests' and benchmarks/vllm_engine.py's):
- `vllm_engine`: an engine driven from the tests and the lab (`EngineProcess`), over the line protocol of
  `engine_lines`; `vllm_engine_process`: the engine's process, with what it loads there (`vllm_engine_bytes`: the
  bytes a request computes from, digested; `vllm_async_scheduling`; `offload_stats`: vLLM's offloading counters);
  `vllm_zygote`: engines forked from one process that imported vLLM once (`vllm_zygote_process`), for a test session;
- `vllm_models`: the tiny random-weight models the vLLM engines run (written, never downloaded), N from the
  prediction for the engines' CPU; `prompts`: prompts for them.

SGLang's CPU engine, each in a process of its own (the engine tests' and benchmarks/sglang_backend.py's):
- `sglang_engine`: an engine driven from the tests and the lab; `sglang_engine_process`: the engine's process;
  `sglang_site`: the folder on every SGLang process's PYTHONPATH (sitecustomize: what SGLang needs on this CPU, a
  pure-torch `sgl_kernel`, the byte probe and planted faults); `sglang_models`: its tiny models;
- `torchvision_stub`: an import-only torchvision for SGLang's storage pools beside the CPU torch.

Routers reading tiercache's KV events, and the trace they are replayed on (tests/events, tests/dynamo, the lab's fleet):
- `event_subscriber`: a router's end of a pod's event streams (live batches and replays, on real ZMQ sockets);
- `llmd_index`: a router's prefix index following llm-d's rules; `checkpoint_index`: one that also reads tiercache's
  checkpoint events; `llmd_subscriber`: pods' streams fed into either under llm-d's subscriber rules;
- `saved_chunks`: the objects a connector saves for a prompt, made without an engine; `router_agreement`: a router
  following a pod's stream, set against Lookup on a trace slice;
- `mooncake_trace`: Mooncake-format traces turned into prompts; `traces/`: the slice of one that the tests read.

The engine patches the tests and the lab's served engines load:
- `cpu_stand_in`: an engine run as on another CPU (vLLM's capability checks answer for it);
- `copy_on_write`: vLLM 0.32's copy of a partially hit hybrid block, fixed;
- `offload_worker`: vLLM's offloading worker on vLLM's CPU platform (its four CUDA-only points stood in);
- `connector_faults`, `tier_faults`: faults planted in TierCacheConnector's and TierCacheTier's paths, to show the
  gates fail on them;
- `hit_cap`: vLLM's own prefix hit held to a length a request names (the reference engine of the lab's exact replay).
"""
