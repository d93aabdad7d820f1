"""The devices of a job arranged on named axes, each device with a stable id and a host."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import prod

from .errors import PTCError


def device_id(host: int, local: int) -> str:
    """The default name of device `local` on host number `host`."""
    return f"h{host}/d{local}"


@dataclass(frozen=True)
class Mesh:
    """Axes in order (the last varies fastest between consecutive ranks) and, per rank, a device and a host.

    Devices are matched by id across reconfigurations (ranks get renumbered); hosts decide which moves cross
    the network.
    """

    axes: tuple[tuple[str, int], ...]
    devices: tuple[str, ...]
    hosts: tuple[str, ...]
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        if len(set(names)) != len(names):
            raise PTCError(f"mesh axes must have distinct names, got {names}")
        for name, size in self.axes:
            if not name or not isinstance(size, int) or size < 1:
                raise PTCError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")
        n = prod(s for _, s in self.axes)
        if len(self.devices) != n or len(self.hosts) != n:
            raise PTCError(
                f"a mesh of {n} ranks needs {n} devices and hosts, "
                f"got {len(self.devices)} and {len(self.hosts)}"
            )
        if len(set(self.devices)) != n:
            raise PTCError("every rank of a mesh needs its own device id")
        strides, s = [], 1
        for _, size in reversed(self.axes):
            strides.append(s)
            s *= size
        object.__setattr__(self, "_strides", tuple(reversed(strides)))

    @classmethod
    def build(
        cls,
        axes: Sequence[tuple[str, int]] | dict[str, int],
        devices_per_host: int = 8,
        devices: Sequence[tuple[str, str]] | None = None,
    ) -> Mesh:
        """A mesh over `devices` ((device id, host) per rank), by default `devices_per_host` per host."""
        ax = tuple(axes.items()) if isinstance(axes, dict) else tuple(axes)
        n = prod(s for _, s in ax)
        if devices is None:
            if devices_per_host < 1:
                raise PTCError(f"devices per host must be positive, got {devices_per_host}")
            devices = [
                (device_id(r // devices_per_host, r % devices_per_host), f"h{r // devices_per_host}")
                for r in range(n)
            ]
        if len(devices) != n:
            raise PTCError(f"axes {dict(ax)} need {n} devices, got {len(devices)}")
        return cls(ax, tuple(d for d, _ in devices), tuple(h for _, h in devices))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        return 1

    def axis_index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise PTCError(f"mesh has no axis {name!r} (axes: {', '.join(self.names)})") from None

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise PTCError(f"rank {rank} is outside a mesh of {self.size}")
        return tuple((rank // st) % sz for st, (_, sz) in zip(self._strides, self.axes))

    def rank(self, coords: Sequence[int]) -> int:
        if len(coords) != len(self.axes) or any(not 0 <= c < s for c, (_, s) in zip(coords, self.axes)):
            raise PTCError(f"coordinates {tuple(coords)} are outside mesh axes {dict(self.axes)}")
        return sum(c * st for c, st in zip(coords, self._strides))

    def ranks_where(self, fixed: dict[int, int | Iterable[int]]) -> list[int]:
        """All ranks whose coordinate on axis index i is in fixed[i] (all values on other axes), ascending."""
        ranks = [0]
        for i, (_, size) in enumerate(self.axes):
            want = fixed.get(i, range(size))
            values = [want] if isinstance(want, int) else list(want)
            ranks = [r + v * self._strides[i] for r in ranks for v in values]
        return sorted(ranks)

    def host_names(self) -> list[str]:
        """Hosts in order of their first rank."""
        return list(dict.fromkeys(self.hosts))

    def to_json(self) -> dict:
        return {
            "axes": [[n, s] for n, s in self.axes],
            "devices": list(self.devices),
            "hosts": list(self.hosts),
        }

    @classmethod
    def from_json(cls, data: dict) -> Mesh:
        try:
            axes = tuple((str(n), int(s)) for n, s in data["axes"])
            return cls(axes, tuple(map(str, data["devices"])), tuple(map(str, data["hosts"])))
        except (KeyError, TypeError, ValueError) as e:
            raise PTCError(f"malformed mesh in manifest: {e}") from None
