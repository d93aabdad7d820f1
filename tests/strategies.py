"""Hypothesis strategies for random PTCs: meshes of up to 4 axes, uneven shapes, stages, host maps."""

from __future__ import annotations

from hypothesis import strategies as st

from tenplex.ptc import PTC, AnyPlacement, Explicit, Mesh, Placement, TensorMeta, device_id
from tenplex.ptc.collection import _layout

AXIS_NAMES = ("pp", "dp", "tp", "ep")


@st.composite
def meshes(draw, devices_pool: list[tuple[str, str]] | None = None) -> Mesh:
    names = draw(st.lists(st.sampled_from(AXIS_NAMES), min_size=1, max_size=4, unique=True))
    axes = tuple((n, draw(st.integers(1, 3))) for n in names)
    size = 1
    for _, s in axes:
        size *= s
    dph = draw(st.integers(1, 4))
    fresh = [(device_id(100 + r // dph, r % dph), f"h{100 + r // dph}") for r in range(size)]
    if devices_pool:
        pool = draw(st.permutations(devices_pool)) + fresh
        reuse = draw(st.integers(0, min(size, len(devices_pool))))
        devices = list(pool[:reuse]) + fresh[: size - reuse]
    else:
        devices = [(device_id(r // dph, r % dph), f"h{r // dph}") for r in range(size)]
    return Mesh.build(axes, devices=devices)


@st.composite
def placements(draw, mesh: Mesh, shape: tuple[int, ...]) -> AnyPlacement:
    """A mesh placement, or sometimes the same layout listed piece by piece."""
    p = draw(mesh_placements(mesh, shape))
    return Explicit(_layout(mesh, shape, p)) if draw(st.integers(0, 3)) == 0 else p


@st.composite
def mesh_placements(draw, mesh: Mesh, shape: tuple[int, ...]) -> Placement:
    shards = {}
    for axis in mesh.names:
        if axis == "pp" or not shape:
            continue
        if draw(st.booleans()):
            shards[axis] = draw(st.integers(0, len(shape) - 1))
    stages = None
    pp = mesh.axis_size("pp")
    if "pp" in mesh.names and draw(st.booleans()):
        stages = tuple(draw(st.lists(st.integers(0, pp - 1), min_size=1, max_size=pp, unique=True)))
    elif "pp" in mesh.names and shape and draw(st.booleans()):
        shards["pp"] = draw(st.integers(0, len(shape) - 1))
    return Placement.of(stages, **shards)


DTYPES = ("float32", "float64", "int16", "uint8", "float16")


@st.composite
def tensor_set(draw) -> list[TensorMeta]:
    n = draw(st.integers(1, 4))
    out = []
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        out.append(TensorMeta(f"t{i}.w", shape, draw(st.sampled_from(DTYPES))))
    return out


@st.composite
def ptcs(draw, metas: list[TensorMeta] | None = None, mesh: Mesh | None = None) -> PTC:
    metas = metas if metas is not None else draw(tensor_set())
    mesh = mesh if mesh is not None else draw(meshes())
    return PTC.build(mesh, [(m, draw(placements(mesh, m.shape))) for m in metas])


@st.composite
def ptc_pairs(draw) -> tuple[PTC, PTC]:
    """An old and a new layout of the same tensors; the new one reuses some old devices and hosts."""
    metas = draw(tensor_set())
    old = draw(ptcs(metas))
    new = draw(ptcs(metas, draw(meshes(devices_pool=list(zip(old.mesh.devices, old.mesh.hosts))))))
    return old, new


@st.composite
def ptc_pairs_with_lost(draw) -> tuple[PTC, PTC, list[str]]:
    """A pair as above and some old hosts that failed (never all of them)."""
    old, new = draw(ptc_pairs())
    hosts = old.mesh.host_names()
    return old, new, draw(st.lists(st.sampled_from(hosts), max_size=len(hosts) - 1, unique=True))
