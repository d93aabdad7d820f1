"""The reserve's ranges (`slab`): a range handed out is never handed out again while live, nor ever after
it was retired or (the reserve) given back to the kernel; free ranges merge; live blobs keep their bytes
whatever the others do. A pack (`sparse=True`) keeps the same rules, but hands out holes (given back
pages) again, backed anew."""

from __future__ import annotations

import mmap
import tempfile
from itertools import pairwise

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tenplex.store.shm import shm_root
from tenplex.store.slab import Slab
from tenplex.store.tmpfs import HUGE_PAGE

PAGE = mmap.PAGESIZE

ops = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(1, 40)),  # pages
        st.tuples(st.just("take_huge"), st.integers(1, 3)),  # huge pages
        st.tuples(st.sampled_from(["give", "retire"]), st.integers(0, 1000)),  # which live range
        st.tuples(st.just("punch"), st.integers(0, 20)),  # pages
    ),
    max_size=40,
)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


@settings(max_examples=150, deadline=None)
@given(huge=st.booleans(), sparse=st.booleans(), ops=ops)
@example(huge=True, sparse=False, ops=[("take", 1), ("take_huge", 1), ("give", 0), ("take_huge", 2)])
@example(huge=False, sparse=False, ops=[("take", 2), ("take", 3), ("give", 0), ("give", 0), ("take", 5)])
@example(huge=True, sparse=False, ops=[("punch", 0), ("punch", 1), ("take", 1), ("punch", 600)])
@example(
    huge=False,
    sparse=True,
    ops=[("take", 2), ("give", 0), ("punch", 1), ("take", 2), ("retire", 0), ("take", 1)],
)
def test_ranges_never_overlap_live_or_dead_ones_and_free_ones_merge(huge, sparse, ops):
    with tempfile.TemporaryDirectory(dir=shm_root()) as d:
        slab = Slab(d, 4 * HUGE_PAGE, huge, "s", sparse)
        live: list[tuple[int, int, int]] = []  # (offset, length, the byte it holds)
        dead: list[tuple[int, int]] = []  # retired or punched: never handed out again
        try:
            for i, (op, arg) in enumerate(ops):
                if op in ("take", "take_huge"):
                    n = arg * (HUGE_PAGE if op == "take_huge" else PAGE)
                    step = slab.align(n)
                    fits = any(-(-a // step) * step + n <= a + m for a, m in slab._free + slab._holes)
                    at = slab.take(n)
                    assert (at is not None) == fits  # None only where no free range has room
                    if at is None:
                        continue
                    assert at % slab.align(n) == 0 and at >= 0 and at + n <= slab.size
                    assert not any(_overlaps((at, n), (a, m)) for a, m, _ in live)
                    assert not any(_overlaps((at, n), r) for r in dead)
                    mark = i % 251 + 1
                    slab.view(at, n)[:] = bytes([mark]) * n
                    live.append((at, n, mark))
                elif op in ("give", "retire") and live:
                    at, n, _ = live.pop(arg % len(live))
                    if op == "give":
                        slab.give(at, n)
                    else:
                        slab.retire(at, n)
                        dead.append((at, n))
                elif op == "punch":
                    before, ask = list(slab._free), arg * PAGE
                    given_back = slab.punch(ask)
                    after = dict(slab._free)
                    assert all(after.get(a, 0) <= n for a, n in before) and len(after) <= len(before)
                    gone = [
                        (a + after.get(a, 0), n - after.get(a, 0)) for a, n in before if after.get(a, 0) < n
                    ]
                    assert given_back == sum(n for _, n in gone) >= min(ask, sum(n for _, n in before))
                    unit = slab.align(HUGE_PAGE)
                    assert given_back < ask + unit  # cut to what was asked, not whole ranges
                    dead += [] if sparse else gone  # a pack's holes may be handed out again
                free = slab._free
                assert free == sorted(free) and all(n > 0 for _, n in free)
                assert all(a + n < b for (a, n), (b, _) in pairwise(free))  # merged: never adjacent
                assert slab.left == sum(n for _, n in free)
                for r in free:
                    assert not any(_overlaps(r, (a, m)) for a, m, _ in live)
                    assert not any(_overlaps(r, x) for x in dead)
                accounted = slab.left + sum(n for _, n, _ in live) + sum(n for _, n in dead)
                assert accounted + sum(n for _, n in slab._holes) == slab.size
                assert slab.taken == sum(n for _, n, _ in live)
            for at, n, mark in live:  # nothing another range did reached a live one's bytes
                assert bytes(slab.view(at, n)) == bytes([mark]) * n
        finally:
            slab.release()


def test_a_range_fits_wherever_an_aligned_start_leaves_room(tmp_path):
    slab = Slab(str(tmp_path), 4 * HUGE_PAGE, huge=True)
    try:
        small = slab.take(PAGE)
        assert small == 0
        big = slab.take(HUGE_PAGE)
        assert big == HUGE_PAGE  # whole huge pages start on one: the pages before it stay free
        assert slab.take(HUGE_PAGE - PAGE) == PAGE  # the gap is used by what fits in it
        assert slab.take(3 * HUGE_PAGE) is None and slab.left == 2 * HUGE_PAGE
    finally:
        slab.release()
