"""The transportation problem, solved exactly: send every unit of supply to a slot, maximizing total value.

Used to match ranks to hosts and devices. Greedy matching fails on replicas (a role that would be as happy
elsewhere takes the only host another role can use); a min-cost flow does not. Sizes are kinds of ranks
and hosts (tens to hundreds), and pairs with no value share one zero-cost node, so the graph stays sparse.
"""

from __future__ import annotations

from collections import deque


def transport(supply: list[int], capacity: list[int], value: dict[tuple[int, int], int]) -> list[list[int]]:
    """`flow[a][b]`: units of supply `a` sent to capacity `b`, every unit placed, the summed value maximal.

    Deterministic: equal inputs give equal flows. Units sent where they have no value fill the free
    capacity in order, so units of one supply stay together where they can.
    """
    if sum(supply) != sum(capacity) or min(supply + capacity, default=0) < 0:
        raise ValueError(f"supplies {supply} and capacities {capacity} must be non-negative with equal sums")
    na, nb = len(supply), len(capacity)
    source, spare, sink = na + nb, na + nb + 1, na + nb + 2
    out: list[list[int]] = [[] for _ in range(na + nb + 3)]
    head: list[int] = []
    cap: list[int] = []
    cost: list[int] = []

    def edge(u: int, v: int, c: int, w: int) -> int:
        for a, b, cc, ww in ((u, v, c, w), (v, u, 0, -w)):
            out[a].append(len(head))
            head.append(b)
            cap.append(cc)
            cost.append(ww)
        return len(head) - 2

    for a, s in enumerate(supply):
        edge(source, a, s, 0)
    pairs = {
        (a, b): edge(a, na + b, min(supply[a], capacity[b]), -v)
        for (a, b), v in sorted(value.items())
        if v > 0
    }
    to_spare = [edge(a, spare, s, 0) for a, s in enumerate(supply)]
    from_spare = [edge(spare, na + b, c, 0) for b, c in enumerate(capacity)]
    for b, c in enumerate(capacity):
        edge(na + b, sink, c, 0)

    left = sum(supply)
    while left:
        path = _cheapest_path(out, head, cap, cost, source, sink)
        f, v = left, sink
        while v != source:
            f = min(f, cap[path[v]])
            v = head[path[v] ^ 1]
        v = sink
        while v != source:
            cap[path[v]] -= f
            cap[path[v] ^ 1] += f
            v = head[path[v] ^ 1]
        left -= f

    flow = [[0] * nb for _ in range(na)]
    for (a, b), e in pairs.items():
        flow[a][b] = cap[e ^ 1]
    spare_out = [cap[e ^ 1] for e in from_spare]
    b = 0
    for a, e in enumerate(to_spare):  # units with no value: in order, onto the free slots in order
        units = cap[e ^ 1]
        while units:
            while not spare_out[b]:
                b += 1
            n = min(units, spare_out[b])
            flow[a][b] += n
            spare_out[b] -= n
            units -= n
    return flow


def _cheapest_path(out: list[list[int]], head: list[int], cap: list[int], cost: list[int], s: int, t: int):
    """The edge into each node on a cheapest residual path from `s` (Bellman-Ford with a queue)."""
    inf = float("inf")
    dist = [inf] * len(out)
    into = [-1] * len(out)
    dist[s] = 0
    queue, queued = deque([s]), [False] * len(out)
    while queue:
        u = queue.popleft()
        queued[u] = False
        for e in out[u]:
            v = head[e]
            if cap[e] and dist[u] + cost[e] < dist[v]:
                dist[v] = dist[u] + cost[e]
                into[v] = e
                if not queued[v]:
                    queued[v] = True
                    queue.append(v)
    if into[t] < 0:
        raise AssertionError("no augmenting path although supply is left")  # equal sums make this impossible
    return into
