"""The parallelizable tensor collection (PTC): pure Python, no torch, no I/O."""

from .box import Box, chunk_bounds
from .collection import PTC, LocalShard, TensorMeta
from .dtypes import ITEM_SIZE, item_size
from .errors import PTCError, TenplexError
from .gpt import PRESETS, GPTConfig, gpt_ptc, preset, stage_layers, stage_of_layer
from .layout import Layout, LayoutError, check_layout, layouts
from .mesh import Mesh, device_id
from .model import ModelError, ModelSpec, model_ptc
from .placement import PIPELINE_AXIS, AnyPlacement, Explicit, Piece, Placement, Replicate, Shard

__all__ = [
    "ITEM_SIZE",
    "PIPELINE_AXIS",
    "PRESETS",
    "PTC",
    "AnyPlacement",
    "Box",
    "Explicit",
    "GPTConfig",
    "Layout",
    "LayoutError",
    "LocalShard",
    "Mesh",
    "ModelError",
    "ModelSpec",
    "PTCError",
    "Piece",
    "Placement",
    "Replicate",
    "Shard",
    "TenplexError",
    "TensorMeta",
    "check_layout",
    "chunk_bounds",
    "device_id",
    "gpt_ptc",
    "item_size",
    "layouts",
    "model_ptc",
    "preset",
    "stage_layers",
    "stage_of_layer",
]
