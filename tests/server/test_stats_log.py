"""How an operator sees that hits happen (docs/first-deployment.md): the server's periodic activity line, written only
after traffic, with what engines loaded apart from what lookups found, and `tiercache_delivered_tokens_total` and
`tiercache_lookup_found_tokens_total` exported at 0 for every tier from the start.
Real server processes; the tests wait for what they look for, never for a time."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from tests.helpers import ServerProcess, free_port, python_env, wait_for
from tiercache.client import Client
from tiercache.config import from_mapping
from tiercache.connector import PrefixCache
from tiercache.errors import ConfigError
from tiercache.prefix.objects import CacheSpec
from tiercache.prefix.presets import gated_deltanet_layout
from tiercache.prefix.delivered import Delivered
from tiercache.server.stats_log import activity_line
from tiercache.store.stats import LookupStats, StoreStats, TierStats

LAYOUT = gated_deltanet_layout("tiny/hybrid", layers=4, full_attention_interval=2, kv_heads=1, head_dim=8,
                               key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4)


LINE = re.compile(r"activity \(last \d+ s\): engines loaded ([\d,]+) of ([\d,]+) prompt tokens \([\d.]+%[^)]*\) "
                  r"in (\d+) loads?(?:, \d+ loads? failed)?(?:, \d+ saved objects? dropped)?; "
                  r"(\d+) lookups? found ([\d,]+) \([\d.]+%, with what the engines held themselves\)"
                  r"(?:; ([\d,]+) reads?, ([\d.]+)% found)?; "
                  r"since start: (\d+) lookups?, ([\d.]+)% of prompt tokens loaded")


def _activity(output: str) -> list[re.Match]:
    lines = [line.split("tiercache.server.activity: ", 1)[1] for line in output.splitlines()
             if "tiercache.server.activity: " in line]
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    return matches


def _number(text: str | None) -> int:
    return int(text.replace(",", "")) if text else 0


def _summed(lines: list[re.Match], groups: tuple[int, ...]) -> list[int]:
    return [sum(_number(m.group(i)) for m in lines) for i in groups]


def test_the_server_logs_lookups_and_hits_after_traffic_and_nothing_while_idle():
    with ServerProcess("--host-mem", "32MiB", "--disk-size", "0", "--stats-log-interval", "0.1") as server:
        spec = CacheSpec.for_layout(LAYOUT)
        tokens = np.random.default_rng(1).integers(0, 1000, 100)
        with Client.from_url(server.url) as client:
            cache = PrefixCache(client, spec)
            first = cache.lookup(tokens)
            cache.save({ref: b"\x07" * spec.object_bytes(ref) for ref in cache.plan_prompt(first).objects})
            second = cache.lookup(tokens)
            assert second.hit.tokens == 99
            loaded = cache.load(second.hit)
            assert loaded
            # The delivery report follows the reads, so it may land in a later interval than they do.
            wait_for(lambda: _summed(_activity(server.output()), (6, 3)) == [len(loaded), 1],
                     timeout_s=30, what="activity lines counting every read and the load reported")
        lines = _activity(server.output())
    # Lines cover the intervals with traffic only (an idle one writes nothing), and add up to what happened.
    assert all(_number(m.group(4)) or _number(m.group(6)) or _number(m.group(3)) for m in lines)
    # (lookups, tokens found, tokens asked for; tokens loaded, loads)
    assert _summed(lines, (4, 5, 2, 1, 3)) == [2, 99, 200, 99, 1]
    assert all(m.group(7) in (None, "100.0") for m in lines)
    assert (lines[-1].group(8), lines[-1].group(9)) == ("2", "49.5")


def _tier(name: str, hits: int = 0, misses: int = 0) -> TierStats:
    return TierStats(name, True, 0, 0, 0, hits, misses, 0, 0, 0, 0, 0, 0, 0, 0)


def test_the_activity_line_counts_what_changed_since_the_last_one():
    before = StoreStats((_tier("host", 5, 1), _tier("disk", 1, 0)), (), LookupStats(3, 300, {"host": 200}),
                        Delivered(2, {"host": 100}))
    assert activity_line(before, before, 60) is None  # no lookup, no read, no report: nothing to say
    after = StoreStats((_tier("host", 7, 3), _tier("disk", 2, 1)), (),
                       LookupStats(4, 1_300, {"host": 900, "disk": 100}),
                       Delivered(3, {"host": 500, "disk": 100}, 1, 50, {"unreachable": 4}))
    assert activity_line(before, after, 60.2) == (
        "activity (last 60 s): engines loaded 500 of 1,000 prompt tokens (50.0%: host 400, disk 100) in 1 load, "
        "1 load failed, 4 saved objects dropped; 1 lookup found 800 (80.0%, with what the engines held themselves); "
        "4 reads, 75.0% found; since start: 4 lookups, 46.2% of prompt tokens loaded")


def test_the_interval_is_checked_where_it_is_given():
    with pytest.raises(ConfigError, match="server.stats_log_interval_s"):
        from_mapping({"server": {"stats_log_interval_s": -1}})
    wrong = subprocess.run([sys.executable, "-m", "tiercache", "serve", "--stats-log-interval", "soon"],
                           capture_output=True, text=True, timeout=60, env=python_env())
    assert wrong.returncode == 2 and "--stats-log-interval: expected seconds >= 0, got 'soon'" in wrong.stderr


def test_hit_counters_are_exported_at_zero_for_every_tier_from_the_start(tmp_path):
    """A family without samples until the first hit is no series at all: a dashboard or a rate() would show no data
    instead of 0%."""
    port = free_port()
    with ServerProcess("--host-mem", "32MiB", "--disk-dir", str(tmp_path / "disk"), "--disk-size", "64MiB",
                       "--metrics-port", str(port)):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in ('tiercache_lookup_found_tokens_total{tier="host"} 0.0',
                 'tiercache_lookup_found_tokens_total{tier="disk"} 0.0',
                 'tiercache_delivered_tokens_total{tier="host"} 0.0',
                 'tiercache_delivered_tokens_total{tier="disk"} 0.0',
                 'tiercache_saves_dropped_total{reason="unreachable"} 0.0',
                 "tiercache_delivered_loads_total 0.0", "tiercache_failed_loads_total 0.0",
                 "tiercache_lookups_total 0.0", "tiercache_lookup_requested_tokens_total 0.0"):
        assert line in text.splitlines(), line
    assert any(line.startswith("tiercache_build_info{") and 'version="' in line and 'commit="' in line
               and line.endswith(" 1.0") for line in text.splitlines())
    assert any(line.startswith("process_cpu_seconds_total ") for line in text.splitlines())
