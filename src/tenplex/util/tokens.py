"""Bearer-token files: where the default one lives, reading one, creating one 0600 on first use."""

from __future__ import annotations

import os
import secrets

from .logs import logger


def default_token_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".tenplex", "store.token")


def token_from_file(path: str) -> str:
    """The token in `path`; ValueError when the file is empty."""
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def read_token(path: str | None, create: bool) -> str | None:
    """The token from `path` (default: the per-user file); with `create`, a new random token is
    written to a new 0600 file when none exists. None when there is no file and `create` is off."""
    path = path or default_token_path()
    if os.path.exists(path):
        return token_from_file(path)
    if not create:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return token_from_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    logger.info("wrote a new store token to %s", path)
    return token
