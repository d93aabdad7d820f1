"""`tenplex deploy`: the generated Kubernetes manifests and SLURM script, checked offline.

No cluster runs here. The Kubernetes objects are read into the `kubernetes` client's API models (the pod
templates, Services, Secret, Deployment, and the Job template inside the JobSet) and written back: a key
the model does not have is dropped by the client without a word, so any difference between what was
generated and what came back is a misspelled or misplaced field. The two custom resources (PyTorchJob,
JobSet) have no model in the client: their own levels are checked against a schema written out below from
their Go types, and the pod and Job templates inside them against the client's models again. Then the
references between objects (the token's Secret and file, /dev/shm, the rendezvous Service and its port,
the agent's flags) are followed. The SLURM script is parsed by `bash -n` and then run with stand-ins for
`scontrol`, `srun`, `hostname` and `tenplex` that record what the agent would have been started with.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.cli.main import build_parser, main
from tenplex.util import parse_size

yaml = pytest.importorskip("yaml", reason="the yaml extra is not installed")
kubernetes = pytest.importorskip("kubernetes", reason="the dev extra (kubernetes client) is not installed")

JOB = "demo"
K8S = [
    "deploy",
    "k8s",
    "--name",
    JOB,
    "--image",
    "ghcr.io/acme/train:1",
    "--nodes",
    "2:4",
    "--nproc-per-node",
    "8",
]
SCRIPT = ["--", "train.py", "--lr", "3e-4", "--msg", "a b"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`tenplex ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def k8s(capsys, *args: str) -> list[dict]:
    code, out, err = run_cli(capsys, *K8S, *args, *SCRIPT)
    assert code == 0, err
    return list(yaml.safe_load_all(out))


# -- the client's models: a round trip shows what they do not know ----------------------------------------


def model_problems(data: object, model: str, path: str) -> list[str]:
    """`data` read as the client's `model` and written back: the fields it dropped or changed."""
    api = kubernetes.client.ApiClient()
    try:
        obj = api._ApiClient__deserialize(data, model)
    except (ValueError, TypeError) as e:  # a required field missing, a wrong type (pydantic's errors too)
        return [f"{path}: not a {model}: {str(e).splitlines()[0:3]}"]
    return differences(data, api.sanitize_for_serialization(obj), path)


def differences(sent: object, back: object, path: str) -> list[str]:
    if isinstance(sent, dict):
        if not isinstance(back, dict):
            return [f"{path}: an object read back as {back!r}"]
        out = []
        for key, value in sent.items():
            if key not in back:
                out.append(f"{path}.{key}: no such field")
            else:
                out += differences(value, back[key], f"{path}.{key}")
        return out
    if isinstance(sent, list):
        if not isinstance(back, list) or len(back) != len(sent):
            return [f"{path}: a list read back as {back!r}"]
        return [p for i, (s, b) in enumerate(zip(sent, back)) for p in differences(s, b, f"{path}[{i}]")]
    if type(sent) is not type(back) or sent != back:
        return [f"{path}: {sent!r} read back as {back!r}"]
    return []


# -- the custom resources: their fields, from the Go types ---------------------------------------------------


class Map:
    """An object of free keys (from `keys`, if given), every value of schema `of`."""

    def __init__(self, of: object, keys: tuple[str, ...] | None = None) -> None:
        self.of, self.keys = of, keys


class Required:
    def __init__(self, of: object) -> None:
        self.of = of


# kubeflow/training-operator, pkg/apis/kubeflow.org/v1: pytorch_types.go (PyTorchJobSpec, ElasticPolicy)
# and common_types.go (ReplicaSpec, RunPolicy)
REPLICA_SPEC = {
    "replicas": int,
    "template": "V1PodTemplateSpec",
    "restartPolicy": ("Always", "OnFailure", "Never", "ExitCode"),
}
PYTORCHJOB = {
    "apiVersion": Required(("kubeflow.org/v1",)),
    "kind": Required(("PyTorchJob",)),
    "metadata": Required("V1ObjectMeta"),
    "spec": Required({
        "runPolicy": {"cleanPodPolicy": ("All", "Running", "None"), "ttlSecondsAfterFinished": int,
                      "activeDeadlineSeconds": int, "backoffLimit": int, "schedulingPolicy": dict},
        "elasticPolicy": {
            "minReplicas": int, "maxReplicas": int, "rdzvBackend": ("c10d", "etcd", "etcd-v2"),
            "rdzvPort": int, "rdzvHost": str, "rdzvId": str, "rdzvConf": [{"key": str, "value": str}],
            "standalone": bool, "nProcPerNode": int, "maxRestarts": int, "metrics": [dict],
        },
        "pytorchReplicaSpecs": Required(Map(REPLICA_SPEC, keys=("Master", "Worker"))),
        "nprocPerNode": str,
    }),
}  # fmt: skip
# kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go (JobSetSpec, ReplicatedJob, Network, policies)
JOBSET = {
    "apiVersion": Required(("jobset.x-k8s.io/v1alpha2",)),
    "kind": Required(("JobSet",)),
    "metadata": Required("V1ObjectMeta"),
    "spec": Required({
        "replicatedJobs": [{
            "name": Required(str), "groupName": str, "template": Required("V1JobTemplateSpec"),
            "replicas": int,
            "dependsOn": [{"name": Required(str), "status": Required(("Ready", "Complete"))}],
        }],
        "network": {"enableDNSHostnames": bool, "subdomain": str, "publishNotReadyAddresses": bool},
        "successPolicy": {"operator": Required(("All", "Any")), "targetReplicatedJobs": [str]},
        "failurePolicy": {"maxRestarts": int, "rules": [dict],
                          "restartStrategy": ("Recreate", "BlockingRecreate", "InPlaceRestart")},
        "startupPolicy": {"startupPolicyOrder": Required(("AnyOrder", "InOrder"))},
        "suspend": bool,
        "coordinator": {"replicatedJob": Required(str), "jobIndex": int, "podIndex": int},
        "managedBy": str,
        "ttlSecondsAfterFinished": int,
    }),
}  # fmt: skip


def schema_problems(data: object, schema: object, path: str) -> list[str]:
    """`data` against `schema`: a dict (fields), [item], (allowed values), a type, a model name, a Map."""
    if isinstance(schema, Required):
        schema = schema.of
    if isinstance(schema, str):
        return model_problems(data, schema, path)
    if isinstance(schema, tuple):
        return [] if data in schema else [f"{path}: {data!r} is not one of {schema}"]
    if isinstance(schema, type):
        ok = isinstance(data, schema) and not (schema is int and isinstance(data, bool))
        return [] if ok else [f"{path}: {data!r} is not a {schema.__name__}"]
    if isinstance(schema, list):
        if not isinstance(data, list):
            return [f"{path}: {data!r} is not a list"]
        return [p for i, item in enumerate(data) for p in schema_problems(item, schema[0], f"{path}[{i}]")]
    if not isinstance(data, dict):
        return [f"{path}: {data!r} is not an object"]
    if isinstance(schema, Map):
        bad = [f"{path}.{k}: not one of {schema.keys}" for k in data if schema.keys and k not in schema.keys]
        return bad + [p for k, v in data.items() for p in schema_problems(v, schema.of, f"{path}.{k}")]
    out = [f"{path}.{k}: no such field" for k in data if k not in schema]
    out += [f"{path}.{k}: missing" for k, s in schema.items() if isinstance(s, Required) and k not in data]
    return out + [
        p for k, v in data.items() if k in schema for p in schema_problems(v, schema[k], f"{path}.{k}")
    ]


BUILTIN = {
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("apps/v1", "Deployment"): "V1Deployment",
}


def object_problems(doc: dict) -> list[str]:
    """One generated object against its model (built-in kinds) or its schema (the two custom resources)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if key in BUILTIN:
        return model_problems(doc, BUILTIN[key], where)
    if doc.get("kind") == "PyTorchJob":
        return schema_problems(doc, PYTORCHJOB, where)
    if doc.get("kind") == "JobSet":
        return schema_problems(doc, JOBSET, where)
    return [f"{where}: an object of unexpected kind {key}"]


# -- what the job needs of the objects: references followed ------------------------------------------------


def parse_agent(command: list[str]) -> argparse.Namespace:
    """`tenplex agent`'s own parser reads the generated command line: a flag spelled differently fails."""
    assert command[:2] == ["tenplex", "agent"], command
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit as e:
        raise ValueError(f"tenplex agent refuses {command}") from e


def pod_problems(
    pod: dict, args: argparse.Namespace, services: dict, secret: str, store_memory: str
) -> list[str]:
    """An agent's pod template: its one container's flags (`args`) against the volumes, env and Services."""
    out: list[str] = []
    spec = pod["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    out += [f"mount of unknown volume {m['name']}" for m in mounts.values() if m["name"] not in volumes]
    env = {e["name"] for e in container.get("env", [])}
    out += [
        f"$({v}) but no such env"
        for v in re.findall(r"\$\((\w+)\)", " ".join(container["command"]))
        if v not in env
    ]
    if args.advertise != "$(POD_IP)" or {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    } not in container.get("env", []):
        out.append("--advertise is not the pod IP from the downward API")
    shm = mounts.get("/dev/shm")
    if spec.get("hostIPC"):
        out += ["hostIPC and a /dev/shm volume"] if shm else []
    elif not shm or volumes.get(shm["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
        out.append("/dev/shm is not a memory-backed emptyDir")
    elif quantity_bytes(volumes[shm["name"]]["emptyDir"].get("sizeLimit", "0")) < parse_size(store_memory):
        out.append("/dev/shm is smaller than the store's memory")
    if args.store_memory != store_memory:
        out.append(f"--store-memory {args.store_memory}, asked for {store_memory}")
    token = mounts.get(args.token_file or "")
    source = volumes.get(token["name"], {}).get("secret", {}) if token else {}
    if source.get("secretName") != secret or token.get("subPath") != "token" or not token.get("readOnly"):
        out.append(f"--token-file {args.token_file} is not the key `token` of Secret {secret}, read-only")
    elif source.get("defaultMode", 0o644) & 0o077:
        out.append("the token file is readable by others: the stores refuse it")
    host, _, port = args.rdzv_endpoint.partition(":")
    service = services.get(host)
    if service is None or int(port) not in [p["port"] for p in service["spec"]["ports"]]:
        out.append(f"--rdzv-endpoint {args.rdzv_endpoint}: no such Service port")
    if int(args.store_port) not in [p["containerPort"] for p in container.get("ports", [])]:
        out.append("the store's port is not declared")
    own = pod["metadata"]["labels"]
    terms = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    if not any(
        t["topologyKey"] == "kubernetes.io/hostname"
        and t["labelSelector"]["matchLabels"].items() <= own.items()
        for t in terms
    ):
        out.append("agents are not kept to one per node")
    return out  # fmt: skip


def _pod(doc: dict, part: str = "spec") -> dict:
    """The `spec` (or `metadata`) of the agents' pod template in a PyTorchJob or JobSet."""
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][part]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][part]


QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti)?")


def quantity_bytes(text: str) -> int:
    m = QUANTITY.fullmatch(text)
    assert m, f"not a binary-suffixed quantity: {text}"
    return int(m.group(1)) * 1024 ** ("_KMGT".index(m.group(2)[0]) if m.group(2) else 0)


def job_problems(docs: list[dict], nodes: tuple[int, int], store_memory: str = "8GiB") -> list[str]:
    """Every object against its model or schema, then what ties them together."""
    out = [p for doc in docs for p in object_problems(doc)]
    if out:
        return out
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
        if doc["metadata"]["labels"].get("app.kubernetes.io/instance") != JOB:
            out.append(f"{doc['kind']}: not labelled as part of the job")
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    secret = f"{JOB}-store-token"
    job = (by_kind.get("PyTorchJob") or by_kind["JobSet"])[0]
    pod = {"metadata": _pod(job, "metadata"), "spec": _pod(job)}
    try:
        args = parse_agent(pod["spec"]["containers"][0]["command"])
    except ValueError as e:
        return [*out, f"the agent's command: {e}"]
    if job["kind"] == "PyTorchJob":
        out += pytorchjob_problems(job, args, services, nodes)
    else:
        out += jobset_problems(job, args, by_kind["Deployment"][0], services, nodes)
    out += pod_problems(pod, args, services, secret, store_memory)
    for s in by_kind.get("Secret", []):
        token = s.get("stringData", {}).get("token", "")
        if s["metadata"]["name"] != secret or not re.fullmatch(r"[0-9a-f]{64}", token):
            out.append("the Secret is not a 256-bit token under the name the pods mount")
    return out


def pytorchjob_problems(
    job: dict, args: argparse.Namespace, services: dict, nodes: tuple[int, int]
) -> list[str]:
    out = []
    elastic, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    if container["name"] != "pytorch":  # the operator's validation: a container named pytorch
        out.append("the Worker has no container named pytorch")
    if (elastic["minReplicas"], elastic["maxReplicas"]) != nodes or not nodes[0] <= worker[
        "replicas"
    ] <= nodes[1]:
        out.append("elasticPolicy and Worker.replicas do not agree with --nodes")
    if args.nnodes != f"{nodes[0]}:{nodes[1]}" or args.rdzv_backend != elastic["rdzvBackend"]:
        out.append("the agent's --nnodes/--rdzv-backend differ from elasticPolicy")
    if (
        args.rdzv_endpoint != f"{elastic['rdzvHost']}:{elastic['rdzvPort']}"
        or args.rdzv_id != elastic["rdzvId"]
    ):
        out.append("the agent's rendezvous differs from elasticPolicy's (the operator's PET_ variables)")
    service = services.get(elastic["rdzvHost"], {}).get("spec", {})
    # the operator's labels on its pods: job name and replica index; worker 0 hosts the rendezvous
    if service.get("clusterIP") != "None" or service.get("selector") != {
        "training.kubeflow.org/job-name": job["metadata"]["name"],
        "training.kubeflow.org/replica-index": "0",
    }:
        out.append("the rendezvous Service is not headless on worker 0")
    if args.rdzv_conf and "is_host=false" in args.rdzv_conf:
        out.append("no agent would host the rendezvous")
    return out  # fmt: skip


def jobset_problems(
    js: dict, args: argparse.Namespace, deployment: dict, services: dict, nodes: tuple[int, int]
) -> list[str]:
    out = []
    (rjob,) = js["spec"]["replicatedJobs"]
    spec = rjob["template"]["spec"]
    if spec.get("completionMode") != "Indexed" or spec.get("parallelism") != spec.get("completions"):
        out.append("the agents' Job is not an indexed Job with parallelism == completions")
    elif not nodes[0] <= spec["parallelism"] <= nodes[1] or rjob.get("replicas", 1) != 1:
        out.append("the agents' Job does not start within --nodes")
    # JobSet's webhook: pod names JOBSET-RJOB-JOBINDEX-PODINDEX-xxxxx must be DNS-1035 labels
    longest = f"{js['metadata']['name']}-{rjob['name']}-0-{nodes[1] - 1}-abcde"
    if len(longest) > 63:
        out.append(f"pod names too long: {longest}")
    if spec["template"]["spec"].get("restartPolicy") not in ("OnFailure", "Never"):
        out.append("a Job's pods need restartPolicy OnFailure or Never")
    if args.rdzv_conf != "is_host=false":
        out.append("the agents would try to host the rendezvous the Deployment serves")
    pod = deployment["spec"]["template"]
    if deployment["spec"]["selector"]["matchLabels"].items() > pod["metadata"]["labels"].items():
        out.append("the Deployment's selector does not select its pods")
    service = services.get(args.rdzv_endpoint.partition(":")[0], {}).get("spec", {})
    if not service or service["selector"].items() > pod["metadata"]["labels"].items():
        out.append("the rendezvous Service does not select the rendezvous pod")
    (c,) = pod["spec"]["containers"]
    port = int(args.rdzv_endpoint.partition(":")[2])
    target = {p["name"]: p["containerPort"] for p in c["ports"]}.get(
        service.get("ports", [{}])[0].get("targetPort")
    )
    if c["command"] != ["tenplex", "rendezvous", "--port", str(port)] or target != port:
        out.append("the rendezvous pod does not serve the agents' endpoint")
    return out


# -- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
@pytest.mark.parametrize("extra", [
    [],
    ["--new-token", "--cpu", "16", "--memory", "64GiB", "--gpus", "8"],
    ["--host-ipc", "--store-memory", "2GiB", "--namespace", "ml", "--initial-nodes", "2"],
])  # fmt: skip
def test_manifests_match_the_api_models_and_each_other(capsys, kind, extra):
    docs = k8s(capsys, "--kind", kind, *extra)
    memory = extra[extra.index("--store-memory") + 1] if "--store-memory" in extra else "8GiB"
    assert job_problems(docs, (2, 4), memory) == []
    kinds = [d["kind"] for d in docs]
    want = ["Service", "PyTorchJob"] if kind == "pytorchjob" else ["Deployment", "Service", "JobSet"]
    assert kinds == (["Secret"] if "--new-token" in extra else []) + want
    if "--namespace" in extra:
        assert {d["metadata"]["namespace"] for d in docs} == {"ml"}


def mutate(docs: list[dict], kind: str, change) -> list[dict]:
    docs = copy.deepcopy(docs)
    change(next(d for d in docs if d["kind"] == kind))
    return docs


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


def _container(d: dict) -> dict:
    return _pod(d)["containers"][0]


def _replicated(d: dict) -> dict:
    return d["spec"]["replicatedJobs"][0]


def _workers(d: dict) -> None:
    specs = d["spec"]["pytorchReplicaSpecs"]
    specs["Workers"] = specs.pop("Worker")


P, J = "pytorchjob", "jobset"
BROKEN = {  # edit of a good manifest -> (its kind, the object edited, edit, what the checks must say)
    "volumeMount": (
        P,
        "PyTorchJob",
        lambda d: _rename(_container(d), "volumeMounts", "volumeMount"),
        "volumeMount: no such field",
    ),
    "sizeLimt": (
        P,
        "PyTorchJob",
        lambda d: _rename(_pod(d)["volumes"][0]["emptyDir"], "sizeLimit", "sizeLimt"),
        "sizeLimt: no such field",
    ),
    "minReplica": (
        P,
        "PyTorchJob",
        lambda d: _rename(d["spec"]["elasticPolicy"], "minReplicas", "minReplica"),
        "minReplica: no such field",
    ),
    "Workers": (P, "PyTorchJob", _workers, "Workers: not one of"),
    "port as text": (
        P,
        "PyTorchJob",
        lambda d: _container(d)["ports"][0].update(containerPort="7070"),
        "containerPort",
    ),
    "container name": (
        P,
        "PyTorchJob",
        lambda d: _container(d).update(name="agent"),
        "no container named pytorch",
    ),
    "--nnode": (
        P,
        "PyTorchJob",
        lambda d: _container(d)["command"].insert(2, "--nnode"),
        "the agent's command",
    ),
    "token 0644": (
        P,
        "PyTorchJob",
        lambda d: _pod(d)["volumes"][1]["secret"].update(defaultMode=0o644),
        "readable by others",
    ),
    "clusterIp": (
        P,
        "Service",
        lambda d: _rename(d["spec"], "clusterIP", "clusterIp"),
        "clusterIp: no such field",
    ),
    "worker 1": (
        P,
        "Service",
        lambda d: d["spec"]["selector"].update({"training.kubeflow.org/replica-index": "1"}),
        "headless on worker 0",
    ),
    "templates": (
        J,
        "JobSet",
        lambda d: _rename(_replicated(d), "template", "templates"),
        "templates: no such field",
    ),
    "parallelism": (
        J,
        "JobSet",
        lambda d: _replicated(d)["template"]["spec"].update(parallelism=3),
        "parallelism == completions",
    ),
    "no volumes": (J, "JobSet", lambda d: _pod(d).pop("volumes"), "mount of unknown volume"),
    "no env": (J, "JobSet", lambda d: _container(d).pop("env"), "no such env"),
    "nameless": (
        J,
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
        "not a V1Deployment",
    ),
    "targetPort": (
        J,
        "Service",
        lambda d: d["spec"]["ports"][0].update(targetPort="rendezvous"),
        "does not serve",
    ),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_manifest_is_caught(capsys, broken):
    """The checks can fail: each of these edits of a good manifest is reported, naming what is wrong."""
    kind, target, change, message = BROKEN[broken]
    docs = k8s(capsys, "--kind", kind)
    assert job_problems(docs, (2, 4)) == []
    found = job_problems(mutate(docs, target, change), (2, 4))
    assert any(message in p for p in found), found


def test_number_like_script_arguments_stay_strings(capsys):
    """go-yaml (kubectl) reads a bare 3e-4 or 0o17 as a number, which a command (strings) refuses."""
    script = ["train.py", "--lr", "3e-4", "--n", "1e3", "--mask", "0o17", "2:3", "a,b", "[x]", "#c", "k: v"]
    script.append("on")  # a YAML 1.1 boolean
    code, out, _ = run_cli(capsys, *K8S, "--", *script)
    assert code == 0
    for word in ("3e-4", "1e3", "0o17", "2:3", "on"):
        assert f"'{word}'" in out
    command = _pod(list(yaml.safe_load_all(out))[1])["containers"][0]["command"]
    assert command[-len(script) :] == script


def test_the_token_is_never_made_up_unless_asked(capsys, tmp_path):
    code, out, _ = run_cli(capsys, *K8S, *SCRIPT)
    assert code == 0 and "kind: Secret" not in out and "kubectl create secret generic demo-store-token" in out
    target = tmp_path / "job.yaml"
    target.write_text("old")
    target.chmod(0o644)
    code, out, err = run_cli(capsys, *K8S, "--new-token", "-o", str(target), *SCRIPT)
    assert code == 0 and out == "" and "keep it private" in err
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    first = next(yaml.safe_load_all(target.read_text()))
    second = k8s(capsys, "--new-token")[0]
    assert first["kind"] == second["kind"] == "Secret"
    assert first["stringData"]["token"] != second["stringData"]["token"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "at least 1 node"),
        (["--nodes", "4:2"], "MIN 4 is more than MAX 2"),
        (["--nodes", "two"], "expected N or MIN:MAX"),
        (["--kind", "deployment"], "--kind 'deployment': expected one of pytorchjob, jobset"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--name", "My_Job"], "--name 'My_Job'"),
        (["--memory", "8GiB"], "shared memory a pod writes counts against its memory limit"),
        (["--store-memory", "lots"], "invalid size 'lots'"),
        (["--initial-nodes", "5"], "--initial-nodes 5: outside --nodes 2:4"),
        (["--store-port", "29400"], "one host serves both"),
        (["--cpu", "many"], "--cpu 'many'"),
    ],
)
def test_bad_k8s_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, *K8S, *args, *SCRIPT)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("script", "message"),
    [([], "no training script"), (["--"], "no training script"), (["--", "-m"], "-m needs a module name"),
     (["--", "--lr", "1"], "the training script comes first")],
)  # fmt: skip
def test_a_missing_script_is_one_line_and_exit_2(capsys, script, message):
    for argv in (K8S, ["deploy", "slurm", "--name", JOB, "--nodes", "2", "--nproc-per-node", "4"]):
        code, _, err = run_cli(capsys, *argv, *script)
        assert code == 2 and message in err and err.count("\n") == 1


def test_the_real_command_exits_2_on_bad_input():
    cmd = [sys.executable, "-m", "tenplex.cli.main", "deploy"]
    r = subprocess.run([*cmd, "slurm", "--name", JOB, "--nodes", "0", "--nproc-per-node", "1", "--", "t.py"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stderr == "tenplex: error: --nodes '0': a job needs at least 1 node\n"
    r = subprocess.run([*cmd, "k8s", "--name", JOB], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "required" in r.stderr and r.stderr.count("\n") == 1


# -- SLURM ---------------------------------------------------------------------------------------------------

SLURM = ["deploy", "slurm", "--name", JOB, "--nproc-per-node", "4"]
FAKES = {  # stand-ins: what each would be on a cluster, enough to run the script on this machine
    "scontrol": 'printf "node-a\\nnode-b\\n"',
    "hostname": "echo node-b",
    # srun: its own options recorded and dropped, the command run once (as on one node)
    "srun": 'printf "%s\\n" "$@" > "$FAKE_OUT/srun"\n'
            'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"',
    "tenplex": f'"{sys.executable}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@" '
               '> "$FAKE_OUT/agent"',
}  # fmt: skip


def slurm(capsys, *args: str) -> str:
    code, out, err = run_cli(capsys, *SLURM, *args)
    assert code == 0, err
    return out


def run_batch(script: str, tmp: Path) -> tuple[list[str], list[str]]:
    """The script run by bash with the stand-ins first on PATH: (srun's arguments, the agent's)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (tmp / "job.sh").write_text(script)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp / "home"), "FAKE_OUT": str(tmp),
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "42"}  # fmt: skip
    r = subprocess.run(["bash", str(tmp / "job.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return (tmp / "srun").read_text().splitlines(), json.loads((tmp / "agent").read_text())


def test_the_sbatch_script_parses_and_starts_one_agent_per_node(capsys, tmp_path):
    script = slurm(capsys, "--nodes", "2:4", "--partition", "gpu", "--time", "04:00:00", "--gpus", "4",
                   "--memory", "256GiB", "--snapshot-replicas", "2", *SCRIPT, "$HOME", "it's")  # fmt: skip
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    for directive in ("--nodes=2-4", "--ntasks-per-node=1", "--partition=gpu", "--time=04:00:00",
                      "--gpus-per-node=4", "--mem=262144M", "--no-kill"):  # fmt: skip
        assert f"#SBATCH {directive}\n" in script
    commands = script.replace("\\\n", " ").splitlines()  # continuation lines joined
    sruns = [c for c in commands if re.match(r"\s*srun\b", c)]
    assert len(sruns) == 1 and "srun" not in " ".join(c for c in commands if c not in sruns)
    assert (
        "--ntasks-per-node=1" in sruns[0]
        and '\'exec tenplex agent --advertise "$(hostname)" "$@"\'' in sruns[0]
    )

    srun_args, agent = run_batch(script, tmp_path)
    assert "--ntasks-per-node=1" in srun_args and "--no-kill" in srun_args
    args = parse_agent(["tenplex", *agent])
    assert args.advertise == "node-b"  # this node's own name, evaluated on the node
    assert (args.rdzv_endpoint, args.rdzv_id, args.nnodes) == ("node-a:29400", JOB, "2:4")
    assert (args.nproc_per_node, args.rdzv_backend, args.replicas, args.store_memory) == (
        4,
        "c10d",
        2,
        "8GiB",
    )
    assert [args.script, *args.script_args] == ["train.py", "--lr", "3e-4", "--msg", "a b", "$HOME", "it's"]
    token = Path(args.token_file)
    assert token == tmp_path / "home" / ".tenplex" / f"{JOB}.token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    first = token.read_text()
    token.chmod(0o644)
    run_batch(script, tmp_path)
    assert token.read_text() == first and stat.S_IMODE(token.stat().st_mode) == 0o600  # kept, made private


def test_a_fixed_size_sbatch_job_and_its_own_token_file(capsys, tmp_path):
    own = tmp_path / "shared" / "my token"
    script = slurm(capsys, "--nodes", "3", "--token-file", str(own), "--", "-m", "pkg.train", "--steps", "10")
    assert "#SBATCH --nodes=3\n" in script and "no-kill" not in script
    _, agent = run_batch(script, tmp_path)
    args = parse_agent(["tenplex", *agent])
    assert (
        args.nnodes == "3:3"
        and args.module
        and [args.script, *args.script_args] == ["pkg.train", "--steps", "10"]
    )
    assert args.token_file == str(own) and own.exists()
    assert shlex.split(script.splitlines()[-1]) == ["-m", "pkg.train", "--steps", "10"]


def test_an_sbatch_job_with_a_rendezvous_of_its_own(capsys, tmp_path):
    script = slurm(capsys, "--nodes", "2", "--rdzv-host", "login-1.example.org", *SCRIPT)
    assert "scontrol show" not in script
    _, agent = run_batch(script, tmp_path)
    args = parse_agent(["tenplex", *agent])
    assert (args.rdzv_endpoint, args.rdzv_conf) == ("login-1.example.org:29400", "is_host=false")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--nodes", "0"], "at least 1 node"), (["--nodes", "3:1"], "MIN 3 is more than MAX 1"),
     (["--nodes", "2", "--partition", "gpu; rm -rf ~"], "not an sbatch value"),
     (["--nodes", "2", "--memory", "4GiB"], "counts against the job's memory"),
     (["--nodes", "2", "--rdzv-host", "$(reboot)"], "--rdzv-host '$(reboot)'")],
)  # fmt: skip
def test_bad_slurm_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, *SLURM, *args, *SCRIPT)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_dev_shm_is_the_store_memory_plus_the_headroom(capsys):
    def size_limit(*args: str) -> str:
        return _pod(k8s(capsys, *args)[1])["volumes"][0]["emptyDir"]["sizeLimit"]

    assert size_limit() == "9Gi"  # 8GiB and 1GiB
    assert size_limit("--store-memory", "1536MiB", "--shm-headroom", "0") == "1536Mi"
    assert size_limit("--store-memory", "10GB") == "10814201Ki"  # 10**10 + 2**30 bytes
    assert size_limit("--store-memory", "1000001") == str(1000001 + 2**30)  # no binary suffix fits: bytes


DOC_COMMANDS = {  # the first line of an output block in docs/deploy.md -> the command that printed it
    "# tenplex job gpt: elastic": ["--memory", "512GiB", "--cpu", "64"],
    "# tenplex job gpt: JobSet": ["--kind", "jobset"],
    "#!/bin/bash": None,
}


def test_the_docs_show_the_real_output_trimmed(capsys):
    """Every line of docs/deploy.md's output blocks is in the command's output, in order (`...`: trimmed)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    blocks = {b.splitlines()[0]: b for b in re.findall(r"```(?:yaml|bash)\n(.*?)```", doc, re.S)}
    gpt = [
        "--name",
        "gpt",
        "--nodes",
        "2:4",
        "--nproc-per-node",
        "8",
        "--gpus",
        "8",
        "--store-memory",
        "64GiB",
    ]
    for first, extra in DOC_COMMANDS.items():
        block = next(b for line, b in blocks.items() if line.startswith(first))
        if extra is None:
            argv = ["deploy", "slurm", *gpt, "--partition", "gpu", "--time", "1-00:00:00"]
        else:
            argv = ["deploy", "k8s", *gpt, "--image", "ghcr.io/acme/gpt-train:1", *extra]
        code, out, err = run_cli(capsys, *argv, "--", "train.py", "--config", "gpt.yaml")
        assert code == 0, err
        lines = iter(out.splitlines())
        for line in block.splitlines():
            assert line.strip() == "..." or line in lines, f"not in the output (or out of order): {line}"
