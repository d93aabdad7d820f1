"""Which device each rank of a new layout runs on, chosen so that the state stays where it already is.

A layout fixes what every rank holds, not where the rank runs. Numbering the devices in order ignores the
old layout: growing dp from 1 to 2 under pp 2 can put half of stage 1 on the hosts that hold stage 0 and
send both stages across the network. Matching ranks to hosts by the bytes those hosts already hold, and
then to devices by the bytes each device already holds, keeps them local. Blocks of consecutive ranks (a
tensor-parallel group when tp is the innermost axis) stay on one host when every host fits whole ones; and a
matching that splits more of them over hosts than the numbering does is never used, so fast intra-host links
serve the same groups as before.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from ..ptc import PTC, Mesh
from .plan import Plan, SourceGrid, check_compatible, group_tensors, lost_ranks, plan
from .stats import Bandwidth
from .transport import transport

Role = int  # index of a distinct set of held pieces: ranks of one role hold exactly the same bytes


def assign(old: PTC, new: PTC, lost: Iterable[str] = ()) -> PTC:
    """`new` with its (device, host) pairs handed to ranks so that the fewest bytes cross hosts.

    The devices and hosts stay the same set; only which rank runs where changes. Returns `new` itself when
    the matching does not beat the given numbering, so the result never moves more bytes across hosts.
    """
    return assign_plan(old, new, lost)[0].new


def assign_plan(
    old: PTC, new: PTC, lost: Iterable[str] = (), bandwidth: Bandwidth | None = None
) -> tuple[Plan, Plan]:
    """The plan into the matched layout (or into `new` when matching does not help), and the plan into `new`
    with its devices in numbering order: both are computed to decide, so both are returned."""
    lost = tuple(lost)
    check_compatible(old, new)
    numbered = plan(old, new, lost, bandwidth)
    roles, on_host, on_device = _affinity(old, new, lost_ranks(old, lost))
    slots = list(zip(new.mesh.devices, new.mesh.hosts))
    block = _block(new.mesh)
    host_of_rank = _match_hosts(new.mesh, roles, on_host, block)
    order = _match_devices(slots, roles, on_device, host_of_rank)
    mesh = Mesh(new.mesh.axes, tuple(slots[s][0] for s in order), tuple(slots[s][1] for s in order))
    if mesh == new.mesh or _split_groups(mesh) > _split_groups(new.mesh):  # a split group slows every step
        return numbered, numbered
    matched = plan(old, PTC(mesh, new.tensors, new.placements, new.values), lost, bandwidth)
    before, after = numbered.stats, matched.stats
    better = (after.cross_host, -after.kept) < (before.cross_host, -before.kept)
    return (matched if better else numbered), numbered


def _split_groups(mesh: Mesh) -> int:
    """Groups of the innermost axis (tensor parallelism, by convention) whose ranks span several hosts."""
    inner = mesh.axes[-1][1]
    return sum(len(set(mesh.hosts[g : g + inner])) > 1 for g in range(0, mesh.size, inner))


def _affinity(
    old: PTC, new: PTC, dead: frozenset[int]
) -> tuple[list[Role], list[Counter[str]], list[Counter[str]]]:
    """Each new rank's role, and per role the bytes already on each old host and on each old device."""
    held: list[list[int]] = [[] for _ in range(new.mesh.size)]  # indices of the pieces each rank holds
    piece_host: list[Counter[str]] = []
    piece_device: list[Counter[str]] = []
    for (shape, old_pl, new_pl), names in group_tensors(old, new).items():
        weight = sum(new.tensors[n].itemsize for n in names)
        grid = SourceGrid(old._pieces(shape, old_pl), len(shape))
        for target in new._pieces(shape, new_pl):
            hosts: Counter[str] = Counter()
            devices: Counter[str] = Counter()
            for source in grid.overlapping(target.box):
                part = source.box.intersect(target.box)
                assert part is not None
                alive = [r for r in source.holders if r not in dead]
                for h in {old.mesh.hosts[r] for r in alive}:
                    hosts[h] += part.volume * weight
                for r in alive:
                    devices[old.mesh.devices[r]] += part.volume * weight
            index = len(piece_host)
            piece_host.append(hosts)
            piece_device.append(devices)
            for dst in target.holders:
                held[dst].append(index)
    signatures: dict[tuple[int, ...], Role] = {}
    roles = [signatures.setdefault(tuple(h), len(signatures)) for h in held]
    on_host: list[Counter[str]] = [Counter() for _ in signatures]
    on_device: list[Counter[str]] = [Counter() for _ in signatures]
    for sig, role in signatures.items():
        for index in sig:
            on_host[role].update(piece_host[index])
            on_device[role].update(piece_device[index])
    return roles, on_host, on_device


def _block(mesh: Mesh) -> int:
    """Consecutive ranks kept together on one host: the innermost axis, when every host fits whole ones."""
    inner = mesh.axes[-1][1]
    per_host = Counter(mesh.hosts).values()
    return inner if all(n % inner == 0 for n in per_host) else 1


def _match_hosts(mesh: Mesh, roles: list[Role], on_host: list[Counter[str]], block: int) -> list[str]:
    """A host per rank: blocks of ranks to hosts, the bytes already there as large as possible in sum."""
    hosts = mesh.host_names()
    capacity = [n // block for n in map(Counter(mesh.hosts).__getitem__, hosts)]
    kinds: dict[tuple[Role, ...], list[int]] = defaultdict(list)  # blocks holding the same bytes
    for b in range(mesh.size // block):
        kinds[tuple(roles[b * block : (b + 1) * block])].append(b)
    value = {}
    for k, kind in enumerate(kinds):
        local: Counter[str] = Counter()
        for role in kind:
            local.update(on_host[role])
        value.update({(k, j): local[h] for j, h in enumerate(hosts) if local[h]})
    flow = transport([len(m) for m in kinds.values()], capacity, value)
    host_of_rank = [""] * mesh.size
    for k, members in enumerate(kinds.values()):
        it = iter(members)
        for j, n in enumerate(flow[k]):
            for _ in range(n):
                b = next(it)
                host_of_rank[b * block : (b + 1) * block] = [hosts[j]] * block
    if block == 1:
        _regroup(host_of_rank, roles, on_host, mesh.axes[-1][1])
    return host_of_rank


def _regroup(host_of_rank: list[str], roles: list[Role], on_host: list[Counter[str]], inner: int) -> None:
    """Swap ranks between hosts, keeping the bytes already in place, so that more groups of `inner`
    consecutive ranks share a host.

    The transport sees kinds of ranks, not groups: of two matchings that keep the same bytes in place it
    may take one that splits a tensor-parallel group the numbering kept whole, which `assign_plan` then
    rejects, losing the bytes too (a mesh with hosts of 4 and 2 devices and groups of 3 did: 0 cross-host
    bytes were possible, the numbering crossed). Each swap moves a rank to the host most of its group is on
    and strictly lowers the number of ranks away from their group's host, so the loop ends.
    """
    if inner == 1:
        return
    on: dict[str, list[int]] = defaultdict(list)
    for r, h in enumerate(host_of_rank):
        on[h].append(r)
    improved = True
    while improved:
        improved = False
        for g in range(len(host_of_rank) // inner):
            counts = Counter(host_of_rank[g * inner : (g + 1) * inner])
            if len(counts) == 1:
                continue
            target = max(counts, key=lambda h: (counts[h], -host_of_rank.index(h)))
            for r in range(g * inner, (g + 1) * inner):
                if host_of_rank[r] != target and _swap_to(r, target, host_of_rank, roles, on_host, on, inner):
                    improved = True


def _swap_to(
    r: int,
    target: str,
    host_of_rank: list[str],
    roles: list[Role],
    on_host: list[Counter[str]],
    on: dict[str, list[int]],
    inner: int,
) -> bool:
    """Swap rank `r` with the first rank on `target` of another group whose swap keeps the bytes in place
    and lowers the ranks away from their group's host; whether one was found."""

    def away(g: int) -> int:
        return inner - max(Counter(host_of_rank[g * inner : (g + 1) * inner]).values())

    here, g = host_of_rank[r], r // inner
    for s in on[target]:
        if s // inner == g:
            continue
        a, b = roles[r], roles[s]
        if on_host[a][target] + on_host[b][here] < on_host[a][here] + on_host[b][target]:
            continue  # the swap would give up bytes already in place
        before = away(g) + away(s // inner)
        host_of_rank[r], host_of_rank[s] = target, here
        if away(g) + away(s // inner) < before:
            on[target][on[target].index(s)] = r
            on[here][on[here].index(r)] = s
            return True
        host_of_rank[r], host_of_rank[s] = here, target
    return False


def _match_devices(
    slots: list[tuple[str, str]],
    roles: list[Role],
    on_device: list[Counter[str]],
    host_of_rank: list[str],
) -> list[int]:
    """A slot per rank within its host: the devices already holding the most of the ranks' bytes.

    An assignment problem per host (ranks x free slots, a few each): scipy's `linear_sum_assignment`.
    scipy is imported here, not at the top, so that `tenplex.planner` (imported by every rank's `load`)
    does not pay for scipy.optimize.
    """
    from scipy.optimize import linear_sum_assignment

    order = [-1] * len(slots)
    slots_on: dict[str, list[int]] = defaultdict(list)
    for s, (_, host) in enumerate(slots):
        slots_on[host].append(s)
    ranks_on: dict[str, dict[Role, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, host in enumerate(host_of_rank):
        ranks_on[host][roles[r]].append(r)
    for h, by_role in ranks_on.items():
        free = slots_on[h]
        ranks = [r for members in by_role.values() for r in members]
        held = np.array([[on_device[roles[r]][slots[s][0]] for s in free] for r in ranks], dtype=np.float64)
        rows, cols = linear_sum_assignment(held, maximize=True)
        for i, j in zip(rows, cols):
            order[ranks[i]] = free[j]
    return order
