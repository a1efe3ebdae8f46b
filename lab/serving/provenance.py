"""What code and what machine each run of an arm came from, recorded in the run (a set's figures may only pool runs of
one code version, and "the machine was quiet" is read from the data, not from prose):
- the commit, and a digest of any uncommitted change in the checkout, lab/ included (lab.common.code);
- the load while the arm ran: the 1-minute load average sampled every few seconds, and the processes outside this
  benchmark's own tree that used the most CPU over the run (`LoadSampler`);
- whether the page cache was dropped before it (`drop_page_cache`: a disk tier read back from the page cache is a
  memory tier, and what an earlier run left there would differ by arm order).
`--merge` refuses reports whose runs came from different code (lab/serve_trace.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SAMPLE_S = 2.0
BUSIEST = 5


def drop_page_cache() -> dict:
    """Write back and drop the page cache (as root: /proc/sys/vm/drop_caches); says whether it was, and if not why."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as exc:
        return {"dropped": False, "why": exc.strerror or str(exc)}
    return {"dropped": True}


def same_code(versions: list[dict]) -> bool:
    return len({(v.get("commit"), v.get("dirty")) for v in versions}) <= 1


class LoadSampler:
    """Samples the machine's load while a run goes on: `with LoadSampler() as load: ...; load.summary()`."""

    def __init__(self, interval_s: float = SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-sampler", daemon=True)
        self._started: dict[int, tuple[str, int, int]] = {}
        self._ended: dict[int, tuple[str, int, int]] = {}

    def __enter__(self) -> "LoadSampler":
        self._started = _processes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._ended = _processes()

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.interval_s):
                return

    def summary(self) -> dict:
        ours = _own_tree(self._ended)
        used = []
        for pid, (name, _, ticks) in self._ended.items():
            before = self._started.get(pid, (name, 0, 0))[2]
            if pid not in ours and ticks > before:
                used.append({"pid": pid, "name": name, "cpu_s": round((ticks - before) / os.sysconf("SC_CLK_TCK"), 1)})
        used.sort(key=lambda p: -p["cpu_s"])
        samples = sorted(self.samples)
        return {"loadavg_1m": {"min": samples[0], "median": samples[len(samples) // 2], "max": samples[-1],
                               "samples": len(samples)} if samples else None,
                "cores": os.cpu_count(), "busiest_others": used[:BUSIEST]}


def _processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (name, parent pid, user + system clock ticks so far) of every process readable in /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        found[int(entry)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    return found


def _own_tree(processes: dict[int, tuple[str, int, int]] | None = None) -> set[int]:
    """This process and its descendants (the engines, servers and clients a run starts are the run's own work)."""
    parents = {pid: parent for pid, (_, parent, _) in (processes or _processes()).items()}
    tree, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree
