"""Token files: where the default one lives, reading one (checked: only its owner can read it, and it is
long enough), creating one 0600 on first use."""

from __future__ import annotations

import math
import os
import secrets
import stat
import string
import tempfile

from .logs import logger

MIN_BITS = 128  # a token must hold at least this much randomness, judged by its length and alphabet
_HEX = frozenset(string.hexdigits)
_URLSAFE = frozenset(string.ascii_letters + string.digits + "-_")


class TokenFileError(ValueError):
    """A token file that others could read or replace, or whose token is too weak to trust (the store
    raises it as its AuthError, `store.auth.token_file`)."""


def default_token_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".tenplex", "store.token")


def token_bits(token: str) -> float:
    """Upper bound of the randomness in `token`: its length times the bits of the smallest usual
    alphabet (hex, URL-safe base64, printable ASCII) that spells it."""
    chars = set(token)
    alphabet = 16 if chars <= _HEX else 64 if chars <= _URLSAFE else 95
    return len(token) * math.log2(alphabet) if len(chars) >= 8 else 0.0


def token_from_file(path: str) -> str:
    """The token in `path`, after checking the file is this user's own regular file (not a symlink),
    readable by nobody else, and that the token is strong enough; TokenFileError saying how to fix it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(path):
            raise TokenFileError(f"token file {path} is a symlink: use the file itself") from None
        raise TokenFileError(f"token file {path}: {e.strerror}") from None
    try:
        _check_file(path, os.fstat(fd))
        token = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if token_bits(token) < MIN_BITS:
        raise TokenFileError(
            f"token file {path} holds a weak token (under {MIN_BITS} bits: use at least 32 random hex "
            "characters, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return token


def _check_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise TokenFileError(f"token file {path} belongs to uid {st.st_uid}, not to this user: chown it")
    if st.st_mode & 0o077:
        raise TokenFileError(f"token file {path} is readable or writable by others: chmod 600 {path}")


def read_token(path: str | None, create: bool) -> str | None:
    """The token from `path` (default: the per-user file); with `create`, a new random token is
    written to a new 0600 file when none exists. None when there is no file and `create` is off."""
    path = path or default_token_path()
    if os.path.lexists(path):
        return token_from_file(path)
    if not create:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # written whole beside it, then linked into place (atomic, never over an existing file): a process
    # starting at the same moment finds no file or a whole token, never an empty one
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".token-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.chmod(tmp, 0o600)
        os.link(tmp, path)
    except FileExistsError:  # another process created it first: use theirs
        return token_from_file(path)
    finally:
        os.unlink(tmp)
    logger.info("wrote a new store token to %s", path)
    return token
