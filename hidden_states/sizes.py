"""Byte counts as people read them, in the plan's lines, the checks' messages and an input's description."""
from __future__ import annotations


def human_size(size: float) -> str:
    """``size`` bytes in the unit that shows it best (1.5 GB, 310 MB, 12 kB)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
