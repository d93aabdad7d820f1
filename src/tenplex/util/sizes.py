"""Byte sizes written by people: '16GiB', '512MiB', '2GB', '4096'."""

from __future__ import annotations

import re

SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)([KMGT]?)(i?)B?", re.IGNORECASE)


class SizeError(ValueError):
    """A size that is not a byte count; callers turn it into their own error (CLI flag, HTTP 400)."""


def parse_size(text: str) -> int:
    """'16GiB' / '512MiB' (powers of 1024), '16GB' (powers of 1000) or a plain byte count."""
    m = SIZE_RE.fullmatch(text.strip().replace(" ", ""))
    if not m:
        raise SizeError(f"invalid size {text!r}: expected e.g. 16GiB, 512MiB, 4096")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))
