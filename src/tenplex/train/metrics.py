"""Per-step training metrics and their JSON-lines file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class StepMetrics:
    step: int  # 1-based: the number of optimizer steps done
    loss: float  # mean cross-entropy over every token of the global batch
    lr: float
    grad_norm: float  # before clipping
    tokens: int  # tokens in the global batch
    step_time: float  # seconds, wall clock on rank 0
    layout: str
    val_loss: float | None = None  # held-out loss, on the steps that evaluate

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "tokens_per_s": round(self.tokens_per_s, 2)})


class MetricsWriter:
    """One JSON object per step, flushed each line so a crash keeps what was written; a new run truncates,
    a resumed one (append=True) continues the file."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, m: StepMetrics) -> None:
        self._f.write(m.to_json() + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
