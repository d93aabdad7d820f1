"""Deployment files for `tenplex agent` jobs: Kubernetes manifests and SLURM batch scripts.

Pure text generation (no torch, no cluster access), so `tenplex deploy` runs on a laptop and its output can
be reviewed, committed and applied by the tools each cluster already has (`kubectl apply`, `sbatch`).
"""

from .agent import DeployError, JobSpec, parse_nodes
from .k8s import K8sSpec, k8s_manifests, k8s_yaml
from .slurm import SlurmSpec, sbatch_script

__all__ = [
    "DeployError",
    "JobSpec",
    "K8sSpec",
    "SlurmSpec",
    "k8s_manifests",
    "k8s_yaml",
    "parse_nodes",
    "sbatch_script",
]
