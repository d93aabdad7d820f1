"""Validation of everything a request names: jobs, steps, blob names, dtypes, shapes and boxes.

Names never become file-system paths (blob files get generated names), but they are still bounded and
printable so that listings, logs and URLs stay sane. Client and daemon check with the same functions, so
a name is refused the same way (a one-line `BadRequestError`, HTTP 400) before or after it is sent.
"""

from __future__ import annotations

import re
from math import prod
from urllib.parse import quote

import numpy as np

from ..ptc import ITEM_SIZE, Box, PTCError
from .errors import BadRequestError

JOB_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
# A blob name's limit in UTF-8 bytes, not characters: percent-encoded (at most 3 characters per byte) the
# longest name takes 3 KiB of the 8 KiB request line (`protocol.MAX_LINE`), so it works on every route
# (PUT, seal, blob info, replication's PUT), not only over shared memory and JSON bodies.
MAX_NAME = 1024
MAX_NDIM = 32
MAX_STEP = 2**63 - 1


# numpy has no bfloat16, float8, float4 or complex32: their bytes travel as unsigned integers of their width
def _numpy_dtype(name: str, size: int) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(f"uint{8 * size}")


NUMPY_DTYPE: dict[str, np.dtype] = {name: _numpy_dtype(name, size) for name, size in ITEM_SIZE.items()}


def check_job(job: object) -> str:
    if not isinstance(job, str) or not JOB_RE.fullmatch(job) or job in (".", ".."):
        raise BadRequestError(f"invalid job name {job!r}: expected [A-Za-z0-9._-]{{1,128}}")
    return job


def check_step(step: object) -> int:
    if isinstance(step, str) and step.isascii() and step.isdigit() and len(step) <= 19:
        step = int(step)
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise BadRequestError(f"invalid version {step!r}: expected a non-negative integer")
    return step


def check_name(name: object) -> str:
    """A blob name: a printable string of 1..MAX_NAME bytes of UTF-8."""
    if not isinstance(name, str) or not name.isprintable() or not 0 < len(name.encode()) <= MAX_NAME:
        size = f" ({len(name.encode(errors='replace'))} bytes)" if isinstance(name, str) else ""
        raise BadRequestError(
            f"invalid blob name {repr(name)[:40]}{size}: printable, 1..{MAX_NAME} bytes of UTF-8"
        )
    return name


def check_dtype(dtype: object) -> str:
    if not isinstance(dtype, str) or dtype not in ITEM_SIZE:
        raise BadRequestError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(ITEM_SIZE))})")
    return dtype


def check_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise BadRequestError(f"invalid shape {shape!r}: a list of at most {MAX_NDIM} sizes")
    if not all(type(s) is int and 0 <= s < 2**48 for s in shape):
        raise BadRequestError(f"invalid shape {shape!r}: sizes are non-negative integers")
    if prod(shape) >= 2**48:
        raise BadRequestError(f"shape {shape!r} is too large")
    return tuple(shape)


def check_box(data: object, shape: tuple[int, ...]) -> Box:
    """A box from JSON, checked to lie inside a tensor of `shape` (None means the whole tensor)."""
    if data is None:
        return Box.full(shape)
    try:
        box = Box.from_json(data)
    except PTCError as e:
        raise BadRequestError(str(e)) from None
    return check_inside(box, shape)


def check_inside(box: Box, shape: tuple[int, ...]) -> Box:
    if box.ndim != len(shape) or any(b > s for b, s in zip(box.stop, shape)):
        raise BadRequestError(f"box {box} does not fit a tensor of shape {list(shape)}")
    return box


def dtype_name_of(array: np.ndarray, dtype: str | None) -> str:
    """The store dtype of `array`: its numpy name, or `dtype` when given (e.g. bfloat16 held as uint16)."""
    if dtype is None:
        name = array.dtype.name
        if name not in ITEM_SIZE:
            raise BadRequestError(f"numpy dtype {name} has no tenplex dtype; pass dtype=")
        return name
    check_dtype(dtype)
    if ITEM_SIZE[dtype] != array.dtype.itemsize:
        raise BadRequestError(f"array of {array.dtype} cannot hold {dtype}")
    return dtype


def check_out(out: np.ndarray, dtype: str, box: Box) -> np.ndarray:
    """The caller's buffer for `box` of a `dtype` blob, viewed with the store's numpy dtype."""
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise BadRequestError("out must be a writable C-contiguous numpy array")
    if tuple(out.shape) != box.shape:
        raise BadRequestError(f"out has shape {list(out.shape)}, box {box} has shape {list(box.shape)}")
    want = NUMPY_DTYPE[dtype]
    same = out.dtype == want or (
        want.name != dtype and out.dtype.itemsize == want.itemsize and out.dtype.kind in "uiV"
    )
    if not same and out.dtype.name != dtype:
        raise BadRequestError(f"out has dtype {out.dtype}, the blob holds {dtype}")
    return out.view(want)


def version_path(job: str, step: int) -> str:
    """The route of a version, its names checked (a client's requests name versions and blobs this way)."""
    return f"/v1/jobs/{check_job(job)}/versions/{check_step(step)}"


def blob_path(job: str, step: int, name: str) -> str:
    return f"{version_path(job, step)}/blobs/{quote(check_name(name), safe='')}"


def save_query(save_id: str | None, sep: str = "?") -> str:
    return "" if save_id is None else f"{sep}save_id={quote(save_id, safe='')}"
