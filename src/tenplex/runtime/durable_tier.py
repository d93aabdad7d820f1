"""The run's durable tier: a DCP checkpoint of the committed state at every reconfiguration and at the end
(`RUN_DIR/durable/step-N`), written in a thread off the next phase's path; the newest is what a rerun
whose stores were lost falls back to."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ..util import logs
from .records import Records

log = logs.get("runtime")


class DurableTier:
    def __init__(self, run_dir: Path, job: str, timeline: Records, preload: threading.Thread) -> None:
        self.dir, self.job, self.timeline, self.preload = run_dir / "durable", job, timeline, preload
        self.path: str | None = None  # the newest checkpoint written (or found)
        self._thread: threading.Thread | None = None

    def newest(self) -> int:
        """Take the newest checkpoint a previous controller wrote; its step (0: none)."""
        done = [p for p in self.dir.glob("step-*") if (p / ".metadata").exists()]
        if not done:
            return 0
        best = max(done, key=lambda p: int(p.name[5:]))
        self.path = str(best)
        return int(best.name[5:])

    def behind(self, step: int, store: str) -> float:
        """Persist the committed `step` from `store` in a thread (the next phase only loads from the stores).
        The seconds the caller waited: for the previous persist, if it is still writing."""
        t = time.time()
        self.join()
        self._thread = threading.Thread(target=self._write, args=(step, store), daemon=True)
        self._thread.start()
        return time.time() - t

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, store: str) -> None:
        self.preload.join()  # the controller's torch import
        from ..store import StoreError
        from ..transformer import StateError, persist

        path = self.dir / f"step-{step}"
        try:
            info = persist(self.job, step, str(path), store=store)
        except (StoreError, StateError) as e:
            self.timeline.write("persist_failed", step=step, error=str(e))
            log.warning("persisting step %d to %s failed: %s", step, path, e)
            return
        self.path = str(path)
        self.timeline.write(
            "persist", step=step, path=str(path), seconds=info["seconds"], bytes=info["bytes"]
        )
