"""The table `tiercache stats` prints: the tiers, what engines loaded and lookups found, the namespaces."""

from __future__ import annotations

from typing import Sequence

from tiercache.config import format_size

# The stats table's namespace column at most: a namespace may be 256 characters (record.keys), and padding the column
# to one such made every row of the table 200+ columns wide (tests/test_cli.py). --json has the full names.
NAMESPACE_COLUMN_CHARS = 60


def format_table(stats: dict) -> str:
    columns = ("tier", "up", "chunks", "used", "capacity", "use%", "states", "state budget", "hits", "misses",
               "evictions", "promotions", "demotions", "checksum_failures", "errors")
    rows = [columns]
    for t in stats["tiers"]:
        cap, budget = t["capacity_bytes"], t["state_budget_bytes"]
        rows.append((t["name"], "yes" if t["up"] else "DOWN", str(t["chunks"]), format_size(t["used_bytes"]),
                     format_size(cap) if cap else "-", f"{100 * t['used_bytes'] / cap:.1f}" if cap else "-",
                     f"{t['state_chunks']} ({format_size(t['state_bytes'])})",
                     format_size(budget) if budget else "-", *(str(t[c]) for c in columns[8:])))
    lines = [_row(rows, r) for r in rows]
    lines += _hit_lines(stats["lookups"], stats["delivered"])
    if stats["namespaces"]:
        lines.append("")
        ns_rows = [("namespace", "chunks", "used")] + [
            (_shortened(n["namespace"], NAMESPACE_COLUMN_CHARS), str(n["chunks"]), format_size(n["used_bytes"]))
            for n in stats["namespaces"]]
        lines += [_row(ns_rows, r) for r in ns_rows]
        if any(len(n["namespace"]) > NAMESPACE_COLUMN_CHARS for n in stats["namespaces"]):
            lines.append("(long namespaces shortened in the middle: --json has them in full)")
    return "\n".join(lines)


def _shortened(name: str, chars: int) -> str:
    """`name` in at most `chars` characters: its start (the model) and its end (a salt's digest, a rank) kept."""
    if len(name) <= chars:
        return name
    tail = (chars - 3) // 2
    return f"{name[:chars - 3 - tail]}...{name[-tail:]}"


def _hit_lines(lookups: dict, delivered: dict) -> list[str]:
    """What engines loaded (the hits tiercache delivered) first, then what lookups found (which includes what the
    engines held themselves)."""
    if not lookups["lookups"] and not delivered["loads"] and not delivered["failed_loads"]:
        return []
    requested = lookups["requested_tokens"]
    loaded, found = delivered["loaded_tokens_by_tier"], lookups["found_tokens_by_tier"]
    dropped = delivered["saves_dropped_by_reason"]
    lines = ["", f"loaded by engines: {_share(sum(loaded.values()), requested)} ({_by_name(loaded)}) in "
                 f"{delivered['loads']} loads, {delivered['failed_loads']} failed "
                 f"({delivered['failed_load_tokens']} tokens recomputed)",
             f"found by lookups:  {_share(sum(found.values()), requested)} ({_by_name(found)}) in "
             f"{lookups['lookups']} lookups, with what the engines held themselves"]
    if any(dropped.values()):
        lines.append(f"saves dropped:     {sum(dropped.values())} objects ({_by_name(dropped)})")
    return lines


def _share(tokens: int, requested: int) -> str:
    """`tokens` of the prompt tokens lookups asked for (no share when none were asked: reports without lookups)."""
    if not requested:
        return f"{tokens} prompt tokens"
    return f"{tokens} of {requested} prompt tokens ({100 * tokens / requested:.1f}%)"


def _by_name(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n) or "none"


def _row(rows: Sequence[Sequence[str]], row: Sequence[str]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(row))]
    return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
