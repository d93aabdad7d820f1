"""Kubernetes manifests for a tenplex job: an elastic Kubeflow PyTorchJob, or a JobSet beside a rendezvous.

Every pod runs one `tenplex agent` (the store daemon of its host, the rendezvous, the training processes).
What the agent needs from Kubernetes, and why:
- its store's memory: /dev/shm as an emptyDir of medium Memory (or the node's own with hostIPC), since the
  store keeps snapshots in shared memory and a container's default /dev/shm is 64 MiB;
- the stores' shared token, from a Secret mounted as one file (the stores of different pods prove to each
  other that they hold it);
- an address the other pods reach it at: the pod IP, from the downward API;
- one pod per node (anti-affinity): a snapshot's replica on another pod of the same node would die with it;
- a rendezvous endpoint with a stable name: a Service.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .agent import DeployError, JobSpec, check_size

KINDS = ("pytorchjob", "jobset")
TOKEN_PATH = "/etc/tenplex/store.token"
SHM = "/dev/shm"
RDZV_PORT_NAME = "rdzv"
# the labels the Kubeflow training operator puts on the pods of a PyTorchJob
KF_JOB_LABEL = "training.kubeflow.org/job-name"
KF_INDEX_LABEL = "training.kubeflow.org/replica-index"


@dataclass
class K8sSpec:
    """A job on Kubernetes: the agents' job plus the pods' image, resources and objects."""

    job: JobSpec
    image: str
    kind: str = "pytorchjob"
    namespace: str | None = None
    cpu: str | None = None  # per pod, a Kubernetes quantity: "8", "7500m"
    memory: str | None = None  # per pod, a byte size: "64GiB"
    gpus: int = 0  # per pod
    gpu_resource: str = "nvidia.com/gpu"
    token_secret: str | None = None  # default NAME-store-token
    host_ipc: bool = False  # the node's /dev/shm instead of an emptyDir
    shm_headroom: str = "1GiB"  # /dev/shm beyond the store's memory: NCCL and DataLoader workers use it too
    initial_nodes: int | None = None  # pods at the start (default: the maximum)

    @property
    def secret_name(self) -> str:
        return self.token_secret or f"{self.job.name}-store-token"

    @property
    def rdzv_service(self) -> str:
        return f"{self.job.name}-rdzv"

    @property
    def start_nodes(self) -> int:
        return self.initial_nodes if self.initial_nodes is not None else self.job.max_nodes

    def shm_bytes(self) -> int:
        """/dev/shm's size: the store's memory and the headroom."""
        store = check_size("--store-memory", self.job.store_memory)
        return store + check_size("--shm-headroom", self.shm_headroom, zero=True)

    def check(self) -> None:
        """The job's own checks, then what only Kubernetes asks of it."""
        self.job.check()
        if self.kind not in KINDS:
            raise DeployError(f"--kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not self.image or any(c.isspace() for c in self.image):
            raise DeployError(f"--image {self.image!r}: expected an image reference, e.g. ghcr.io/me/train:1")
        if self.namespace is not None and not _dns_label(self.namespace):
            raise DeployError(f"--namespace {self.namespace!r}: not a Kubernetes namespace name")
        if not _dns_subdomain(self.secret_name):
            raise DeployError(f"--token-secret {self.secret_name!r}: not a Kubernetes Secret name")
        if not self.job.min_nodes <= self.start_nodes <= self.job.max_nodes:
            raise DeployError(f"--initial-nodes {self.start_nodes}: outside --nodes {self.job.nnodes}")
        if self.cpu is not None and not _cpu_quantity(self.cpu):
            raise DeployError(f"--cpu {self.cpu!r}: expected cores, e.g. 8 or 7500m")
        if self.gpus < 0:
            raise DeployError(f"--gpus {self.gpus}: must be 0 or more")
        if self.memory is not None:
            mem, shm = check_size("--memory", self.memory), self.shm_bytes()
            if mem <= shm:
                raise DeployError(
                    f"--memory {self.memory} is not more than /dev/shm's {quantity(shm)} (store memory + "
                    "headroom): shared memory a pod writes counts against its memory limit"
                )


def quantity(nbytes: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity: 8589934592 -> '8Gi'."""
    for power, suffix in ((4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        if nbytes % 1024**power == 0:
            return f"{nbytes // 1024**power}{suffix}"
    return str(nbytes)


def _dns_label(text: str) -> bool:
    return len(text) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text) is not None


def _dns_subdomain(text: str) -> bool:
    return len(text) <= 253 and all(_dns_label(part) for part in text.split("."))


def _cpu_quantity(text: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)?m?", text) is not None and text not in ("0", "0m")


def labels(spec: K8sSpec, component: str) -> dict[str, str]:
    """What selects this job's objects: `kubectl get all -l app.kubernetes.io/instance=NAME`."""
    return {
        "app.kubernetes.io/name": "tenplex",
        "app.kubernetes.io/instance": spec.job.name,
        "app.kubernetes.io/component": component,
    }


def metadata(spec: K8sSpec, name: str, component: str) -> dict:
    meta: dict = {"name": name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    meta["labels"] = labels(spec, component)
    return meta


def agent_container(spec: K8sSpec, name: str) -> dict:
    """The container running `tenplex agent` (named `pytorch` in a PyTorchJob: the operator requires it)."""
    job = spec.job
    standalone = spec.kind == "jobset"  # the endpoint is a rendezvous pod of its own, not an agent
    command = job.agent_args(
        endpoint=f"{spec.rdzv_service}:{job.rdzv_port}",
        token_file=TOKEN_PATH,
        advertise="$(POD_IP)",  # expanded by Kubernetes from the env below
        rdzv_conf="is_host=false" if standalone else None,
    )
    ports = [{"name": "store", "containerPort": job.store_port}]
    if not standalone:  # worker 0's agent hosts the rendezvous
        ports.append({"name": RDZV_PORT_NAME, "containerPort": job.rdzv_port})
    mounts = [] if spec.host_ipc else [{"name": "store-shm", "mountPath": SHM}]
    mounts.append({"name": "store-token", "mountPath": TOKEN_PATH, "subPath": "token", "readOnly": True})
    container = {
        "name": name,
        "image": spec.image,
        "command": [*command, *job.command],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": ports,
        "volumeMounts": mounts,
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    return container


def _resources(spec: K8sSpec) -> dict:
    amounts: dict[str, str] = {}
    if spec.cpu is not None:
        amounts["cpu"] = spec.cpu
    if spec.memory is not None:
        amounts["memory"] = quantity(check_size("--memory", spec.memory))
    out: dict = {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}
    if spec.gpus:
        out.setdefault("limits", {})[spec.gpu_resource] = str(spec.gpus)  # requests default to limits
    return out


def pod_template(spec: K8sSpec, container_name: str) -> dict:
    """The agents' pod: one per node, /dev/shm sized for the store, the token file, the agent."""
    own = labels(spec, "agent")
    volumes: list[dict] = []
    if not spec.host_ipc:
        volumes.append(
            {"name": "store-shm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(spec.shm_bytes())}}
        )
    # subPath: the file itself, not the Secret volume's symlink (the stores refuse a symlinked token file);
    # 0400 and owned by root: the agent runs as root, or reads the token from $TENPLEX_STORE_TOKEN instead
    secret = {
        "secretName": spec.secret_name,
        "defaultMode": 0o400,
        "items": [{"key": "token", "path": "token"}],
    }
    volumes.append({"name": "store-token", "secret": secret})
    pod: dict = {
        "restartPolicy": "OnFailure",  # a crashed agent restarts in its pod: its /dev/shm is kept
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": own}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        },
        "containers": [agent_container(spec, container_name)],
        "volumes": volumes,
    }
    if spec.host_ipc:
        pod["hostIPC"] = True
    return {"metadata": {"labels": own}, "spec": pod}


def pytorchjob(spec: K8sSpec) -> list[dict]:
    """An elastic PyTorchJob (Kubeflow training operator) and a headless Service naming its worker 0."""
    job = spec.job
    elastic = {
        "minReplicas": job.min_nodes,
        "maxReplicas": job.max_nodes,
        "rdzvBackend": "c10d",
        "rdzvHost": spec.rdzv_service,  # the operator's PET_RDZV_ENDPOINT agrees with the agent's flags
        "rdzvPort": job.rdzv_port,
        "rdzvId": job.name,
        "maxRestarts": job.max_restarts,
    }
    worker = {
        "replicas": spec.start_nodes,
        "restartPolicy": "OnFailure",
        "template": pod_template(spec, "pytorch"),
    }
    ptj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata(spec, job.name, "agent"),
        "spec": {
            "nprocPerNode": str(job.nproc_per_node),
            "elasticPolicy": elastic,
            "pytorchReplicaSpecs": {"Worker": worker},
        },
    }
    # headless: the name resolves to worker 0's pod IP, so its agent sees the endpoint is its own and
    # hosts the rendezvous store; published before the pod is ready, since the agents need it to get ready
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, spec.rdzv_service, "rendezvous"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {KF_JOB_LABEL: job.name, KF_INDEX_LABEL: "0"},
            "ports": [{"name": RDZV_PORT_NAME, "port": job.rdzv_port, "targetPort": job.rdzv_port}],
        },
    }
    return [service, ptj]


def jobset(spec: K8sSpec) -> list[dict]:
    """A JobSet of one indexed Job (a pod per agent) and a rendezvous Deployment behind a Service."""
    job = spec.job
    agents = {
        "name": "agents",
        "replicas": 1,
        "template": {
            "spec": {
                "completionMode": "Indexed",
                "parallelism": spec.start_nodes,  # scaled with completions (elastic indexed Job)
                "completions": spec.start_nodes,
                "backoffLimit": job.max_restarts,
                "template": pod_template(spec, "agent"),
            }
        },
    }
    js = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata(spec, job.name, "agent"),
        "spec": {"failurePolicy": {"maxRestarts": job.max_restarts}, "replicatedJobs": [agents]},
    }
    return [*rendezvous(spec), js]


def rendezvous(spec: K8sSpec) -> list[dict]:
    """`tenplex rendezvous`: the endpoint in a pod of its own, so it outlives any one agent."""
    port = spec.job.rdzv_port
    own = labels(spec, "rendezvous")
    container = {
        "name": "rendezvous",
        "image": spec.image,
        "command": ["tenplex", "rendezvous", "--port", str(port)],
        "ports": [{"name": RDZV_PORT_NAME, "containerPort": port}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(spec, spec.rdzv_service, "rendezvous"),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # never two rendezvous stores for one job
            "selector": {"matchLabels": own},
            "template": {"metadata": {"labels": own}, "spec": {"containers": [container]}},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(spec, spec.rdzv_service, "rendezvous"),
        "spec": {
            "selector": own,
            "ports": [{"name": RDZV_PORT_NAME, "port": port, "targetPort": RDZV_PORT_NAME}],
        },
    }
    return [deployment, service]


def token_secret(spec: K8sSpec, token: str) -> dict:
    """The stores' shared token as a Secret (only with --new-token: the output then holds a secret)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(spec, spec.secret_name, "store-token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def k8s_manifests(spec: K8sSpec, token: str | None = None) -> list[dict]:
    """Every object of the job, in the order to apply them; the Secret first when `token` is given."""
    spec.check()
    objects = pytorchjob(spec) if spec.kind == "pytorchjob" else jobset(spec)
    return [token_secret(spec, token), *objects] if token else objects


def k8s_yaml(spec: K8sSpec, token: str | None = None) -> str:
    """The manifests as one multi-document YAML file, after a comment saying how to run the job."""
    docs = k8s_manifests(spec, token)
    try:
        import yaml
    except ImportError:
        raise DeployError(
            "tenplex deploy k8s writes YAML with PyYAML (pip install 'tenplex[yaml]')"
        ) from None
    body = yaml.dump_all(docs, Dumper=_dumper(yaml), sort_keys=False, default_flow_style=False, width=100)
    return "".join(f"# {line}".rstrip() + "\n" for line in _instructions(spec, token is not None)) + body


# what Kubernetes' YAML reader (go-yaml) takes for a number although PyYAML writes it bare: 3e-4, 1e3,
# 0o17. A training script's `--lr 3e-4` must stay a string in a container's command.
_NUMBER_LIKE = re.compile(r"[-+]?(\.\d+|\d[\d_]*(\.\d*)?)([eE][-+]?\d+)?|[-+]?0[xXoObB][\da-fA-F_]+")


def _dumper(yaml):
    """PyYAML's safe dumper, quoting number-like strings, lists of strings in flow style (`[a, b]`) and
    shared dicts written out (no &anchors)."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    def string(dumper: yaml.SafeDumper, text: str) -> object:
        style = "'" if _NUMBER_LIKE.fullmatch(text) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    def sequence(dumper: yaml.SafeDumper, items: list) -> object:
        flow = bool(items) and all(isinstance(i, str) for i in items)  # a command on lines, not a word each
        return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)

    Dumper.add_representer(str, string)
    Dumper.add_representer(list, sequence)
    return Dumper


def _instructions(spec: K8sSpec, has_secret: bool) -> list[str]:
    job, ns = spec.job, f" -n {spec.namespace}" if spec.namespace else ""
    what = "elastic PyTorchJob" if spec.kind == "pytorchjob" else "JobSet + rendezvous Deployment"
    lines = [
        f"tenplex job {job.name}: {what}, {job.nnodes} pods x {job.nproc_per_node} processes, "
        "one `tenplex agent` per pod",
    ]
    if has_secret:
        lines.append(f"This file holds the stores' token (Secret {spec.secret_name}): keep it private.")
    else:
        lines += [
            "First, once, the stores' shared token (a Secret; never commit it):",
            f'  kubectl create secret generic {spec.secret_name}{ns} --from-literal=token="$(python3 -c '
            "'import secrets; print(secrets.token_hex(32))')\"",
        ]
    lines.append(f"Run: kubectl apply{ns} -f THIS_FILE")
    if spec.kind == "pytorchjob":
        lines.append(f"Scale within {job.nnodes}: kubectl scale{ns} pytorchjob/{job.name} --replicas=K")
    else:
        lines.append(
            f"Scale within {job.nnodes}: set spec.replicatedJobs[0].template.spec.parallelism and "
            "completions to K (JobSet >= v0.12, ElasticJobSet feature gate)"
        )
    return lines
