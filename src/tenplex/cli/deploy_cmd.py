"""`tenplex deploy k8s|slurm`: the files that run a job's `tenplex agent`s on a cluster, to review and apply.

Nothing here talks to a cluster: it prints Kubernetes manifests or an sbatch script (or writes them with
-o), so they can be read, versioned and applied with the cluster's own tools.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from ..deploy import JobSpec, K8sSpec, SlurmSpec, k8s_yaml, parse_nodes, sbatch_script
from ..deploy.k8s import KINDS


def _job(args: argparse.Namespace) -> JobSpec:
    lo, hi = parse_nodes(args.nodes)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return JobSpec(
        name=args.name,
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=args.nproc_per_node,
        command=list(command),
        store_memory=args.store_memory,
        store_port=args.store_port,
        rdzv_port=args.rdzv_port,
        max_restarts=args.max_restarts,
        snapshot_replicas=args.snapshot_replicas,
    )


def run_k8s(args: argparse.Namespace) -> int:
    spec = K8sSpec(
        job=_job(args),
        image=args.image,
        kind=args.kind,
        namespace=args.namespace,
        cpu=args.cpu,
        memory=args.memory,
        gpus=args.gpus,
        gpu_resource=args.gpu_resource,
        token_secret=args.token_secret,
        host_ipc=args.host_ipc,
        shm_headroom=args.shm_headroom,
        initial_nodes=args.initial_nodes,
    )
    token = secrets.token_hex(32) if args.new_token else None  # 256 bits, what the stores' check wants
    _emit(k8s_yaml(spec, token), args.output, private=token is not None)
    return 0


def run_slurm(args: argparse.Namespace) -> int:
    spec = SlurmSpec(
        job=_job(args),
        partition=args.partition,
        time=args.time,
        account=args.account,
        gpus=args.gpus,
        cpus=args.cpus,
        memory=args.memory,
        token_file=args.token_file,
        rdzv_host=args.rdzv_host,
    )
    _emit(sbatch_script(spec), args.output, private=False)
    return 0


def _emit(text: str, output: str | None, private: bool) -> None:
    """To stdout, or to `output` (created 0600 when it holds the token)."""
    if output is None or output == "-":
        sys.stdout.write(text)
        return
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    if private:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)
    note = " (it holds the stores' token: keep it private)" if private else ""
    print(f"tenplex: wrote {output}{note}", file=sys.stderr)


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="the job: object names, rendezvous id, token file")
    p.add_argument("--nproc-per-node", type=int, required=True, help="training processes per host")
    p.add_argument("--store-memory", default="8GiB", metavar="SIZE", help="each host's store (default 8GiB)")
    p.add_argument("--store-port", type=int, default=7070, help="each host's store listens here")
    p.add_argument("--rdzv-port", type=int, default=29400, help="the rendezvous endpoint's port")
    p.add_argument("--max-restarts", type=int, default=3, help="worker group restarts (default 3)")
    p.add_argument("--snapshot-replicas", type=int, default=None, metavar="R",
                   help="copies of each snapshot on other hosts (agent --replicas)")  # fmt: skip
    p.add_argument(
        "--memory", default=None, metavar="SIZE", help="per host, e.g. 64GiB (more than the store's)"
    )
    p.add_argument("--gpus", type=int, default=0, help="per host")
    p.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] or -- -m MODULE [ARGS...]")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="Kubernetes manifests or a SLURM script that run a job's agents")
    targets = p.add_subparsers(dest="target", required=True, parser_class=type(p))

    k = targets.add_parser("k8s", help="an elastic PyTorchJob or a JobSet (YAML)")
    k.add_argument("--image", required=True, help="the container image (tenplex and the script installed)")
    k.add_argument("--nodes", required=True, metavar="MIN:MAX", help="pods, one per node: N or MIN:MAX")
    k.add_argument("--kind", default="pytorchjob", help=f"{' or '.join(KINDS)} (default pytorchjob)")
    k.add_argument("--initial-nodes", type=int, default=None, help="pods at the start (default MAX)")
    k.add_argument(
        "--namespace", default=None, help="the objects' namespace (default: kubectl's current one)"
    )
    k.add_argument("--cpu", default=None, help="per pod, e.g. 16 or 7500m")
    k.add_argument("--gpu-resource", default="nvidia.com/gpu", help="the resource --gpus asks for")
    k.add_argument(
        "--token-secret", default=None, metavar="NAME", help="the token's Secret (NAME-store-token)"
    )
    k.add_argument("--new-token", action="store_true", help="emit that Secret with a fresh random token")
    k.add_argument(
        "--host-ipc", action="store_true", help="the node's /dev/shm (hostIPC) instead of an emptyDir"
    )
    k.add_argument(
        "--shm-headroom", default="1GiB", metavar="SIZE", help="/dev/shm beyond the store's memory"
    )
    _add_job_args(k)
    k.set_defaults(func=run_k8s)

    s = targets.add_parser("slurm", help="an sbatch script: srun, one agent per node")
    s.add_argument(
        "--nodes", required=True, metavar="N", help="nodes: N, or MIN:MAX (sbatch --nodes=MIN-MAX)"
    )
    s.add_argument("--partition", default=None, help="sbatch --partition (default: the cluster's)")
    s.add_argument("--time", default=None, help="sbatch --time, e.g. 1-00:00:00")
    s.add_argument("--account", default=None, help="sbatch --account to charge (default: yours)")
    s.add_argument("--cpus", type=int, default=None, help="per node")
    s.add_argument(
        "--token-file", default=None, help="on the shared filesystem (default $HOME/.tenplex/NAME.token)"
    )
    s.add_argument(
        "--rdzv-host", default=None, help="a host running `tenplex rendezvous` (default: the first node)"
    )
    _add_job_args(s)
    s.set_defaults(func=run_slurm)
