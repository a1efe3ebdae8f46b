"""tiercache's log lines in vLLM's log: the connector's start line, its refusals and warnings, the client's notes on
an unreachable server, in vLLM's format, level and stream.

vLLM configures its own logger tree ("vllm", with one handler, not propagating) and leaves the root logger alone, so
a line logged under "tiercache" went nowhere at INFO: docs/first-deployment.md's first check (the connector's
"TierCacheConnector (SCHEDULER) on grpc://..." line) found nothing. The connector hands vLLM's handler to the
"tiercache" logger when it is made; where the user configured "tiercache" logging themselves, or turned vLLM's
logging off (VLLM_CONFIGURE_LOGGING=0), nothing is changed. tests/vllm_engine/test_async_scheduling.py reads the line
in a real engine's log.
"""

from __future__ import annotations

import logging


def join_vllm_log() -> None:
    ours, theirs = logging.getLogger("tiercache"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level if theirs.level != logging.NOTSET else logging.INFO)
    # Still propagating: in vLLM's processes the root logger has no handler (nothing is printed twice), and a test's
    # or a user's root handler still sees tiercache's records.
