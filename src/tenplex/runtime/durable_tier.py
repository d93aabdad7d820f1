"""The run's durable tier: DCP checkpoints of the committed state (`DIR/step-N`), written in a thread off
the training's path: by `tenplex run` at every reconfiguration and at the end (`RUN_DIR/durable`), by
`tenplex agent --persist-every N` every Nth snapshot (`--persist-dir`). The newest is what a job whose
stores were lost falls back to."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ..util import env, logs
from .record_types import Persist, PersistFailed
from .records import Records

log = logs.get("runtime")


def newest_checkpoint(directory: str | Path) -> tuple[str, int] | None:
    """The newest complete checkpoint under `directory` and its step (a partial write has no metadata)."""
    done = [p for p in Path(directory).glob("step-*") if p.name[5:].isdigit() and (p / ".metadata").exists()]
    if not done:
        return None
    best = max(done, key=lambda p: int(p.name[5:]))
    return str(best), int(best.name[5:])


def persisted() -> str | None:
    """The newest checkpoint under $TENPLEX_DURABLE (the agents' --persist-dir), if any."""
    directory = os.environ.get(env.DURABLE)
    found = newest_checkpoint(directory) if directory else None
    return found[0] if found else None


class DurableTier:
    def __init__(
        self, directory: Path, job: str, timeline: Records, preload: threading.Thread | None = None
    ) -> None:
        self.dir, self.job, self.timeline, self.preload = directory, job, timeline, preload
        self.path: str | None = None  # the newest checkpoint written (or found)
        self.step = 0  # its step (0: none), or the step being written
        self._thread: threading.Thread | None = None

    def newest(self) -> int:
        """Take the newest checkpoint written before (an earlier run or agent); its step (0: none)."""
        found = newest_checkpoint(self.dir)
        if found is None:
            return 0
        self.path, self.step = found
        return self.step

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def behind(self, step: int, store: str) -> float:
        """Persist the committed `step` from `store` in a thread (the next phase only loads from the stores).
        The seconds the caller waited: for the previous persist, if it is still writing."""
        t = time.time()
        self.join()
        self.step = max(self.step, step)
        self._thread = threading.Thread(target=self._write, args=(step, store), daemon=True)
        self._thread.start()
        return time.time() - t

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, store: str) -> None:
        if self.preload is not None:
            self.preload.join()  # the controller's torch import
        from ..store import StoreError
        from ..transformer import StateError, persist

        path = self.dir / f"step-{step}"
        try:
            info = persist(self.job, step, str(path), store=store)
        except (StoreError, StateError) as e:
            self.timeline.write(PersistFailed(step, str(e)))
            log.warning("persisting step %d to %s failed: %s", step, path, e)
            return
        self.path = str(path)
        self.timeline.write(Persist(step, str(path), info["seconds"], info["bytes"]))


class EveryNth:
    """`tenplex agent --persist-every N`: every Nth snapshot of the job committed in this host's store
    goes to the durable tier. The store keeps only the newest few, so snapshots are counted as they are
    seen (looked at once a second); a persist still being written lets the next ones wait."""

    def __init__(self, directory: Path, every: int, records: Records) -> None:
        self.dir, self.every, self.records = directory, every, records
        self.tier: DurableTier | None = None
        self.seen: set[int] = set()  # committed steps seen since the last persist

    def look(self, job: str, store: str) -> None:
        from ..store import StoreError
        from ..store.client import StoreClient

        if self.tier is None or self.tier.job != job:
            self.tier = DurableTier(self.dir, job, self.records)
            self.tier.newest()
        try:
            committed = StoreClient(store).versions(job)
        except StoreError:
            return
        done = max([self.tier.step, *self.seen])
        self.seen.update(s for s in committed if s > done)
        if len(self.seen) >= self.every and not self.tier.busy:
            step = max(self.seen)
            self.seen.clear()
            self.tier.behind(step, store)

    def join(self) -> None:
        if self.tier is not None:
            self.tier.join()
