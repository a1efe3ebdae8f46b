"""Sizes in bytes as people write them in a config file or on the command line ('512MiB', '4GiB', '1.5G'), and
back: the units every section's `*_bytes` keys are read in (tiercache.config.loaders)."""

from __future__ import annotations

import re

from tiercache.errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB, "ti": TiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '4GiB', '1.5G' (powers of 1000), or a plain integer."""
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match and _SIZE_UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ConfigError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB or a byte count)")
    return int(float(match.group(1)) * unit)


def format_size(n: int) -> str:
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
