"""The transportation problem, solved exactly: send every unit of supply to a slot, maximizing total value.

Used to match kinds of ranks to hosts. Greedy matching fails on replicas (a role that would be as happy
elsewhere takes the only host another role can use); an exact solution does not. It is a linear program
whose matrix is a network matrix, so its optimal vertices are integral: scipy's HiGHS (`milp`) solves it.
A hand-written successive-shortest-path min-cost flow did this before, with the same optimal values and
far slower on the largest problems of `python benchmarks/bench_planner.py` (their `assign_s` in
results/bench_planner.json). Pairs with no value share one zero-cost spare node, so the program stays
sparse, and the units sent there fill the free capacity in order afterwards.
"""

from __future__ import annotations

import numpy as np


def transport(supply: list[int], capacity: list[int], value: dict[tuple[int, int], int]) -> list[list[int]]:
    """`flow[a][b]`: units of supply `a` sent to capacity `b`, every unit placed, the summed value maximal.

    Deterministic: equal inputs give equal flows. Units sent where they have no value fill the free
    capacity in order, so units of one supply stay together where they can.
    """
    if sum(supply) != sum(capacity) or min(supply + capacity, default=0) < 0:
        raise ValueError(f"supplies {supply} and capacities {capacity} must be non-negative with equal sums")
    na, nb = len(supply), len(capacity)
    flow = [[0] * nb for _ in range(na)]
    pairs = sorted((a, b) for (a, b), v in value.items() if v > 0)
    spare_in, spare_out = list(supply), list(capacity)
    if pairs:
        x = _solve(supply, capacity, pairs, [value[p] for p in pairs])
        for (a, b), n in zip(pairs, x):
            flow[a][b] = n
            spare_in[a] -= n
            spare_out[b] -= n
    b = 0
    for a, units in enumerate(spare_in):  # units with no value: in order, onto the free slots in order
        while units:
            while not spare_out[b]:
                b += 1
            n = min(units, spare_out[b])
            flow[a][b] += n
            spare_out[b] -= n
            units -= n
    return flow


def _solve(
    supply: list[int], capacity: list[int], pairs: list[tuple[int, int]], values: list[int]
) -> list[int]:
    """Units on each valued pair; variables are the pairs, then each supply's and capacity's spare."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    na, nb, npairs = len(supply), len(capacity), len(pairs)
    rows = [a for a, _ in pairs] + [na + b for _, b in pairs] + list(range(na + nb))
    cols = [*range(npairs), *range(npairs), *range(npairs, npairs + na + nb)]
    matrix = coo_array((np.ones(len(rows)), (rows, cols)), shape=(na + nb, npairs + na + nb)).tocsr()
    totals = np.array(supply + capacity, dtype=float)
    cost = np.zeros(npairs + na + nb)
    cost[:npairs] = [-v for v in values]
    result = milp(
        cost,
        constraints=LinearConstraint(matrix, totals, totals),
        integrality=np.ones_like(cost),
        bounds=Bounds(0, np.inf),
    )
    if not result.success:  # the spare variables make every instance with equal sums feasible
        raise AssertionError(f"transport: HiGHS found no solution ({result.message})")
    return [int(n) for n in np.rint(result.x[:npairs])]
