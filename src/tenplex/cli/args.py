"""Arguments several commands share: which store to talk to, with which token."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..ptc import PRESETS, PTC, ModelError, ModelSpec, PTCError
from ..ptc.gpt import gpt_spec
from ..runtime.tables import read_table
from ..store import StoreClient
from ..store.auth import token_file as read_token_file
from ..store.client import DEFAULT_URL


def add_store_args(p: argparse.ArgumentParser, token_dest: str = "token_file") -> None:
    p.add_argument("--store", default=None, help=f"store URL (default $TENPLEX_STORE or {DEFAULT_URL})")
    p.add_argument(
        "--token-file", dest=token_dest, default=None, help="file holding the store's token (mode 0600)"
    )


def store_client(url: str | None, token_file: str | None) -> StoreClient:
    token = read_token_file(token_file) if token_file else None
    return StoreClient(url, token=token, local=False)


MODEL_HELP = (
    "a preset (tiny, small, base, medium, gpt3-125m ... gpt3-175b) or your model: a description file "
    "(.json/.yaml: its tensors, how tp splits them, their layers) or a PTC manifest "
    "(docs/cli.md#your-own-model-description-files-and-snapshots)"
)


def add_snapshot_args(p: argparse.ArgumentParser, what: str) -> None:
    """`--job` (and its store) as the model: a committed snapshot's own tensors and layout."""
    p.add_argument(
        "--job", help=f"{what} a committed snapshot of this job on --store (its tensors, its layout)"
    )
    p.add_argument(
        "--step", type=int, default=None, help="the snapshot's step (default: the newest committed)"
    )
    add_store_args(p)


def model_spec(name: str) -> tuple[str, ModelSpec]:
    """A preset by name, else a description or PTC manifest file; (a label for it, its description)."""
    if name in PRESETS:
        return name, gpt_spec(PRESETS[name])
    path = Path(name)
    if not path.is_file():
        if path.suffix in (".json", ".yaml", ".yml") or os.sep in name:
            raise ModelError(f"no such model description file {name!r}")
        raise ModelError(f"unknown model {name!r}: neither a preset ({', '.join(PRESETS)}) nor a file")
    data = read_table(path, "model description", ModelError)
    if isinstance(data, dict) and data.get("format") in ("tenplex.ptc", "tenplex.snapshot"):
        return path.name, ModelSpec.from_ptc(PTC.from_json(data.get("ptc", data)))
    return path.name, ModelSpec.from_json(data)


def snapshot(args: argparse.Namespace) -> tuple[str, PTC]:
    """The PTC of `--job`'s snapshot at `--step` (default the newest) on `--store`: (JOB@STEP, PTC)."""
    c = store_client(args.store, args.token_file)
    step = args.step if args.step is not None else c.latest(args.job)
    if step is None:
        raise PTCError(f"job {args.job!r} has no committed version in {c.url}")
    manifest = c.manifest(args.job, step)
    if not isinstance(manifest, dict) or "ptc" not in manifest:
        raise PTCError(f"version {step} of job {args.job!r} is not a tenplex snapshot")
    return f"{args.job}@{step}", PTC.from_json(manifest["ptc"])
