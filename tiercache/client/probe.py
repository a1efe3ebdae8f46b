"""Is there a tiercache server at a URL? One Stats call, asked before a command starts its work.

Without it, `tiercache stats` against a dead server printed gRPC's raw text, `tiercache demo --server <dead>` exited 0
after ~20 warnings with "warm ... 0" rows, and `tiercache bench cliff --server <dead>` ran ~50 s through ~110
warnings before failing: every call of theirs turns an unreachable server into a miss and goes on, which is right for
an engine and wrong for a command whose whole point is the server (tests/test_cli.py).
"""

from __future__ import annotations

from tiercache.client.client import Client
from tiercache.client.retry import RetryPolicy
from tiercache.errors import TimedOut, Unavailable


def require_server(url: str, timeout_s: float = 10.0) -> dict:
    """The server's stats (a call that goes through its store), or Unavailable with one line that says what to do.
    One try: a refused connection fails at once; a server that does not answer, after `timeout_s`."""
    with Client.from_url(url, timeout_s=timeout_s, retry=RetryPolicy(attempts=1)) as client:
        try:
            return client.stats()
        except Unavailable as exc:
            if isinstance(exc, TimedOut):
                raise Unavailable(f"the tiercache server at {url} did not answer within {timeout_s:g} s") from None
            raise Unavailable(f"no tiercache server at {url}: is `tiercache serve` running?") from None
