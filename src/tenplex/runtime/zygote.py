"""One process per pool imports torch and tenplex, then forks the pool's spare rank processes from itself.

Why: a spare started from nothing costs an interpreter and a torch import, seconds of CPU each. On few
cores the spares a scale-out refills run beside the new layout's first step and slow it (the `first step`
part of the demo's downtimes, `results/demo.json`). A fork of a process that has imported everything
costs far less, and the imported modules' pages are shared copy-on-write. The zygote runs no torch op and
starts no thread, so a fork copies no half-held lock.

A spare is driven as a `Popen` is (`poll`, `wait`, `kill`, `stdin`), but it is the zygote's child, not the
controller's: the zygote reaps it and tells its exit code through the runtime's store (`channel`). Roles
reach it through a FIFO the controller holds open for reading and writing, so nothing blocks while the
zygote is still importing: the spare reads its role once it exists. Spares die with the zygote
(PR_SET_PDEATHSIG), the zygote with the controller; a zygote told to end (its stdin closed) first waits
for the ranks it forked. The zygote itself is `python -m tenplex.runtime.standby` (its imports, and what a
spare runs, are the standby pool's).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import IO

from .channel import Channel, ChannelError, tell


class Forked:
    """A spare forked by a `Zygote`; its pid is known once the zygote answered (`Zygote.resolve`)."""

    def __init__(self, zygote: Zygote, fifo: Path, key: str) -> None:
        self.zygote, self.key = zygote, key
        self._pid: int | None = None
        self.returncode: int | None = None
        fd = os.open(fifo, os.O_RDWR)  # never blocks on a FIFO (Linux); the spare opens it to read
        self.stdin: IO[str] = os.fdopen(fd, "w")

    @property
    def pid(self) -> int:
        while self._pid is None and self.returncode is None:
            self.zygote.resolve(block=True)
        return self._pid if self._pid is not None else -1

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._pid is None:
                self.zygote.resolve(block=False)
            if self._pid is not None:
                self.returncode = _exit_code(self.zygote.channel, self.key, self._pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"spare {self._pid}", timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None and self.pid > 0:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ended(self, code: int) -> None:
        """The zygote is gone before it forked this spare (or said which pid it has)."""
        self.returncode = code


def _exit_code(channel: Channel, key: str, pid: int) -> int | None:
    """The code the zygote told before it reaped the spare; a spare gone without one was reaped by init
    after its zygote died: killed."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # gone (ENOENT), or ended between the open and the read (ESRCH)
        state = "gone"
    if state not in ("Z", "gone"):  # running: no code yet, and the store is not asked (the monitor looks
        return None  # at every rank 20 times a second)
    code = channel.code(key)  # asked after the look at the process: a code told before it went is seen
    if code is None and state != "gone":  # a zombie whose code is being told
        return None
    return -signal.SIGKILL if code is None else code


class Zygote:
    """The forking process of one pool, started on the first `fork`."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        channel: Channel,
        die_with_parent: bool,
        wrap: list[str],
        session: bool = False,
    ) -> None:
        self.log, self.env, self.die_with_parent, self.wrap = log, env, die_with_parent, wrap
        self.session = session
        self.channel = channel
        self.proc: subprocess.Popen | None = None
        self.dir = log.parent / f"{log.stem}.fifos"  # the zygote removes it when it ends
        shutil.rmtree(self.dir, ignore_errors=True)  # a killed run's
        self.dir.mkdir(parents=True)
        self._ids = count()
        self._waiting: list[Forked] = []  # forks asked for, in order, whose pid has not come back yet
        self._buf = b""

    def fork(self) -> Forked:
        if self.proc is None or self.proc.poll() is not None:
            for spare in self._waiting:  # asked of a zygote that died: never forked
                spare.ended(-signal.SIGKILL)
            self._waiting, self._buf = [], b""
            self._start()
        n = next(self._ids)
        fifo, key = self.dir / f"spare{n}", f"exit/{uuid.uuid4().hex}"
        os.mkfifo(fifo, 0o600)
        spare = Forked(self, fifo, key)
        assert self.proc is not None and self.proc.stdin is not None
        request = {"fifo": str(fifo), "exit": key, "control": self.channel.address}
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the zygote died: the pool's next fill starts another
            spare.ended(-signal.SIGKILL)
            return spare
        self._waiting.append(spare)
        return spare

    def resolve(self, block: bool) -> None:
        """Take the pids the zygote has answered (with `block`, wait for at least one). Read unbuffered:
        a buffered reader would keep a pid that came with the one before where `select` cannot see it."""
        if self.proc is None or self.proc.stdout is None:
            return
        fd = self.proc.stdout.fileno()
        while self._waiting:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                self._waiting.pop(0)._pid = int(line)
                block = False
                continue
            if not (block or select.select([fd], [], [], 0)[0]):
                return
            data = os.read(fd, 4096)
            if not data:  # the zygote ended: what it did not fork never will be
                for spare in self._waiting:
                    spare.ended(-signal.SIGKILL)
                self._waiting = []
                return
            self._buf += data

    def close(self) -> None:
        """Let the zygote end once the ranks it forked have (their stores and teardown go on)."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def _start(self) -> None:
        with open(self.log, "a") as err:
            # no preexec_fn: code run between fork and exec can deadlock on a lock another thread held at
            # the fork (the controller imports torch in a thread); the zygote asks for the signal itself
            parent = ["--die-with", str(os.getpid())] if self.die_with_parent else []
            self.proc = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "tenplex.runtime.standby", str(self.dir), *parent],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=self.session,
            )


# -- the zygote process --------------------------------------------------------------------------------------
_exits: dict[int, tuple[str, str]] = {}  # spare pid -> (the runtime's store, the key of its exit code)
REAP_EVERY_S = 1.0  # the loop also reaps this often, whatever it was told (a safety net, not the path)


def _reap(block: bool = False) -> None:
    """Tell the exit code of each spare that ended, then reap it (with `block`: wait for them all). The
    code comes first, so a spare the controller sees gone always has its code (a zombie is still there).
    Only the zygote's loop calls it, never a signal handler: nothing reaps a spare under it."""
    while _exits:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
        except ChildProcessError:
            return
        if info is None:
            return
        pid = info.si_pid
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        where = _exits.pop(pid, None)
        if where is not None:
            try:
                tell(*where, code)
            except ChannelError:  # the runtime is gone: nobody is left to ask
                pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _child(request: dict[str, str], zygote: int, wakeup: tuple[int, int], run: Callable[[], int]) -> None:
    """In the fork: read roles from the request's FIFO and `run` them; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)  # the zygote's, not this process's
        for fd in wakeup:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a script's own subprocesses are its to wait for
        die_with(zygote)
        fd = os.open(request["fifo"], os.O_RDONLY)
        os.unlink(request["fifo"])  # both ends are open: the name is not needed any more
        os.dup2(fd, 0)  # roles come from here, not from the zygote's requests
        os.close(fd)
        os.dup2(2, 1)  # the zygote's stdout carries pids: this process writes to the log until a role
        sys.stdin = os.fdopen(0, "r")
        code = run()
    except SystemExit as e:  # a script's sys.exit, as the interpreter would end with it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_forks(fifos: Path, run: Callable[[], int]) -> int:
    """The zygote's loop, after its imports: one fork per request line on stdin (its pid back on stdout),
    each child running `run`; at the end of stdin, wait for the children, then end.

    Spares are reaped by this loop, woken by SIGCHLD through a wakeup pipe (`signal.set_wakeup_fd`: the
    interpreter's own handler writes a byte as the signal arrives). Reaping in a Python signal handler
    lost spares: a child that ended while the handler ran set its flag after the interpreter had passed
    it, and the read it went back to blocked until the next request, the spare a zombie without its exit
    code and the controller waiting for it (a job hung after a failure whose survivors ended together)."""
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1], warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the byte is written
    me, stdin, pending = os.getpid(), 0, b""
    while True:
        ready, _, _ = select.select([stdin, wakeup[0]], [], [], REAP_EVERY_S)
        if wakeup[0] in ready:
            with contextlib.suppress(BlockingIOError):  # drained: the bytes only said "look"
                while os.read(wakeup[0], 4096):
                    pass
        _reap()
        if stdin not in ready:
            continue
        data = os.read(stdin, 65536)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, me, wakeup, run)
            # before the loop reaps again: this loop is the only reaper
            _exits[pid] = (request["control"], request["exit"])
            os.write(1, f"{pid}\n".encode())
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _reap(block=True)  # told to end: once the ranks it forked have
    for p in fifos.glob("spare*[0-9]"):  # those of spares that never opened theirs
        p.unlink(missing_ok=True)
    return 0


def die_with(parent: int) -> None:
    """Be killed when `parent` ends (Linux PR_SET_PDEATHSIG), asked in this process's own startup; a
    parent gone before the request took effect is caught by comparing the parent's PID after it."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the pool's close() still stops idle processes
    if os.getppid() != parent:
        os._exit(1)
