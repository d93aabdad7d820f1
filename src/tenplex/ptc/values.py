"""Exact JSON encoding of the small non-tensor values of a job (step, RNG state, scheduler, sampler).

Plain JSON loses tuples, bytes, non-string keys and non-finite floats; these are tagged so that a decoded
value equals the original, type for type.
"""

from __future__ import annotations

import base64
import math
from typing import Any

from .errors import PTCError

TAG = "__tenplex__"


def encode(value: Any, path: str = "") -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {TAG: "float", "v": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, bool, type(None), float, tuple)):
                raise PTCError(f"value at {path or '<root>'!r} has a dict key of type {type(k).__name__}")
            items.append([encode(k, path), encode(v, f"{path}.{k}")])
        return {TAG: "dict", "v": items}
    raise PTCError(
        f"value at {path or '<root>'!r} has type {type(value).__name__}, which a manifest cannot hold "
        "(use tensors, numbers, strings, bytes, lists, tuples, dicts or None)"
    )


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        tag = data.get(TAG)
        if tag is None:
            return {k: decode(v) for k, v in data.items()}
        v = data.get("v")
        if tag == "float":
            return float(v)
        if tag == "bytes":
            return base64.b64decode(v)
        if tag == "tuple":
            return tuple(decode(x) for x in v)
        if tag == "dict":
            return {_hashable(decode(k)): decode(x) for k, x in v}
        raise PTCError(f"unknown value tag {tag!r} in manifest")
    return data


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
