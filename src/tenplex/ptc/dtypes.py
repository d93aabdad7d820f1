"""Element types a PTC can describe, by their torch-style names.

The PTC stays torch-free, so dtypes are plain names with an item size; the torch and numpy integrations map
them to their own types.
"""

from __future__ import annotations

from .errors import PTCError

ITEM_SIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # two 4-bit values a byte
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def item_size(dtype: str) -> int:
    """Bytes per element of `dtype`; a clear error for names tenplex does not know."""
    try:
        return ITEM_SIZE[dtype]
    except KeyError:
        known = ", ".join(sorted(ITEM_SIZE))
        raise PTCError(f"unknown dtype {dtype!r} (known: {known})") from None
