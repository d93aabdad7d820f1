"""Arguments several commands share: which store to talk to, with which token."""

from __future__ import annotations

import argparse

from ..store import StoreClient
from ..store.client import DEFAULT_URL


def add_store_args(p: argparse.ArgumentParser, token_dest: str = "token_file") -> None:
    p.add_argument("--store", default=None, help=f"store URL (default $TENPLEX_STORE or {DEFAULT_URL})")
    p.add_argument(
        "--token-file", dest=token_dest, default=None, help="file holding the store's bearer token"
    )


def store_client(url: str | None, token_file: str | None) -> StoreClient:
    token = None
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    return StoreClient(url, token=token, local=False)
