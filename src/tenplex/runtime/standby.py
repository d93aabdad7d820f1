"""Rank processes that outlive their phase: Python, torch and tenplex are imported once, ahead of need, and a
process that finished a rank of one layout takes a rank of the next one. On this machine starting a rank
from nothing (interpreter, torch import, teardown) costs seconds; a reconfiguration should not.

A standby process imports, then reads one JSON line per role on stdin: its rank's environment, where its
output goes, and what to run. The reference worker runs in the process and, when it ends well, the process
reports the exit code in the role's status file and waits for the next role. A user's script runs exactly as
`python SCRIPT ARGS` would and the process ends with it: its modules could carry state into a next role.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


class Role:
    """One rank in a standby process; `poll`, `kill` and `wait` as for a `Popen`. The rank has ended when
    its status file appears (the process lives on) or when the process ends."""

    def __init__(self, proc: subprocess.Popen, status: Path | None) -> None:
        self.proc, self.status = proc, status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.proc.poll()
            if code is None and self.status is not None and self.status.exists():
                code = int(self.status.read_text().strip() or 1)
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.proc.wait(timeout)  # a reusable role that ends well ends before its process
        return self.poll()  # type: ignore[return-value]

    def kill(self) -> None:
        self.proc.kill()

    @property
    def reusable(self) -> bool:
        return self.status is not None and self.returncode == 0 and self.proc.poll() is None


class StandbyPool:
    """Idle, pre-imported processes the controller turns into ranks, and takes back after them."""

    def __init__(
        self, log: Path, env: dict[str, str], die_with_parent: bool = False, wrap: list[str] | None = None
    ) -> None:
        self.log, self.env, self.die_with_parent = log, env, die_with_parent
        self.wrap = wrap or []  # a command prefix, e.g. `ip netns exec NS` for a namespace host
        self.idle: list[subprocess.Popen] = []

    def fill(self, n: int) -> None:
        """Start processes until `n` are idle (the ones that died while waiting are replaced)."""
        self.idle = [p for p in self.idle if p.poll() is None]
        while len(self.idle) < n:
            self.idle.append(self._spawn())

    def start(self, env: dict[str, str], out: Path, script: list[str] | None) -> Role:
        """A rank: an idle process if one is left (else a new one), running the worker or `script`."""
        status = None if script else out.with_suffix(".status")
        if status is not None:
            status.unlink(missing_ok=True)  # a rerun of the job reuses its phase directories
        role = json.dumps({"env": env, "out": str(out), "script": script, "status": str(status or "")})
        self.idle = [p for p in self.idle if p.poll() is None]
        while True:
            fresh = not self.idle
            proc = self._spawn() if fresh else self.idle.pop(0)
            try:
                assert proc.stdin is not None
                proc.stdin.write(role + "\n")
                proc.stdin.flush()
                if script:
                    proc.stdin.close()
                return Role(proc, status)
            except OSError:  # it died since the check: the next one takes the role
                if fresh:
                    raise

    def release(self, role: Role) -> None:
        """Take back the process of a rank that ended well, for a rank of a later phase."""
        if role.reusable:
            self.idle.insert(0, role.proc)

    def close(self) -> None:
        for p in self.idle:
            p.kill()
        for p in self.idle:
            p.wait()
        self.idle = []

    def _spawn(self) -> subprocess.Popen:
        with open(self.log, "a") as err:
            # no preexec_fn: code run between fork and exec can deadlock on a lock another thread held at
            # the fork (the controller imports torch in a thread); the child asks for the signal itself
            parent = ["--die-with", str(os.getpid())] if self.die_with_parent else []
            return subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "tenplex.runtime.standby", *parent],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=err,
                stderr=subprocess.STDOUT,
                text=True,
            )


def _become(role: dict[str, Any], previous: set[str]) -> int:
    """Run one role in this process; its exit code."""
    for key in previous - role["env"].keys():  # the last role's variables must not leak into this one
        os.environ.pop(key, None)
    os.environ.update(role["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(role["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    script = role.get("script")
    if script:
        sys.argv = list(script)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
        runpy.run_path(script[0], run_name="__main__")
        return 0
    from ..transformer.save import forget_groups
    from .reference_rank import main as worker

    forget_groups()  # the last role's process groups are gone
    try:
        return worker([])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--die-with"]:
        die_with(int(args[1]))
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.pipelining
    import torch.distributed.tensor.parallel  # noqa: F401  (each a second or so a rank would wait for)

    import tenplex.runtime.job
    import tenplex.runtime.reference_rank  # noqa: F401

    previous: set[str] = set()
    while line := sys.stdin.readline():
        role = json.loads(line)
        code = _become(role, previous)
        previous = set(role["env"])
        if role.get("script") or code != 0:
            return code
        tmp = Path(role["status"] + ".tmp")
        tmp.write_text(f"{code}\n")
        tmp.rename(role["status"])  # atomically: the controller never reads half of it
    return 0  # the controller let it go


if __name__ == "__main__":
    sys.exit(main())
