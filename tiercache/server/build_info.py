"""Which build a server is (`tiercache_build_info`): the package's version and the commit it was built from, read
from the checkout it runs from (an editable install, a container built from a clone), else "unknown"."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import tiercache


@functools.lru_cache(maxsize=1)
def build_commit() -> str:
    """The checkout's HEAD, else "unknown" (an installed wheel carries no commit)."""
    checkout = Path(tiercache.__file__).resolve().parent.parent
    if not (checkout / ".git").exists():
        return "unknown"
    try:
        answer = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return answer.stdout.strip() or "unknown"
