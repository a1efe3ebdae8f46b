"""The values of the CLI's numeric flags: each refused as the flag it was given to (argparse names it), in one line."""

from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

Number = TypeVar("Number", int, float)


def _checked(text: str, convert: Callable[[str], Number], ok: Callable[[Number], bool], expected: str) -> Number:
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def non_negative(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "a number >= 0")


def port(text: str) -> int:
    """A port flag's value, refused as that flag (a config key's check would name `server.port` for `--port`)."""
    return _checked(text, int, lambda v: 0 <= v <= 65535, "a port 0..65535")


def seconds(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v and math.isfinite(v), "seconds >= 0")  # refuses nan and inf
