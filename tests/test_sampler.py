"""The dataset PTC: exactly once, same global batches, whatever the dp sizes along the way."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.data.sampler import ElasticSampler, SamplerError, split_bounds


def static_batches(n: int, gb: int, seed: int, steps: int) -> list[np.ndarray]:
    s = ElasticSampler(n, gb, seed)
    out = []
    for _ in range(steps):
        out.append(s.global_batch_ids().copy())
        s.advance()
    return out


def elastic_run(
    n: int, gb: int, seed: int, steps: int, changes: dict[int, int], mb: int = 0
) -> list[tuple[int, int, np.ndarray]]:
    """(step, dp, concatenated rank parts) per step; dp changes at the given steps, each change going
    through state_dict -> a fresh sampler, as a restarted job would."""
    s = ElasticSampler(n, gb, seed)
    dp = changes.get(0, 1)
    out = []
    for step in range(steps):
        if step in changes:
            dp = changes[step]
            fresh = ElasticSampler(n, gb, seed)
            fresh.load_state_dict(s.state_dict())
            s = fresh
        parts = [s.rank_ids(dp, r) for r in range(dp)]
        if mb:
            for r in range(dp):
                micro = s.micro_batch_ids(dp, r, mb)
                assert all(len(m) > 0 for m in micro)
                np.testing.assert_array_equal(np.concatenate(micro), parts[r])
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        out.append((step, dp, np.concatenate(parts)))
        s.advance()
    return out


def test_ledger_over_dp_changes_1_3_2_4() -> None:
    """Random change steps for dp 1 -> 3 -> 2 -> 4: every sample of the epoch once, batches as static."""
    rng = np.random.default_rng(0)
    n, gb = 1000, 12
    per_epoch = n // gb
    for trial in range(20):
        steps_at = sorted(rng.choice(np.arange(1, per_epoch), size=3, replace=False).tolist())
        changes = {0: 1, steps_at[0]: 3, steps_at[1]: 2, steps_at[2]: 4}
        run = elastic_run(n, gb, trial, per_epoch, changes, mb=2)
        static = static_batches(n, gb, trial, per_epoch)
        for (_, _, got), want in zip(run, static):
            np.testing.assert_array_equal(got, want)
        seen = np.concatenate([ids for _, _, ids in run])
        assert len(seen) == len(set(seen.tolist())) == per_epoch * gb  # exactly once
        order = np.random.default_rng([trial, 0]).permutation(n)
        np.testing.assert_array_equal(np.sort(seen), np.sort(order[: per_epoch * gb]))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    gb=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    epochs=st.integers(1, 3),
    data=st.data(),
)
def test_any_dp_sequence_serves_static_batches(n: int, gb: int, seed: int, epochs: int, data) -> None:
    if n < gb:
        with pytest.raises(SamplerError):
            ElasticSampler(n, gb, seed)
        return
    per_epoch = n // gb
    steps = per_epoch * epochs
    n_changes = data.draw(st.integers(0, min(4, steps)))
    at = data.draw(st.lists(st.integers(0, steps - 1), min_size=n_changes, max_size=n_changes, unique=True))
    changes = {s: data.draw(st.integers(1, gb)) for s in at}
    run = elastic_run(n, gb, seed, steps, changes)
    static = static_batches(n, gb, seed, steps)
    for (_, _, got), want in zip(run, static):
        np.testing.assert_array_equal(got, want)
    for e in range(epochs):  # exactly once within every epoch
        ids = np.concatenate([ids for _, _, ids in run[e * per_epoch : (e + 1) * per_epoch]])
        assert len(set(ids.tolist())) == len(ids) == per_epoch * gb


@given(size=st.integers(0, 500), parts=st.integers(1, 64))
def test_split_bounds_contiguous_balanced(size: int, parts: int) -> None:
    bounds = [split_bounds(size, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    np.testing.assert_array_equal(sizes, [len(p) for p in np.array_split(np.arange(size), parts)])


@given(gb=st.integers(1, 64), dp=st.integers(1, 64), mb=st.integers(1, 16))
def test_micro_batches_same_count_on_every_rank_or_clear_error(gb: int, dp: int, mb: int) -> None:
    s = ElasticSampler(1000, gb, 0)
    if dp > gb:
        with pytest.raises(SamplerError, match="at least one sample"):
            s.rank_ids(dp, 0)
        return
    try:
        m = s.micro_batches_per_rank(dp, mb)
    except SamplerError as e:  # only mb=1 with an uneven split can make an empty micro-batch
        assert mb == 1 and gb % dp and "micro-batch" in str(e)
        return
    for r in range(dp):
        micro = s.micro_batch_ids(dp, r, mb)
        assert len(micro) == m and all(1 <= len(x) <= mb for x in micro)


def test_epochs_roll_and_reshuffle() -> None:
    s = ElasticSampler(10, 3, 1)  # 3 batches per epoch; 1 sample of each epoch's order is left out
    first = []
    for _ in range(3):
        first.append(s.global_batch_ids().copy())
        s.advance()
    np.testing.assert_array_equal(np.concatenate(first), np.random.default_rng([1, 0]).permutation(10)[:9])
    assert (s.state.epoch, s.state.consumed, s.step) == (1, 0, 3)
    np.testing.assert_array_equal(s.global_batch_ids(), np.random.default_rng([1, 1]).permutation(10)[:3])
    assert not np.array_equal(s.order(0), s.order(1))


def test_state_dict_round_trip_and_validation() -> None:
    s = ElasticSampler(100, 10, 5)
    for _ in range(4):
        s.advance()
    sd = s.state_dict()
    assert sd == {"num_samples": 100, "global_batch": 10, "seed": 5, "epoch": 0, "consumed": 40}
    t = ElasticSampler(100, 10, 5)
    t.load_state_dict(sd)
    np.testing.assert_array_equal(t.global_batch_ids(), s.global_batch_ids())
    with pytest.raises(SamplerError, match="global_batch"):
        ElasticSampler(100, 20, 5).load_state_dict(sd)
    with pytest.raises(SamplerError, match="num_samples"):
        ElasticSampler(99, 10, 5).load_state_dict(sd)
    with pytest.raises(SamplerError, match="position"):
        t.load_state_dict({**sd, "consumed": 41})
    with pytest.raises(SamplerError):
        ElasticSampler(100, 0)


def test_sampler_does_not_import_torch() -> None:
    code = "import sys, tenplex.data.sampler, tenplex.data; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
