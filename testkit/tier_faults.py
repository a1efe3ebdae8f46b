"""Faults planted on TierCacheTier's path in an engine's process, to show the gates see them (a gate counts only once
it has failed on a planted fault). `install()` once, before the engine starts; `plant(kind)` sets the fault every
later load gets, `plant(None)` clears it:
- "swap": a load job's first two slots are exchanged (each key's bytes land in the other's slot);
- "flip": one bit of a loaded slot is flipped after the load, before vLLM reads it;
- "vanish": the job's keys are deleted from the server between the lookup's HIT and the load (an eviction, or a
  checksum mismatch: the server answers both as a miss); `vanished()` lists every key so deleted, once per load, so
  a key vLLM was let load again shows twice.
tests/vllm_engine/test_offload_tier.py plants them."""

from __future__ import annotations

KINDS = ("swap", "flip", "vanish")
_state: dict = {"kind": None, "slots": {}, "planted": 0, "vanished": []}


def plant(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown tier fault {kind!r}: one of {KINDS}")
    _state["kind"] = kind


def planted() -> int:
    """How many loads got a fault."""
    return _state["planted"]


def vanished() -> list[str]:
    """The keys "vanish" deleted before their load, in hex, one entry per load."""
    return list(_state["vanished"])


def install() -> None:
    from tiercache.connector.vllm_tier.tier import TierCacheTier

    submit_load, finished = TierCacheTier.submit_load, TierCacheTier.get_finished_jobs

    def faulty_submit_load(self, job) -> None:
        kind = _state["kind"]
        if kind == "swap" and len(job.chunk_ids) >= 2:
            job.chunk_ids = job.chunk_ids.copy()
            job.chunk_ids[[0, 1]] = job.chunk_ids[[1, 0]]
            _state["planted"] += 1
        elif kind == "vanish":
            self._client.delete(self.namespace, [bytes(k) for k in job.keys])
            _state["vanished"].extend(bytes(k).hex() for k in job.keys)
            _state["planted"] += 1
        elif kind == "flip":
            _state["slots"][job.job_id] = int(job.chunk_ids[0])
        submit_load(self, job)

    def faulty_finished(self):
        results = list(finished(self))
        for result in results:
            slot = _state["slots"].pop(result.job_id, None)
            if slot is not None and result.success:
                row = self._slot(slot)
                row[1] ^= 0x10  # a low byte of the first value of the slot's first page: used by every group
                _state["planted"] += 1
        return results

    TierCacheTier.submit_load = faulty_submit_load
    TierCacheTier.get_finished_jobs = faulty_finished
