"""The reference workload: a GPT trained with tp, pp and dp (or FSDP) on torch.distributed.

Import cost: this package imports torch; `tenplex.data.sampler` does not.
"""

from .model import GPT
from .parallel import Layout, LayoutError, build_mesh, build_model, valid_layouts
from .state import full_model_state, job_state, load_job_state
from .worker import TrainConfig, Trainer, run_worker

__all__ = [
    "GPT",
    "Layout",
    "LayoutError",
    "TrainConfig",
    "Trainer",
    "build_mesh",
    "build_model",
    "full_model_state",
    "job_state",
    "load_job_state",
    "run_worker",
    "valid_layouts",
]
