"""Arguments several commands share: which store to talk to, with which token."""

from __future__ import annotations

import argparse

from ..store import StoreClient
from ..store.auth import token_file as read_token_file
from ..store.client import DEFAULT_URL
from ..util import SizeError, parse_size


def size_arg(text: str) -> int:
    """argparse type for byte sizes: a bad one is a usage error, not an HTTP error class."""
    try:
        return parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_store_args(p: argparse.ArgumentParser, token_dest: str = "token_file") -> None:
    p.add_argument("--store", default=None, help=f"store URL (default $TENPLEX_STORE or {DEFAULT_URL})")
    p.add_argument(
        "--token-file", dest=token_dest, default=None, help="file holding the store's token (mode 0600)"
    )


def store_client(url: str | None, token_file: str | None) -> StoreClient:
    token = read_token_file(token_file) if token_file else None
    return StoreClient(url, token=token, local=False)
