"""Terminal output shared by the commands: byte sizes and rich tables."""

from __future__ import annotations

from collections.abc import Sequence

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """`16GiB`, `512MiB`, `1.5GB` or a plain byte count."""
    from ..ptc import PTCError

    t = text.strip().replace(" ", "")
    factors = {
        "k": 1e3,
        "m": 1e6,
        "g": 1e9,
        "t": 1e12,
        "ki": 1 << 10,
        "mi": 1 << 20,
        "gi": 1 << 30,
        "ti": 1 << 40,
    }
    num = t.rstrip("BbIiKkMmGgTt")
    unit = t[len(num) :].lower().removesuffix("b")
    try:
        value = float(num)
    except ValueError:
        raise PTCError(f"not a size: {text!r} (e.g. 16GiB)") from None
    if unit and unit not in factors:
        raise PTCError(f"unknown size unit in {text!r} (use KiB, MiB, GiB, TiB, KB, MB, GB)")
    return int(value * factors.get(unit, 1))


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
