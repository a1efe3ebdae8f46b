"""The shared-prefix scenario of tests/events/test_router_agreement.py (testkit/router_agreement.py), timed: a hybrid
pod and an attention-advertising one on two `tiercache serve --events` servers, llm-d-rules routers caught up before
every request of a Mooncake trace slice (every conversation under the same first chunks). The restorable index's flush
cost shows in the wait for the routers to catch up (docs/events.md, "What a flush costs").

    .venv/bin/python -m benchmarks.events_shared_prefix REQUESTS FLUSH_S     # e.g. 48 0.01
"""

import sys
import tempfile
import time
from pathlib import Path

from testkit.router_agreement import HYBRID, serve_slice, start_pod, trace_slice


def main(n: int, flush: float) -> None:
    requests = trace_slice(n, 128, 1000)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(tmp) / f"pod{i}" for i in range(2)]
        for f in folders:
            f.mkdir()
        pods = [start_pod(folders[0], HYBRID, flush_interval_s=flush),
                start_pod(folders[1], HYBRID, "--events-advertise", "attention", flush_interval_s=flush)]
        try:
            start = time.perf_counter()
            exact, ignorant = serve_slice(requests, *pods)
            took = time.perf_counter() - start
        finally:
            for pod in pods:
                pod.close()
    print(f"{n} requests, flush {flush}s: {took:.1f} s; agree {exact.agreeing()}/{n}, router==predicted "
          f"{exact.router == exact.predicted}")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
