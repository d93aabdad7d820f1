"""tenplex: keep a PyTorch training job running while its devices change.

`import tenplex` stays light: the torch integration (`save`, `load`, `persist`, `ElasticJob`,
`TrainState`) loads on first use, so the PTC core and the planner work without torch installed.
"""

from __future__ import annotations

from typing import Any

from .ptc import PTCError, TenplexError

__version__ = "0.1.0"

_LAZY = {
    "save": "transformer",
    "load": "transformer",
    "persist": "transformer",
    "ElasticJob": "runtime.job",
    "TrainState": "integrations.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tenplex' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)


__all__ = ["ElasticJob", "PTCError", "TenplexError", "TrainState", "__version__", "load", "persist", "save"]
