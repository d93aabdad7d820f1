"""Rank processes that outlive their phase: Python, torch and tenplex are imported once, ahead of need, and a
process that finished a rank of one layout takes a rank of the next one. Starting a rank from nothing
(interpreter, torch import, teardown) costs seconds; a reconfiguration should not.

A standby process is forked from its pool's zygote (`zygote`: the imports are done once per pool), then
reads one JSON line per role on stdin: its rank's environment, where its output goes, and what to run. The
reference worker runs in the process and, when it ends well, the process tells the runtime its exit code
(`channel.tell`) and waits for the next role. A user's script runs exactly as `python SCRIPT ARGS` would
and the process ends with it: its modules could carry state into a next role.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from ..util.collector import freeze_imports
from .channel import Channel, tell
from .preload import preload
from .zygote import Forked, Zygote, die_with, serve_forks


class StandbyError(TenplexError):
    """Rank processes cannot be started (the pool's zygote dies at once)."""


class Role:
    """One rank in a standby process; `poll`, `kill` and `wait` as for a `Popen`. The rank has ended when
    the process told its code under `key` (the process lives on) or when the process ends."""

    def __init__(self, proc: Forked, key: str | None, channel: Channel) -> None:
        self.proc, self.key, self.channel = proc, key, channel
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.proc.poll()
            if code is None and self.key is not None:
                code = self.channel.code(self.key)
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.proc.wait(timeout)  # a reusable role that ends well ends before its process
        return self.poll()  # type: ignore[return-value]

    def kill(self) -> None:
        self.proc.kill()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    @property
    def reusable(self) -> bool:
        return self.key is not None and self.returncode == 0 and self.proc.poll() is None


class StandbyPool:
    """Idle, pre-imported processes the controller turns into ranks, and takes back after them."""

    def __init__(
        self,
        log: Path,
        env: dict[str, str],
        channel: Channel,
        die_with_parent: bool = False,
        wrap: list[str] | None = None,
        session: bool = False,
    ) -> None:
        # wrap: a command prefix, e.g. `ip netns exec NS` for a namespace host; session: the zygote and its
        # spares in a session of their own (a Ctrl-C in the terminal is not theirs: an agent's workers)
        self.channel = channel
        self.zygote = Zygote(log, env, channel, die_with_parent, wrap or [], session)
        self.idle: list[Forked] = []

    def fill(self, n: int) -> None:
        """Start processes until `n` are idle (the ones that died while waiting are replaced)."""
        self.idle = [p for p in self.idle if p.poll() is None]
        while len(self.idle) < n:
            self.idle.append(self.zygote.fork())

    def start(
        self, env: dict[str, str], out: Path, script: list[str] | None, agent_worker: bool = False
    ) -> Role:
        """A rank: an idle process if one is left (else a new one), running the reference worker or
        `script`; with `agent_worker`, an agent's worker (`worker.py`) that runs `script` once per round."""
        key = None if script else f"ended/{uuid.uuid4().hex}"
        control = self.channel.address
        fields = {"env": env, "out": str(out), "script": script, "ended": key, "control": control}
        role = json.dumps({**fields, "agent_worker": agent_worker})
        self.idle = [p for p in self.idle if p.poll() is None]
        while True:
            fresh = not self.idle
            proc = self.zygote.fork() if fresh else self.idle.pop(0)
            if proc.poll() is not None:  # it died since the check (or its zygote did): the next one
                if fresh:  # not one that waited: a zygote that cannot start (its log says why)
                    raise StandbyError(f"no rank process could be started: see {self.zygote.log}")
                continue
            assert proc.stdin is not None
            proc.stdin.write(role + "\n")  # kept open: a spare not forked yet opens it later
            proc.stdin.flush()
            return Role(proc, key, self.channel)

    def release(self, role: Role) -> None:
        """Take back the process of a rank that ended well, for a rank of a later phase."""
        if role.reusable:
            self.idle.insert(0, role.proc)

    def close(self) -> None:
        """Stop the idle processes; the zygote ends once the ranks it forked have."""
        for p in self.idle:
            p.kill()
        for p in self.idle:
            p.wait()
        self.idle = []
        self.zygote.close()


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
    if role.get("agent_worker"):  # it ends with the agent's last command, or when its round cannot go on
        from .worker import main as agent_worker

        return agent_worker(script)
    if script:  # its stdin is at its end, as under `python SCRIPT < /dev/null`: no role comes after it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.argv = list(script)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
        runpy.run_path(script[0], run_name="__main__")
        return 0
    from ..train.parallel import forget_meshes
    from ..transformer.save import forget_groups
    from .reference_rank import main as worker

    forget_groups()  # the last role's process groups are gone, and with them its meshes
    forget_meshes()
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


def serve() -> int:
    """Run the roles that come on stdin, one JSON line each, until one cannot be followed by another."""
    previous: set[str] = set()
    while line := sys.stdin.readline():
        role = json.loads(line)
        code = _become(role, previous)
        previous = set(role["env"])
        if role.get("script") or code != 0:
            return code
        tell(role["control"], role["ended"], code)
    return 0  # the controller let it go


def main(argv: list[str] | None = None) -> int:
    """The zygote of a pool (`Zygote` starts it): import once, then fork spares that `serve` roles."""
    args = sys.argv[1:] if argv is None else argv
    fifos, rest = Path(args[0]), args[1:]
    if rest[:1] == ["--die-with"]:
        die_with(int(rest[1]))
    preload()
    freeze_imports()
    return serve_forks(fifos, serve)


if __name__ == "__main__":
    sys.exit(main())
