"""The package's micro-benchmarks: each times one part of tiercache (a data path, the eviction index, the kernels, a
restart, a soak...) beside the baseline that bounds it, measured in the same run. Never shipped; each runs as a module
from the checkout's root, so that the checkout's own tiercache is the one timed:

    .venv/bin/python -m benchmarks.put_get [--path data|grpc|same-host]

Each module's docstring says what it measures and how to run it; docs/benchmarks.md and docs/performance.md have the
results. The serving lab (real engines, traces, routers) is lab/; what benchmarks, lab and tests share is testkit/.
"""
