"""The published runs (docs/runs) stay light in every clone and stay where the docs point: each run folder has its
README and at most 1.5 MB; per-request data is stored gzipped (lab/serving/stored.py reads it back); every
run file the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "runs"
FOLDER_LIMIT = 1_500_000
PLAIN_JSON_LIMIT = 100_000  # above this a JSON is stored gzipped
NAMED = re.compile(r"runs/([\w.-]+)/([\w.-]+\.(?:json\.gz|json|png|txt|log|py|tsv))")
FOLDERS = sorted(p for p in RUNS.iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_run_folder_has_its_readme_and_stays_within_its_size(folder):
    assert (folder / "README.md").is_file(), f"{folder.name} has no README.md"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size <= FOLDER_LIMIT, f"{folder.name}: {size:,} bytes (at most {FOLDER_LIMIT:,}): gzip its data, or " \
                                 f"point a superseded file at the commit that holds it"


def test_per_request_data_is_stored_gzipped():
    heavy = [str(p.relative_to(RUNS)) for p in RUNS.rglob("*.json") if p.stat().st_size > PLAIN_JSON_LIMIT]
    assert not heavy, f"plain JSON over {PLAIN_JSON_LIMIT:,} bytes: {heavy}"


def test_every_run_file_the_docs_name_exists():
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *RUNS.glob("*/README.md"),
             ROOT / "lab" / "serving" / "rederive.py"]
    missing = set()
    for text in texts:
        body = text.read_text()
        for match in NAMED.finditer(body):
            in_history = body[:match.start()].endswith(":docs/")  # `git show COMMIT:docs/runs/...`: a superseded file
            if not in_history and not (RUNS / match[1] / match[2]).exists():
                missing.add(f"{text.relative_to(ROOT)} names runs/{match[1]}/{match[2]}")
    assert not missing, sorted(missing)
