"""The dataset routes: register a corpus split, list a rank's sample ids, serve token windows."""

from __future__ import annotations

from typing import Any

import numpy as np

from .daemon import Daemon, scratch
from .datasets import Dataset, check_ids, gather, open_dataset, rank_view
from .protocol import json_body
from .read_body import PREAMBLE
from .request import Request, RouteTable
from .server import headers_for

DATASET_ROUTES = RouteTable()
route = DATASET_ROUTES.route


@route("GET", r"/v1/datasets")
def _datasets(d: Daemon, req: Request) -> dict[str, Any]:
    """The registered datasets."""
    return {"datasets": d.datasets.list()}


@route("POST", r"/v1/datasets/(?P<job>[^/]+)")
def _register_dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """Map a corpus split read-only under a name (validated in `open_dataset`; see its trust model)."""
    name, body = req.job(), req.json()
    ds = open_dataset(name, body.get("corpus_dir"), body.get("split", "train"), body.get("seq"))
    d.datasets.add(ds)
    return ds.info()


@route("GET", r"/v1/datasets/(?P<job>[^/]+)")
def _dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """One dataset's description."""
    return d.datasets.get(req.job()).info()


@route("DELETE", r"/v1/datasets/(?P<job>[^/]+)")
def _drop_dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """Unregister a dataset."""
    name = req.job()
    d.datasets.drop(name)
    return {"deleted": name}


@route("POST", r"/v1/datasets/(?P<job>[^/]+)/ids")
def _dataset_ids(d: Daemon, req: Request) -> dict[str, Any]:
    """The sample ids a data-parallel rank reads next."""
    ds, body = d.datasets.get(req.job()), req.json()
    return rank_view(ds, body.get("sampler"), body.get("dp"), body.get("rank"), body.get("steps", 1))


@route("POST", r"/v1/datasets/(?P<job>[^/]+)/read")
def _dataset_read(d: Daemon, req: Request) -> None:
    """Read samples of a dataset: a JSON preamble, then raw token windows."""
    ds, body = d.datasets.get(req.job()), req.json()
    send_samples(d, req, ds, check_ids(ds, body.get("ids")))


def send_samples(d: Daemon, req: Request, ds: Dataset, ids: np.ndarray) -> None:
    """Raw answer of the windows `ids`, gathered from the memory map in scratch-sized blocks."""
    win = ds.windows()
    row = win.shape[1] * win.itemsize
    meta = json_body({"parts": [{"dtype": ds.dtype, "nbytes": len(ids) * row}]})
    total = PREAMBLE.size + len(meta) + len(ids) * row
    req.conn.send_head(
        "HTTP/1.1 200 OK", headers_for(total, "application/octet-stream"), PREAMBLE.pack(len(meta)) + meta
    )
    flat = scratch(req)
    if row > flat.nbytes:  # a window larger than the buffer is contiguous in the map: send it from there
        for i in ids:
            req.conn.send(memoryview(np.ascontiguousarray(win[i]).reshape(-1).view(np.uint8)))
    else:
        k = flat.nbytes // row
        for i in range(0, len(ids), k):
            part = ids[i : i + k]
            dst = flat[: len(part) * row].view(win.dtype).reshape(len(part), win.shape[1])
            gather(win, part, dst)
            req.conn.send(memoryview(flat[: len(part) * row]))
    d.count("bytes_out", total)
