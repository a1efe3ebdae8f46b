"""Ideal hit tokens of a trace slice for a hybrid engine: what a pod whose cache never forgets could resume from.

mooncake_trace.shared_prefixes counts every token a prompt shares with an earlier one. A hybrid engine resumes only
where a recurrent checkpoint was saved: at a multiple of N (the connector saves a state at each block boundary of a
prompt) or at an earlier prompt's end (a state and the tail there). So per request the shared prefix counts when it
ends where an earlier prompt ended, and is rounded down to a multiple of N otherwise; at most the prompt's length - 1
(the engine computes the last token).
"""

from __future__ import annotations

from testkit.mooncake_trace import BLOCK_TOKENS, TraceRequest, shared_prefixes


def resumable_prefix(requests: list[TraceRequest], n: int) -> list[int]:
    """Per request, in order: the tokens an unbounded cache holding every earlier request of `requests` resumes."""
    ends: set[tuple[tuple[int, ...], int]] = set()  # (block ids, length) of every earlier prompt
    out = []
    for request, reuse in zip(requests, shared_prefixes(requests)):
        ids, length = request.hash_ids, len(request.prompt)
        at_an_end = reuse > 0 and (ids[:-(-reuse // BLOCK_TOKENS)], reuse) in ends
        out.append(reuse if at_an_end else reuse // n * n)
        ends.add((ids, length))
    return out
