"""Errors that rank 0 of a load raises travel to every rank pickled (`world.gather_then`, `world.deal`):
each is rebuilt whole there, with its type, message and fields."""

import pickle

import pytest

from tenplex.ptc import TenplexError
from tenplex.transformer import errors
from tenplex.transformer.world import _travels

CASES = [
    errors.KeyMismatchError(["a", "b"], ["c"]),
    errors.KeyMismatchError([], ["c"]),
    errors.ShapeMismatchError("tensor 'w' is float32[2] in the snapshot but float32[3] in the target"),
    errors.UnrecoverableError([("w", "[0:2]"), ("v", "[2:4]")]),
    errors.StoresLostError("job", {"http://h:1": "unreachable"}),
    errors.NoSnapshotError("no committed version of 'job'"),
    errors.GroupError("the process group broke during a gather: peer gone"),
]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_a_load_error_is_rebuilt_whole_on_another_rank(error):
    back = pickle.loads(pickle.dumps(_travels(error)))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


def test_an_error_that_cannot_be_rebuilt_travels_as_its_type_and_message():
    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"odd {a} {b}")

    back = pickle.loads(pickle.dumps(_travels(Odd(1, 2))))
    assert type(back) is TenplexError and str(back) == "Odd: odd 1 2"
