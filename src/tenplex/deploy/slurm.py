"""A SLURM batch script for a tenplex job: one `tenplex agent` per node of the allocation, via srun.

The rendezvous is hosted by the agent of the allocation's first node (torch's c10d backend: the agent whose
host is the endpoint serves it), or by a `tenplex rendezvous` outside it (`rdzv_host`). The stores' token
is a file on the shared filesystem, made once and readable by its owner only, since every node's store
must hold the same token and the stores refuse a token file that others can read.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from .agent import DeployError, JobSpec, check_size

_ENDPOINT = '"$RDZV_HOST:$RDZV_PORT"'  # shell words the batch script expands (the rest is quoted)
_TOKEN = '"$TOKEN_FILE"'
_SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.:,+\-]+")
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:]+\]")


@dataclass
class SlurmSpec:
    """A job on SLURM: the agents' job plus the allocation's options."""

    job: JobSpec
    partition: str | None = None
    time: str | None = None  # sbatch --time, e.g. 1-00:00:00
    account: str | None = None
    gpus: int = 0  # per node
    cpus: int | None = None  # per node (the one task's)
    memory: str | None = None  # per node, a byte size
    token_file: str | None = None  # default $HOME/.tenplex/NAME.token
    rdzv_host: str | None = None  # a host running `tenplex rendezvous`; default: the first node's agent

    def check(self) -> None:
        """The job's own checks, then what sbatch would refuse or the nodes could not hold."""
        self.job.check()
        for flag, value in (
            ("--partition", self.partition),
            ("--time", self.time),
            ("--account", self.account),
        ):
            if value is not None and not _SBATCH_VALUE.fullmatch(value):
                raise DeployError(f"{flag} {value!r}: not an sbatch value")
        if self.gpus < 0 or (self.cpus is not None and self.cpus < 1):
            raise DeployError("--gpus must be 0 or more and --cpus at least 1")
        if self.memory is not None:
            mem, store = (
                check_size("--memory", self.memory),
                check_size("--store-memory", self.job.store_memory),
            )
            if mem <= store:
                raise DeployError(
                    f"--memory {self.memory} is not more than --store-memory {self.job.store_memory}: the "
                    "store's shared memory counts against the job's memory on the node"
                )
        if self.token_file is not None and (not self.token_file or "\n" in self.token_file):
            raise DeployError("--token-file: expected a path on the shared filesystem")
        if self.rdzv_host is not None and not _HOST.fullmatch(self.rdzv_host):
            raise DeployError(f"--rdzv-host {self.rdzv_host!r}: expected a host name or address")


def sbatch_script(spec: SlurmSpec) -> str:
    """The batch script (bash): `sbatch` it from a login node."""
    spec.check()
    job = spec.job
    elastic = job.min_nodes < job.max_nodes
    token = shlex.quote(spec.token_file) if spec.token_file else f"$HOME/.tenplex/{job.name}.token"
    lines = [
        "#!/bin/bash",
        f"# tenplex job {job.name}: {job.nnodes} nodes x {job.nproc_per_node} processes, one `tenplex agent` "
        "per node. Submit: sbatch THIS_FILE",
        *_directives(spec, elastic),
        "set -eu  # no pipefail: `head -n1` may close the pipe before scontrol has written every name",
        "",
        "# set up tenplex's environment here if the nodes need it (module load, source .venv/bin/activate)",
        "",
        *_rendezvous(spec),
        f"RDZV_PORT={job.rdzv_port}",
        "# the stores' shared token: one file on the shared filesystem, made once, readable by you only",
        f"TOKEN_FILE=${{TENPLEX_TOKEN_FILE:-{token}}}",
        'if [ ! -s "$TOKEN_FILE" ]; then',
        '  mkdir -p -m 700 "$(dirname "$TOKEN_FILE")"',
        "  (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \\n' > \"$TOKEN_FILE\")",
        "fi",
        'chmod 600 "$TOKEN_FILE"',
        f'echo "tenplex: rendezvous $RDZV_HOST:$RDZV_PORT, id {job.name}"',
        "",
        "# one agent per node; each node's $(hostname) is the address its store advertises",
        *_srun(spec, elastic),
    ]
    return "\n".join(lines) + "\n"


def _rendezvous(spec: SlurmSpec) -> list[str]:
    if spec.rdzv_host:
        return [
            "# the rendezvous: `tenplex rendezvous` on a host outside the allocation",
            f"RDZV_HOST={spec.rdzv_host}",
        ]
    return [
        "# the rendezvous: served by the agent of the allocation's first node",
        'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        '[ -n "$RDZV_HOST" ] || { echo "tenplex: no node in SLURM_JOB_NODELIST" >&2; exit 1; }',
    ]


def _directives(spec: SlurmSpec, elastic: bool) -> list[str]:
    job = spec.job
    nodes = f"{job.min_nodes}-{job.max_nodes}" if elastic else str(job.max_nodes)
    out = [f"--job-name={job.name}", f"--nodes={nodes}", "--ntasks-per-node=1", f"--output={job.name}-%j.out"]
    for option, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account)):
        if value is not None:
            out.append(f"--{option}={value}")
    if spec.gpus:
        out.append(f"--gpus-per-node={spec.gpus}")
    if spec.cpus is not None:
        out.append(f"--cpus-per-task={spec.cpus}")
    if spec.memory is not None:
        out.append(f"--mem={math.ceil(check_size('--memory', spec.memory) / 2**20)}M")
    if elastic:  # a node lost is a scale-in, not the end of the allocation
        out.append("--no-kill")
    return [f"#SBATCH {o}" for o in out]


def _srun(spec: SlurmSpec, elastic: bool) -> list[str]:
    """srun, one task per node, each `exec`ing the agent with its own hostname; the job's words quoted."""
    standalone = "is_host=false" if spec.rdzv_host else None  # `tenplex rendezvous` serves it
    agent = spec.job.agent_args(endpoint=_ENDPOINT, token_file=_TOKEN, advertise=None, rdzv_conf=standalone)
    flags = [w if w in (_ENDPOINT, _TOKEN) else shlex.quote(w) for w in agent[2:]]
    srun = "srun --ntasks-per-node=1 --kill-on-bad-exit=0" + (" --no-kill" if elastic else "")
    head = 'bash -c \'exec tenplex agent --advertise "$(hostname)" "$@"\' tenplex-agent'
    lines = [srun, head, *_pack(flags), *_pack([shlex.quote(w) for w in spec.job.command])]
    return [lines[0] + " \\", *(f"  {line} \\" for line in lines[1:-1]), f"  {lines[-1]}"]


def _pack(words: list[str], width: int = 96) -> list[str]:
    """Shell words into lines of at most `width` characters (a longer word has a line of its own)."""
    lines: list[str] = []
    for word in words:
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines
