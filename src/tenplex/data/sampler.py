"""The dataset PTC: which samples every data-parallel rank reads at every step, for any dp size.

Pure numpy (no torch) so the runtime, the planner side and tests can use it cheaply.

The model of the paper: samples are numbered 0..N-1; the global order of epoch e is a permutation seeded by
(seed, e); the position is (epoch, consumed samples in that epoch); every step reads one *global batch* of a
fixed size G, the next G samples of the order. Rank r of D data-parallel ranks reads a contiguous part of that
global batch, computed from (seed, epoch, consumed, G, D, r) alone, so when D changes at any step the rest of
the epoch is still served exactly once, in the same global order, with the same global batches.

Defined behaviour for uneven splits: a global batch that does not divide by D is split into contiguous
parts whose sizes differ by at most one (the first G mod D ranks get one more; `numpy.array_split`
order). The trainer weights every sample's loss by 1/(tokens in the global batch), so the gradient equals the
static run's whatever the split. D > G (a rank with no sample) is an error. The last N mod G samples of each
epoch's order (fewer than a global batch) are not used in that epoch; the next epoch reshuffles all N.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..ptc import TenplexError


class SamplerError(TenplexError, ValueError):
    """An impossible batch / dp combination or an incompatible sampler state."""


def split_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `size` items cut into `parts` contiguous parts differing by ≤ 1."""
    if parts < 1 or not 0 <= index < parts:
        raise SamplerError(f"part {index} of {parts} does not exist")
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


@dataclass
class SamplerState:
    """The small, layout-independent state that goes into a job snapshot."""

    num_samples: int
    global_batch: int
    seed: int
    epoch: int = 0
    consumed: int = 0  # samples consumed in `epoch`, a multiple of global_batch


class ElasticSampler:
    """Seeded, exactly-once, dp-elastic sample order with a fixed global batch."""

    def __init__(self, num_samples: int, global_batch: int, seed: int = 0) -> None:
        if global_batch < 1:
            raise SamplerError(f"global batch must be positive, got {global_batch}")
        if num_samples < global_batch:
            raise SamplerError(f"{num_samples} samples cannot fill one global batch of {global_batch}")
        self.state = SamplerState(int(num_samples), int(global_batch), int(seed))
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    # -- the global view ----------------------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        return self.state.num_samples // self.state.global_batch

    @property
    def step(self) -> int:
        """Global batches consumed since the start of training."""
        return self.state.epoch * self.batches_per_epoch + self.state.consumed // self.state.global_batch

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (seeded by seed and epoch alone)."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.state.seed, epoch])
            self._order = rng.permutation(self.state.num_samples)
            self._order_epoch = epoch
        return self._order

    def global_batch_ids(self) -> np.ndarray:
        """Sample ids of the global batch at the current position."""
        s = self.state
        return self.order(s.epoch)[s.consumed : s.consumed + s.global_batch]

    # -- one rank's view -----------------------------------------------------------------------------------
    def check_dp(self, dp: int) -> None:
        if dp < 1:
            raise SamplerError(f"dp must be positive, got {dp}")
        if dp > self.state.global_batch:
            raise SamplerError(
                f"global batch {self.state.global_batch} cannot be split over dp={dp} ranks "
                "(every rank needs at least one sample)"
            )

    def rank_ids(self, dp: int, rank: int) -> np.ndarray:
        """Rank `rank`'s contiguous part of the current global batch."""
        self.check_dp(dp)
        start, stop = split_bounds(self.state.global_batch, dp, rank)
        return self.global_batch_ids()[start:stop]

    def micro_batches_per_rank(self, dp: int, micro_batch: int) -> int:
        """Micro-batches per rank and step: the same on every rank (FSDP and pipelines need that)."""
        self.check_dp(dp)
        if micro_batch < 1:
            raise SamplerError(f"micro-batch must be positive, got {micro_batch}")
        largest = -(-self.state.global_batch // dp)
        n_micro = -(-largest // micro_batch)
        smallest = self.state.global_batch // dp
        if smallest < n_micro:
            raise SamplerError(
                f"global batch {self.state.global_batch} over dp={dp} gives parts of {smallest} and "
                f"{largest} "
                f"samples, which cannot all be cut into {n_micro} micro-batches of at most {micro_batch}; "
                "use a larger micro-batch or a global batch divisible by dp"
            )
        return n_micro

    def micro_batch_ids(self, dp: int, rank: int, micro_batch: int) -> list[np.ndarray]:
        """Rank `rank`'s part cut into `micro_batches_per_rank` contiguous, balanced, non-empty pieces."""
        n_micro = self.micro_batches_per_rank(dp, micro_batch)
        ids = self.rank_ids(dp, rank)
        return [ids[slice(*split_bounds(len(ids), n_micro, i))] for i in range(n_micro)]

    # -- position -----------------------------------------------------------------------------------------
    def advance(self) -> None:
        """Move past the current global batch (into the next epoch after the last full one)."""
        s = self.state
        s.consumed += s.global_batch
        if s.consumed + s.global_batch > s.num_samples:
            s.epoch += 1
            s.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a position; the data set and the global batch must be the ones this sampler serves."""
        new = SamplerState(**{k: int(v) for k, v in sd.items()})
        for key in ("num_samples", "global_batch"):
            if getattr(new, key) != getattr(self.state, key):
                raise SamplerError(
                    f"sampler state has {key}={getattr(new, key)}, this job has {getattr(self.state, key)}"
                )
        if new.consumed % new.global_batch or not 0 <= new.consumed <= new.num_samples - new.global_batch:
            raise SamplerError(f"invalid sampler position: consumed={new.consumed}")
        self.state = new
