"""The state transformer: `save` a running job's state into the tensor stores, `load` it into any layout.

DCP-shaped: `state_dict` is a nested dict of tensors, DTensors on any mesh, plain values and objects with
`state_dict()`/`load_state_dict()`; the target layout of `load` is whatever the tensors handed to it are.
"""

from . import jobrecord
from .durable import persist
from .errors import (
    DurableError,
    GroupError,
    KeyMismatchError,
    NoSnapshotError,
    ShapeMismatchError,
    StateError,
    StoresLostError,
    UnrecoverableError,
)
from .load import load
from .save import SaveHandle, save
from .snapshot import LoadInfo

__all__ = [
    "DurableError",
    "GroupError",
    "KeyMismatchError",
    "LoadInfo",
    "NoSnapshotError",
    "SaveHandle",
    "ShapeMismatchError",
    "StateError",
    "StoresLostError",
    "UnrecoverableError",
    "jobrecord",
    "load",
    "persist",
    "save",
]
