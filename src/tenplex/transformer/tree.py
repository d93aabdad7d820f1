"""Nested state dicts as flat names, and back.

A state dict is walked once into a tree in which every object with `state_dict()`/`load_state_dict()`
(models, optimizers, schedulers, samplers) is replaced by the dict it produced, so that loading can fill
the same tensors in place and then hand each object its filled dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import StateError


@dataclass
class StatefulNode:
    obj: Any
    child: Any


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def expand(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj
    if is_stateful(obj):
        return StatefulNode(obj, expand(obj.state_dict()))
    if isinstance(obj, Mapping):
        return {k: expand(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [expand(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(flat name, leaf) for every tensor and plain value; dicts and lists become dotted names."""
    if isinstance(tree, StatefulNode):
        yield from leaves(tree.child, prefix)
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            if not isinstance(k, (str, int)):
                raise StateError(f"state dict key {k!r} under {prefix or '<root>'!r} is not a str or int")
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)) and not _is_value_sequence(tree):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree


def _is_value_sequence(seq: list | tuple) -> bool:
    """Sequences without tensors or stateful objects are kept whole as one value (e.g. betas=(0.9, 0.95))."""
    return not any(isinstance(v, (torch.Tensor, StatefulNode, Mapping, list, tuple)) for v in seq)


def flatten(tree: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split the leaves into tensors and values; a name that two paths produce is an error."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for name, leaf in leaves(tree):
        if name in tensors or name in values:
            raise StateError(f"two entries of the state dict flatten to the same name {name!r}")
        (tensors if isinstance(leaf, torch.Tensor) else values)[name] = leaf
    return tensors, values


def restore(orig: Any, tree: Any, values: Mapping[str, Any], prefix: str = "") -> Any:
    """Put saved values into the caller's containers (`orig`, walked beside its expanded `tree`; tensors were
    filled in place) and hand every stateful object its filled state dict."""
    if isinstance(tree, StatefulNode):
        tree.obj.load_state_dict(restore(tree.child, tree.child, values, prefix))
        return tree.obj
    if isinstance(tree, torch.Tensor):
        return orig
    if isinstance(tree, Mapping):
        for k in list(tree):
            orig[k] = restore(orig[k], tree[k], values, f"{prefix}.{k}" if prefix else str(k))
        return orig
    if isinstance(tree, (list, tuple)) and not _is_value_sequence(tree):
        items = [
            restore(o, t, values, f"{prefix}.{i}" if prefix else str(i))
            for i, (o, t) in enumerate(zip(orig, tree))
        ]
        if isinstance(orig, list):
            orig[:] = items
            return orig
        return tuple(items)
    return values.get(prefix, orig)
