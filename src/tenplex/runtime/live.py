"""What the controller shows while the job runs: the layout, step, loss and tokens/s, and each
reconfiguration with its downtime and bytes moved."""

from __future__ import annotations

import sys
from typing import Any

from ..util import human_bytes
from .history import change_name, kind_of
from .records import Kind


class LiveView:
    def __init__(self, steps: int | None, quiet: bool = False) -> None:  # None: not known yet
        self.steps, self.quiet = steps, quiet
        self.tty = sys.stdout.isatty()

    def _print(self, text: str) -> None:
        if not self.quiet:
            if self.tty:
                sys.stdout.write("\r\033[K")
            print(text, flush=True)

    def note(self, text: str) -> None:
        self._print(f"[tenplex] {text}")

    def record(self, r: dict[str, Any], layout: Any) -> None:
        if self.quiet:
            return
        if r["kind"] == Kind.STEP:
            rate = f"{r['tokens_per_s']:8.0f} tok/s  " if r.get("tokens_per_s") else ""
            line = (
                f"step {r['step']:>4}/{self.steps or '?'}  {layout}  loss {r['loss']:.4f}  "
                f"{rate}{r['step_time']:.2f} s/step"
            )
            if self.tty:
                sys.stdout.write("\r\033[K" + line)
                sys.stdout.flush()
            elif r["step"] % 5 == 0 or r["step"] == self.steps:
                print(line, flush=True)
        elif r["kind"] == Kind.LOADED:
            moved = sum(v for k, v in r["bytes"].items() if k != "kept")
            rate = moved / r["seconds"] / 1e6 if r["seconds"] > 0 else 0.0
            self._print(
                f"  loaded step {r['step']} in {r['seconds']:.2f} s from {r['source']}: "
                f"{human_bytes(moved)} moved ({rate:.0f} MB/s), {_routes(r['bytes'])}"
            )
        elif r["kind"] == Kind.SAVED:
            self._print(
                f"  saved step {r['step']} in {r['seconds']:.2f} s ({human_bytes(r['bytes'])} written)"
            )

    def reconfig(self, info: dict[str, Any]) -> None:
        devices = (info["devices"][0], info["devices"][1])
        kind = change_name(kind_of(info, devices), devices)  # the words of the table and the plot
        parts = info.get("parts") or {}
        big = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        where = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in big if v >= 0.01)
        self._print(
            f"  {kind} {info['from']} -> {info['to']}: downtime {info['downtime']:.2f} s"
            + (f" (most: {where})" if where else "")
        )

    def close(self) -> None:
        if self.tty and not self.quiet:
            print()


def _routes(b: dict[str, float]) -> str:
    return ", ".join(f"{k} {human_bytes(v)}" for k, v in b.items() if v)
