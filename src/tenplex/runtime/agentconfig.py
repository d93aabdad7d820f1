"""What one `tenplex agent` is asked to do; the command's flags are derived from these fields (torchrun's
spellings where they mean the same). Torch-free, so the CLI builds its parser without importing torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..deploy.agent import parse_nodes
from ..ptc import TenplexError
from ..util.flags import flag

RDZV_PORT = 29400


@dataclass
class AgentConfig:
    script: str = flag(help="the training script (or module with -m)", names=("script",), metavar="TARGET")
    script_args: list[str] = flag(
        help="the script's arguments",
        names=("script_args",),
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        default_factory=list,
    )
    module: bool = flag(False, "run TARGET as a module (python -m)", names=("-m", "--module"))
    endpoint: str = flag(
        f"127.0.0.1:{RDZV_PORT}",
        f"HOST:PORT of the rendezvous store (default 127.0.0.1:{RDZV_PORT})",
        names=("--rdzv-endpoint", "--rdzv_endpoint"),
        dest="rdzv_endpoint",
        metavar="HOST:PORT",
    )
    run_id: str = flag(
        "tenplex", "the job's id", names=("--rdzv-id", "--rdzv_id"), dest="rdzv_id", metavar="ID"
    )
    nnodes: str = flag("1", "MIN:MAX agents the job accepts (or N)")
    nproc: int = flag(
        1,
        "workers on this host",
        names=("--nproc-per-node", "--nproc_per_node"),
        dest="nproc_per_node",
        metavar="N",
    )
    backend: str = flag(
        "c10d",
        "torch's rendezvous backend (default c10d)",
        names=("--rdzv-backend", "--rdzv_backend"),
        dest="rdzv_backend",
        choices=("c10d", "etcd", "etcd-v2"),
    )
    rdzv_conf: dict[str, str] = flag(
        help="k=v,... for torch's rendezvous (e.g. last_call_timeout=1,is_host=false)",
        names=("--rdzv-conf", "--rdzv_conf"),
        default_factory=dict,
        cli_default="",
    )
    max_restarts: int = flag(
        3,
        "rounds whose workers failed on a host that stayed, before the job stops",
        names=("--max-restarts", "--max_restarts"),
    )
    monitor_interval: float = flag(
        0.1,
        "seconds between the agent's looks at its workers and the rendezvous",
        names=("--monitor-interval", "--monitor_interval"),
    )
    # the host's store, its replicas and its durable tier
    store: str | None = flag(None, "attach to this store URL instead of starting one")
    store_port: int = flag(7070, "port of the store the agent starts")
    store_memory: str = flag("8GiB", "most bytes the store holds (default 8GiB)")
    advertise: str = flag(
        "127.0.0.1", "this host's address as the other hosts reach it (store, process group)"
    )
    replicas: int = flag(1, "copies of each snapshot on the next hosts of the ring (default 1; 0: none)")
    token_file: str | None = flag(None, "the stores' shared token (default ~/.tenplex/store.token)")
    persist_every: int = flag(
        0, "also write every Nth committed snapshot as a DCP checkpoint to --persist-dir (0: never)"
    )
    persist_dir: str | None = flag(
        None,
        "where those checkpoints go (every host's agent must see the same directory: a shared file system); "
        "the workers fall back to the newest when no store holds the job's state",
    )
    standby: bool = flag(
        False,
        "a warm spare: start the store and warm the workers, then wait to join the job until `tenplex "
        "admit` names this host's store",
    )
    ahead: bool = flag(
        True,
        "hand a planned change's round to its workers only once the old round saved (default on CPUs: "
        "to workers forked while it trains its last steps, which build and load at once when it saved)",
        names=("--no-ahead",),
        action="store_false",
    )
    run_dir: str = flag("", "records and logs (default tenplex-agent-RDZV_ID)")
    keep_store: bool = flag(False, "leave the store running when the job ends")
    min_nodes: int = field(init=False)  # from nnodes
    max_nodes: int = field(init=False)

    def __post_init__(self) -> None:
        """Refuse a bad combination in one line, before the agent starts anything."""
        if self.nproc < 1 or self.replicas < 0 or self.persist_every < 0:
            raise TenplexError("--nproc-per-node must be >= 1, --replicas and --persist-every >= 0")
        if self.persist_every and not self.persist_dir:
            raise TenplexError("--persist-every needs --persist-dir (where the checkpoints go)")
        self.min_nodes, self.max_nodes = parse_nodes(self.nnodes, "--nnodes")
        self.run_dir = self.run_dir or f"tenplex-agent-{self.run_id}"

    @property
    def target(self) -> list[str]:
        """SCRIPT ARGS... or -m MODULE ARGS..., as the workers run it."""
        return ["-m", self.script, *self.script_args] if self.module else [self.script, *self.script_args]


def parse_devices(text: str) -> list[int]:
    """`0,2,3` -> [0, 2, 3]: the device indices a host's workers run on (`tenplex devices`)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise TenplexError(f"devices {text!r}: expected device indices such as 0,2,3")
    found = [int(p) for p in parts]
    if len(set(found)) != len(found):
        raise TenplexError(f"devices {text!r}: a device is named twice")
    return found
