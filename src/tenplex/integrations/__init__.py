"""Third-party models elastic under `tenplex run --script`: torchtitan's Llama 3 and Hugging Face causal LMs.

Each helper builds the framework's own model code on CPU/gloo and lays it out for a world size; the
training script keeps its loop and hands its state to `tenplex.ElasticJob`. The frameworks are optional
extras (`tenplex[titan]`, `tenplex[hf]`): import `tenplex.integrations.titan` or `.hf` only when installed.
"""

from .state import TrainState, layout_for

__all__ = ["TrainState", "layout_for"]
