"""Each run of a set records the code it ran and the machine's load, arms run in a recorded random order per round,
and a set stops when the code under it changes (lab/common.py, lab/serving/provenance.py, arms.interleaved)."""

from __future__ import annotations

import pytest

from lab import common
from lab.serving import arms, provenance


def test_every_run_records_its_code_its_load_and_its_place_in_a_random_round(tmp_path):
    names = ["a", "b", "c", "d"]
    report = arms.interleaved(names, 6, lambda name: {"ok": name}, lambda runs: {"runs": runs},
                              str(tmp_path / "set.json"), seed=3)
    runs = report["runs"]
    assert len(runs) == 24
    orders = []
    for round_ in range(6):
        ordered = sorted((r for r in runs if r["round"] == round_), key=lambda r: r["position"])
        assert sorted(r["arm"] for r in ordered) == names
        orders.append(tuple(r["arm"] for r in ordered))
    assert len(set(orders)) > 1  # not the same order every round
    record = runs[0]["provenance"]
    assert record["commit"] == common.code()["commit"] and len(record["commit"]) == 40
    assert record["load"]["loadavg_1m"]["samples"] >= 1 and record["load"]["cores"] >= 1
    assert all(p["pid"] not in provenance._own_tree() for p in record["load"]["busiest_others"])


def test_a_set_stops_when_the_code_under_it_changes(monkeypatch, tmp_path):
    versions = iter([{"commit": "x", "dirty": None}, {"commit": "x", "dirty": None}, {"commit": "x", "dirty": "d1"}])
    monkeypatch.setattr(common, "code", lambda: next(versions))
    with pytest.raises(SystemExit, match="code changed"):
        arms.interleaved(["a", "b"], 2, lambda name: {}, lambda runs: {"runs": runs}, str(tmp_path / "set.json"))


def test_uncommitted_changes_are_a_version_of_their_own():
    assert provenance.same_code([{"commit": "x", "dirty": None}, {"commit": "x", "dirty": None}])
    assert not provenance.same_code([{"commit": "x", "dirty": None}, {"commit": "x", "dirty": "d1"}])


def _checkout(path, monkeypatch) -> None:
    """A git checkout at `path` with lab/arms.py committed, taken as the lab's own (common.ROOT)."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (path / "lab").mkdir()
    (path / "lab" / "arms.py").write_text("a = 1\n")
    git("add", "lab/arms.py")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(common, "ROOT", path)


def test_the_code_digest_changes_with_an_untracked_files_content(tmp_path, monkeypatch):
    _checkout(tmp_path, monkeypatch)
    assert common.code()["dirty"] is None
    (tmp_path / "new.py").write_text("b = 1\n")
    first = common.code()["dirty"]
    (tmp_path / "new.py").write_text("b = 2\n")
    assert first is not None and common.code()["dirty"] not in (None, first)


def test_an_edit_to_the_lab_itself_is_a_change_of_code(tmp_path, monkeypatch):
    """A set stops when the lab's own code changes under it, not only the product's (an edit to an arm or to the
    report changes what a run measures or how it is read): the digest covers the whole checkout, lab/ included."""
    _checkout(tmp_path, monkeypatch)
    (tmp_path / "lab" / "arms.py").write_text("a = 2\n")
    assert common.code()["dirty"] is not None


def test_a_run_says_whether_the_page_cache_was_dropped_before_it(tmp_path):
    report = arms.interleaved(["a"], 1, lambda name: {"ok": name}, lambda runs: {"runs": runs}, None)
    assert report["runs"][0]["provenance"]["page_cache"] == {"dropped": False, "why": "not asked"}


def test_a_set_asked_to_drop_the_page_cache_stops_when_it_cannot(monkeypatch):
    monkeypatch.setattr(provenance, "drop_page_cache", lambda: {"dropped": False, "why": "Permission denied"})
    with pytest.raises(SystemExit, match="Permission denied"):
        arms.interleaved(["a"], 1, lambda name: {"ok": name}, lambda runs: {"runs": runs}, None, drop_caches=True)
