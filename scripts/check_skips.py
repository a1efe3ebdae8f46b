"""Fail when a CI run skipped a test that .ci/allowed-skips does not name: tests that need the trace, a tool or a
mount must find them on the CI machine (`make install` and testkit/traces provide them), or be listed there with why.

    python3 scripts/check_skips.py SKIPS_FILE ALLOWED_FILE
SKIPS_FILE holds one JSON object per skip ({"test", "reason"}), written by testkit/pytest_session.py when
TIERCACHE_SKIPS_FILE names it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path


def allowed_patterns(path: Path) -> list[re.Pattern]:
    patterns = []
    for line in path.read_text().splitlines():
        pattern = line.split("#", 1)[0].strip()
        if pattern:
            patterns.append(re.compile(pattern))
    return patterns


def main(skips_file: str, allowed_file: str) -> int:
    path = Path(skips_file)
    skips = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    patterns = allowed_patterns(Path(allowed_file))
    unexpected = [s for s in skips if not any(p.match(s["reason"]) for p in patterns)]
    print(f"skipped in this CI run: {len(skips)} tests")
    for reason, count in Counter(s["reason"] for s in skips).most_common():
        print(f"  {count:4d}  {reason}")
    if unexpected:
        print(f"{len(unexpected)} skips are not on {allowed_file}:")
        for skip in unexpected:
            print(f"  {skip['test']}: {skip['reason']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
