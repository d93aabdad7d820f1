"""The store daemon's process entry: `python -m tenplex.store` (and `tenplex store`) arguments, run, main.

The ready line on stdout (`tenplex store listening on URL (pid N)`) is the interface `process.start_store`
and the runtime parse; everything else the daemon says goes to the `tenplex` logger (stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ..util import SizeError, logs, parse_size
from ..util.collector import freeze_imports
from .auth import token_file
from .daemon import Daemon, StoreConfig
from .errors import BadRequestError, StoreError
from .routes import ROUTES
from .transport import DEFAULT_PORT

SOCKET_NAME = "control.sock"
log = logs.get("store")


class _Shutdown(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT to leave the accept loop."""


def load_token(path: str | None) -> str:
    """The token from `path` (default: this user's `~/.tenplex/store.token`), created 0600 with a
    new random token if missing: every store requires one, loopback included."""
    try:
        token = token_file(path, create=True)
    except OSError as e:
        raise BadRequestError(f"no token for the store: {e} (pass --token-file)") from None
    assert token is not None
    return token


def listen_unix(d: Daemon) -> None:
    """Serve this host's processes on `SOCKET_NAME` in the store's private blob directory too (no token:
    SO_PEERCRED); skipped, with a notice, where that path is too long for a Unix socket."""
    path = os.path.join(d.arena.dir, SOCKET_NAME)
    if len(os.fsencode(path)) >= 108:
        log.warning("no Unix socket: %s is too long a path; same-host clients use TCP", path)
        return
    try:
        d.listen_unix(path)
    except OSError as e:
        log.warning("no Unix socket at %s: %s; same-host clients use TCP", path, e.strerror)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except SizeError as e:
        raise BadRequestError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)"
    )
    p.add_argument("--memory-limit", default="16GiB", help="most blob bytes held (default 16GiB)")
    p.add_argument("--token-file", default=None,
                   help="token file (default ~/.tenplex/store.token; made 0600 if missing)")  # fmt: skip
    p.add_argument("--peers", default="", help="comma-separated store URLs of the replication ring")
    p.add_argument("--replicas", type=int, default=0, help="copies of each committed blob on the next peers")
    p.add_argument("--advertise", default=None, help="this store's URL as peers know it")
    huge = "blobs on a private huge-page tmpfs (needs root; auto: else /dev/shm, with a notice)"
    p.add_argument("--huge-pages", choices=("auto", "on", "off"), default="auto", help=huge)
    reserve = "memory taken at start for the first snapshots' pages (e.g. 2GiB; default 0)"
    p.add_argument("--reserve", default="0", help=reserve)
    parent = "stop (removing its memory) once PID, the process that started it, is gone"
    p.add_argument("--with-parent", type=int, default=None, metavar="PID", help=parent)


def run(args: argparse.Namespace) -> int:
    """Start a daemon from parsed arguments, print the ready line, serve until SIGTERM/SIGINT."""
    if not 0 <= args.port < 65536 or args.replicas < 0:
        raise BadRequestError("port must be 0..65535 and replicas >= 0")
    token = load_token(args.token_file)
    peers = [p.strip().rstrip("/") for p in args.peers.split(",") if p.strip()]
    limit, reserve = _size(args.memory_limit), _size(args.reserve)
    if reserve > limit:
        raise BadRequestError(f"--reserve ({args.reserve}) exceeds --memory-limit ({args.memory_limit})")
    config = StoreConfig(args.host, args.port, limit, token, peers, args.replicas, args.advertise,
                         huge_pages=args.huge_pages, reserve=reserve)  # fmt: skip
    d = Daemon(ROUTES, config)
    listen_unix(d)

    def stop(signum: int, frame: object) -> None:
        # once: a second SIGTERM (a `kill` repeated, a stop and a parent's end together) must not cut the
        # cleanup that removes the store's shared memory short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Shutdown

    try:  # from the first signal handled on, every way out removes the store's shared memory
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        if args.with_parent is not None:  # its parent may be gone already: the stop comes at once
            _stop_with_parent(args.with_parent)
        freeze_imports()  # a full collection stalls every request thread: it walks the daemon's objects only
        print(f"tenplex store listening on {d.url} (pid {os.getpid()})", flush=True)
        d.serve_forever()
    except _Shutdown:
        pass
    finally:
        d.close()
    return 0


def _stop_with_parent(pid: int, every: float = 0.2) -> None:
    """SIGTERM this daemon, as `kill` would, once its parent `pid` ended (it is then reparented): a store
    tied to a script or test goes, with its shared memory, when that one crashes instead of stopping it."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tenplex.store", description="The tenplex tensor store daemon."
    )
    add_arguments(p)
    logging.basicConfig(level=logging.WARNING, format="tenplex store: %(levelname)s: %(message)s")
    try:
        return run(p.parse_args(argv))
    except StoreError as e:
        print(f"tenplex store: error: {e}", file=sys.stderr)
        return 2
