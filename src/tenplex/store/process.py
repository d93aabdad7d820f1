"""Starting and stopping store daemons as subprocesses (tests, benchmarks and the runtime use this)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TypedDict, Unpack

from .client import StoreClient
from .errors import StoreError, StoreUnavailable
from .tmpfs import host_path

READY = "tenplex store listening on "


@dataclass
class StoreProcess:
    """A running daemon: its process, URL and token."""

    proc: subprocess.Popen[str]
    url: str
    token: str | None = None
    shm_dir: str = ""  # where its blobs live, as the daemon reports it

    def client(self, local: bool | None = None) -> StoreClient:
        return StoreClient(self.url, token=self.token, local=local)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); a killed daemon's shared memory is removed here."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.proc.returncode != 0 and self.shm_dir:  # a daemon that exits cleanly removes it itself
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            shutil.rmtree(host_path(self.shm_dir), ignore_errors=True)  # a huge-page store's empty mountpoint
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: what a host failure looks like to the other stores; its shared memory is removed here
        (a killed daemon cannot, and nothing may read it any more)."""
        self.proc.kill()
        self.proc.wait()
        if self.shm_dir:
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    def __enter__(self) -> StoreProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def announced(text: str) -> tuple[str, int | None] | None:
    """(URL, pid) from a store's ready line, wherever in the line it is (a store killed mid-write may
    have left half a line before it); None for other lines."""
    at = text.find(READY)
    if at < 0:
        return None
    words = text[at + len(READY) :].split()
    if not words:
        return None
    pid = words[2].rstrip(")") if len(words) > 2 and words[1] == "(pid" else ""
    return words[0], int(pid) if pid.isdigit() else None


def logged_stores(log: str) -> list[tuple[str, int | None]]:
    """(URL, pid) of the stores that announced themselves in `log`, oldest first."""
    try:
        with open(log) as f:
            return [a for a in map(announced, f) if a is not None]
    except OSError:
        return []


class Ring(TypedDict, total=False):
    """The replication ring a started store joins (`--peers`, `--replicas`)."""

    peers: list[str] | None
    replicas: int


def start_store(
    port: int = 0,
    host: str = "127.0.0.1",
    memory_limit: str = "16GiB",
    token_file: str | None = None,
    extra: list[str] | None = None,
    timeout: float = 30.0,
    log: str | None = None,
    **ring: Unpack[Ring],
) -> StoreProcess:
    """Launch `python -m tenplex.store` on `port` (0: a free one) and wait until it answers.

    With `log`, the daemon writes to that file in a session of its own, so it outlives its starter (the
    runtime's stores survive a controller crash and are found again by the next controller). Without, it
    is tied to this process and stops, removing its shared memory, when this one ends, a crash included."""
    cmd = [sys.executable, "-m", "tenplex.store", "--host", host, "--port", str(port),
           "--memory-limit", memory_limit, "--replicas", str(ring.get("replicas", 0))]  # fmt: skip
    if token_file:
        cmd += ["--token-file", token_file]
    if ring.get("peers"):
        cmd += ["--peers", ",".join(ring["peers"] or [])]
    cmd += extra or []
    if log is None:
        proc, line = _launch_tied(cmd, timeout)
    else:
        proc, line = _launch_apart(cmd, log, timeout)
    ready = announced(line[0]) if line else None
    if ready is None:
        proc.kill()
        proc.wait()
        raise StoreUnavailable(
            f"store did not start (exit {proc.returncode}): {line[0] if line else 'timeout'}"
        )
    url = ready[0]
    if host in ("0.0.0.0", "::", ""):  # bound to every address: reached here on loopback
        url = f"http://127.0.0.1:{url.rsplit(':', 1)[1]}"
    token = None
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    return _answering(StoreProcess(proc, url, token), timeout)


def _launch_tied(cmd: list[str], timeout: float) -> tuple[subprocess.Popen[str], list[str]]:
    """A store tied to this process (it goes when this one ends, however that happens), and its ready
    line (none when it did not print one in time)."""
    proc = subprocess.Popen([*cmd, "--with-parent", str(os.getpid())], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)  # fmt: skip
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""))
    reader.daemon = True
    reader.start()
    reader.join(timeout)
    return proc, line


def _launch_apart(cmd: list[str], log: str, timeout: float) -> tuple[subprocess.Popen[str], list[str]]:
    """A store in a session of its own writing to `log`, and its ready line."""
    with open(log, "a") as out:
        start = out.tell()  # the log may hold earlier stores' lines: read only this one's
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)  # fmt: skip
    return proc, _ready_line(log, start, proc, timeout)


def _answering(sp: StoreProcess, timeout: float) -> StoreProcess:
    """`sp` once it answers a health request (stopped, and the error raised, if it does not in time)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sp.shm_dir = sp.client().health()["shm_dir"]
            return sp
        except StoreError:
            if time.monotonic() > deadline or sp.proc.poll() is not None:
                sp.stop()
                raise
            time.sleep(0.05)


def _ready_line(log: str, start: int, proc: subprocess.Popen[str], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log) as f:
            f.seek(start)
            for text in f:
                if announced(text) is not None:
                    return [text]
        time.sleep(0.05)
    return []
