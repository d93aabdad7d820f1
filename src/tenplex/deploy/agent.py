"""What every target runs: one `tenplex agent` per host, and the checks on the job that need no cluster.

Both generators (`k8s`, `slurm`) build the agent's command line here, so a Kubernetes pod and a SLURM node
start the same agent with the same flags, and a bad job is refused before any file is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..ptc.errors import TenplexError
from ..util import SizeError, parse_size

# a DNS-1035 label (what a PyTorchJob's name must be), short enough for the names derived from it:
# JOB-rdzv, JOB-store-token, and JobSet's pods JOB-agents-0-INDEX-xxxxx (63 characters at most)
NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 40


class DeployError(TenplexError, ValueError):
    """A job that cannot be deployed as asked (reported as one line, exit code 2)."""


def parse_nodes(text: str, flag: str = "--nodes") -> tuple[int, int]:
    """`N` or `MIN:MAX` (torchrun's `--nnodes`) -> (min, max): the agents train on any count in between."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise DeployError(f"{flag} {text!r}: expected N or MIN:MAX, e.g. 2:4")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1:
        raise DeployError(f"{flag} {text!r}: a job needs at least 1 node")
    if lo > hi:
        raise DeployError(f"{flag} {text!r}: MIN {lo} is more than MAX {hi}")
    return lo, hi


def check_size(flag: str, text: str, zero: bool = False) -> int:
    """A byte size given as `text` (`8GiB`), as bytes; a bad one (or 0, unless `zero`) is a DeployError
    naming `flag`."""
    try:
        n = parse_size(text)
    except SizeError as e:
        raise DeployError(f"{flag}: {e}") from None
    if n < 0 or (n == 0 and not zero):
        raise DeployError(f"{flag} {text!r}: must be more than 0 bytes")
    return n


@dataclass
class JobSpec:
    """The job as the agents see it, whatever runs them."""

    name: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    command: list[str]  # SCRIPT ARGS... or -m MODULE ARGS...
    store_memory: str = "8GiB"  # kept as written: the agent parses it the same way
    store_port: int = 7070
    rdzv_port: int = 29400
    max_restarts: int = 3
    snapshot_replicas: int | None = None  # agent --replicas; None: the agent's default

    def check(self) -> None:
        """Refuse what no cluster could run, with the flag to fix."""
        if not NAME_RE.fullmatch(self.name) or len(self.name) > MAX_NAME:
            raise DeployError(
                f"--name {self.name!r}: use lower-case letters, digits and '-', starting with a letter, "
                f"at most {MAX_NAME} characters (Kubernetes derives object names from it)"
            )
        if self.nproc_per_node < 1:
            raise DeployError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise DeployError(f"--nodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        check_size("--store-memory", self.store_memory)
        for flag, port in (("--store-port", self.store_port), ("--rdzv-port", self.rdzv_port)):
            if not 1 <= port <= 65535:
                raise DeployError(f"{flag} {port}: not a TCP port")
        if self.store_port == self.rdzv_port:
            raise DeployError(f"--store-port and --rdzv-port are both {self.rdzv_port}: one host serves both")
        if self.max_restarts < 0 or (self.snapshot_replicas is not None and self.snapshot_replicas < 0):
            raise DeployError("--max-restarts and --snapshot-replicas must be 0 or more")
        check_command(self.command)

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"

    def agent_args(
        self, endpoint: str, token_file: str, advertise: str | None, rdzv_conf: str | None
    ) -> list[str]:
        """`tenplex agent ...` up to the script: the flags are `tenplex agent`'s, as torchrun spells them."""
        args = ["tenplex", "agent", "--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc_per_node)]
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", self.name]
        args += ["--max-restarts", str(self.max_restarts)]
        if rdzv_conf:
            args += ["--rdzv-conf", rdzv_conf]
        args += ["--store-port", str(self.store_port), "--store-memory", self.store_memory]
        if advertise:
            args += ["--advertise", advertise]
        if self.snapshot_replicas is not None:
            args += ["--replicas", str(self.snapshot_replicas)]
        return [*args, "--token-file", token_file]


def check_command(command: list[str]) -> None:
    """SCRIPT [ARGS] or -m MODULE [ARGS], as torchrun takes them."""
    if not command:
        raise DeployError(
            "no training script: end the command with -- SCRIPT [ARGS...] (or -- -m MODULE ...)"
        )
    if command[0] == "-m":
        if len(command) < 2 or command[1].startswith("-"):
            raise DeployError("-m needs a module name: -- -m MODULE [ARGS...]")
    elif command[0].startswith("-"):
        raise DeployError(f"the training script comes first after --, not the flag {command[0]!r}")
