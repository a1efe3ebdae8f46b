"""benchmarks/before_after.py's comparison: per-round ratios against the before side, the A/A pair (before run twice
per round) that voids a set where it is not level, the margin's "equivalent", and the figures that must not move
compared run by run."""

from __future__ import annotations

from benchmarks import before_after


def runs(before: list[float], after: list[float], again: list[float] | None = None, exact_after=None) -> list[dict]:
    out = []
    for i, (b, a) in enumerate(zip(before, after)):
        out.append({"side": "before", "repeat": i, "figures": {"puts/s": b}, "exact": {"hits": [5, 7]}})
        out.append({"side": "again", "repeat": i, "figures": {"puts/s": (again or before)[i]},
                    "exact": {"hits": [5, 7]}})
        out.append({"side": "after", "repeat": i, "figures": {"puts/s": a},
                    "exact": {"hits": exact_after or [5, 7]}})
    return out


def test_a_change_inside_the_noise_is_level_and_a_tight_one_equivalent():
    table = before_after.compare(runs([100, 80, 120, 90], [95, 88, 115, 99]), margin=1.10)
    row = table["figures"]["puts/s"]["after_before"]
    assert row["low"] <= 1 <= row["high"] and row["verdict"] == "level" and not table["void_by"]
    tight = before_after.compare(runs([100, 80, 120, 90, 110], [101, 79, 121, 91, 109]), margin=1.10)
    assert tight["figures"]["puts/s"]["after_before"]["verdict"] == "equivalent"
    assert tight["figures"]["puts/s"]["again_before"]["verdict"] == "equivalent"  # the same runs: ratio 1 each


def test_a_change_every_round_agrees_on_is_called():
    table = before_after.compare(runs([100, 80, 120, 90, 110], [150, 118, 185, 131, 160]), margin=1.10)
    assert table["figures"]["puts/s"]["after_before"]["verdict"] == "higher"
    assert table["figures"]["puts/s"]["after_before"]["low"] > 1
    lower = before_after.compare(runs([100, 80, 120], [60, 50, 70]), margin=1.10)["figures"]["puts/s"]
    assert lower["after_before"]["verdict"] == "lower" and lower["after_before"]["ratio"] < 0.7


def test_a_set_whose_aa_pair_moved_is_void():
    table = before_after.compare(runs([100, 80, 120, 90, 110], [101, 79, 121, 91, 109],
                                      again=[140, 112, 170, 125, 150]), margin=1.10)
    assert table["figures"]["puts/s"]["again_before"]["verdict"] == "higher"
    assert table["void_by"] == ["puts/s"]
    assert "VOID" in before_after.table({**table, "equivalence_margin": 1.10})


def test_figures_that_must_not_move_are_compared_run_by_run():
    assert before_after.compare(runs([1, 1], [1, 1]), margin=1.10)["exact_equal_in_every_run"]
    assert not before_after.compare(runs([1, 1], [1, 1], exact_after=[5, 6]), margin=1.10)["exact_equal_in_every_run"]


def test_the_cliff_reader_keeps_hits_apart_from_timings():
    out = '{"lookup_ms_16384": 2.5, "repeated": [{"tiercache_hit_ratio": 0.9}], "multi_turn": [{"hit_tokens": 4}],' \
          ' "multi_turn_long": [], "long_context": [{"hit_tokens": 8}], "branches": []}'
    figures, exact = before_after.read_cliff(out, None)
    assert figures == {"lookup_ms_16384": 2.5}
    assert exact["repeated"] == [0.9] and exact["multi_turn"] == [4] and exact["long_context"] == [8]
