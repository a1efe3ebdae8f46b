"""benchmarks/before_after.py's comparison: ratios of pairs, the interval's verdict, and the figures that must not
move compared run by run."""

from __future__ import annotations

from benchmarks import before_after


def runs(before: list[float], after: list[float], exact_after=None) -> list[dict]:
    out = []
    for i, (b, a) in enumerate(zip(before, after)):
        out.append({"side": "before", "repeat": i, "figures": {"puts/s": b}, "exact": {"hits": [5, 7]}})
        out.append({"side": "after", "repeat": i, "figures": {"puts/s": a},
                    "exact": {"hits": exact_after or [5, 7]}})
    return out


def test_a_change_inside_the_noise_is_level():
    row = before_after.compare(runs([100, 80, 120, 90], [95, 88, 115, 99]))["figures"]["puts/s"]
    assert row["low"] <= 1 <= row["high"] and row["verdict"] == "level"


def test_a_change_every_pair_agrees_on_is_called():
    table = before_after.compare(runs([100, 80, 120, 90, 110], [150, 118, 185, 131, 160]))
    assert table["figures"]["puts/s"]["verdict"] == "higher" and table["figures"]["puts/s"]["low"] > 1
    lower = before_after.compare(runs([100, 80, 120], [60, 50, 70]))["figures"]["puts/s"]
    assert lower["verdict"] == "lower" and lower["ratio"] < 0.7


def test_figures_that_must_not_move_are_compared_run_by_run():
    assert before_after.compare(runs([1, 1], [1, 1]))["exact_equal_in_every_run"]
    assert not before_after.compare(runs([1, 1], [1, 1], exact_after=[5, 6]))["exact_equal_in_every_run"]


def test_the_cliff_reader_keeps_hits_apart_from_timings():
    out = '{"lookup_ms_16384": 2.5, "repeated": [{"tiercache_hit_ratio": 0.9}], "multi_turn": [{"hit_tokens": 4}],' \
          ' "multi_turn_long": [], "long_context": [{"hit_tokens": 8}], "branches": []}'
    figures, exact = before_after.read_cliff(out, None)
    assert figures == {"lookup_ms_16384": 2.5}
    assert exact["repeated"] == [0.9] and exact["multi_turn"] == [4] and exact["long_context"] == [8]
