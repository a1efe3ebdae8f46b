"""The simulated clock of the fleet benchmark: each pod a first-come-first-served queue of prefills.

A simulated pod has no GPU; what a request would cost it is modelled, on the trace's own (scaled) clock:
- service = the lookup and the load of its hit, measured on the real server (wall time), + the prompt tokens not hit
  x a per-token prefill cost (--prefill-ms-per-token; calibrated on a real engine, see fleet_trace.py) + the output
  tokens x a per-token decode cost (--decode-ms-per-token, 0 by default: decode is batched with other requests'
  prefills on a real engine and not modelled);
- a pod prefills one request at a time, in arrival order: a request starts when it arrives or when the pod's
  previous request is done, whichever is later; TTFT = the wait in the queue + the service.
So a router that sends most requests to one pod turns hits into queueing: the model charges it for that.
"""

from __future__ import annotations

from typing import Iterable


class PodClocks:
    def __init__(self, pods: Iterable[str]) -> None:
        self.busy_until = {pod: 0.0 for pod in pods}

    def backlog(self, at: float) -> dict[str, float]:
        """Seconds of work each pod still has queued at time `at`: a router's load signal."""
        return {pod: max(0.0, busy - at) for pod, busy in self.busy_until.items()}

    def admit(self, pod: str, arrival: float, service: float, decode: float = 0.0) -> tuple[float, float]:
        """Queue a request whose first token takes `service` and its other tokens `decode` more; its (queueing,
        TTFT) in seconds."""
        start = max(arrival, self.busy_until[pod])
        self.busy_until[pod] = start + service + decode
        return start - arrival, start - arrival + service
