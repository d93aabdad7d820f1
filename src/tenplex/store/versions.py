"""What the catalog holds: blobs, one save of a step (`Version`), and a step's own save and peers' copies
(`Slot`), with the rule that picks the one save a read is served from. See `catalog` for the rules."""

from __future__ import annotations

import mmap
import re
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..ptc import item_size
from .arena import Place
from .checksum import CHUNK
from .errors import BadRequestError

ANY: Any = object()  # "whichever save this store shows for the step"
_SAVE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(eq=False)
class Blob:
    """One shard blob: C-order bytes of `shape` × `dtype` in shared memory (a file or a reserve range)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    place: Place
    sealed: bool = False
    digests: list[int] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    origin: str | None = None  # for a replica: the store whose blob this copies
    refs: int = 0  # requests serving it right now (reads, relay answers, replication pushes)
    dead: bool = False  # deleted: its memory is freed when the last holder releases it
    mapped: bool = False  # a client writes it through its own mapping (allocate): never pooled unsealed

    @property
    def path(self) -> str:
        return self.place.path

    @property
    def mem(self) -> mmap.mmap | bytearray | memoryview:
        return self.place.mem

    @property
    def itemsize(self) -> int:
        return item_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * item_size(self.dtype)

    def info(self, local: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
            "sealed": self.sealed, "copies": list(self.copies),
        }  # fmt: skip
        if local:  # what a same-host client needs to map and verify the blob itself
            out.update(self.where(), chunk=CHUNK, digests=self.digests)
        return out

    def where(self) -> dict[str, Any]:
        """Where a same-host client maps the blob: `span` bytes of the file at `path`, the blob `nbytes`
        at `offset` in them (every answer that hands out a blob's memory says all four)."""
        p = self.place
        return {"path": p.path, "offset": p.offset, "span": p.span, "nbytes": self.nbytes}

    def release(self) -> None:
        if isinstance(self.mem, mmap.mmap):
            try:
                self.mem.close()
            except BufferError:  # a reader still holds a view: the mapping goes when it is done
                pass


@dataclass(eq=False)
class Version:
    """One save of a step as this store holds it: its own ranks' blobs, or (`replica_of`) a peer's copy."""

    step: int
    save_id: str | None = None
    replica_of: str | None = None
    blobs: dict[str, Blob] = field(default_factory=dict)
    committed: bool = False
    manifest: Any = None
    created: float = field(default_factory=time.time)
    committed_at: float = 0.0
    replication: str = "none"  # none | pending | done | failed: <reason>
    live: bool = True  # False once deleted or replaced: a write started for it must not land anywhere
    born: int = 0  # the catalog's clock when it was opened, and when committed: retention goes by these,
    order: int = 0  # never by step number (a rolled-back step is newer than a larger one)
    complete: bool = False  # a saver said it is committed on every store (retain's `protect`)

    def info(self) -> dict[str, Any]:
        return {
            "step": self.step, "committed": self.committed, "blobs": len(self.blobs),
            "nbytes": sum(b.nbytes for b in self.blobs.values()), "created": self.created,
            "replica_of": self.replica_of, "replication": self.replication,
            "save_id": self.save_id,  # tells this save from another attempt at the step
        }  # fmt: skip


@dataclass(eq=False)
class Slot:
    """Everything held for one (job, step): this store's own save and the copies peers pushed here."""

    own: Version | None = None
    copies: dict[str, Version] = field(default_factory=dict)  # origin URL -> its newest save copied here
    # this store's committed save of the step while a newer save of it is written or committed (`own`): it
    # stays readable by its save id until the newer one is known complete (retention drops it then), so
    # a save of a step that fails midway, or whose commit reached only some stores, never takes the
    # step's complete save with it
    prior: Version | None = None

    def versions(self) -> list[Version]:
        mine = [v for v in (self.own, self.prior) if v is not None]
        return mine + list(self.copies.values())

    def readable(self, save_id: Any = ANY) -> list[Version]:
        """The committed versions a read is served from, all of one save (own first).

        By default the save shown is this store's own once committed (a store that writes the step itself
        shows nothing before its own commit), else the copy committed last."""
        if save_id is ANY:
            if self.own is not None:
                shown = self.own if self.own.committed else self.prior
                if shown is None:
                    return []
                save_id = shown.save_id
            else:
                done = [c for c in self.copies.values() if c.committed]
                if not done:
                    return []
                save_id = max(done, key=lambda c: c.committed_at).save_id
        return [v for v in self.versions() if v.committed and v.save_id == save_id]

    def committed_ids(self) -> list[str | None]:
        """The saves of the step a read can name here: this store's own committed ones (newest first) if
        it writes the step itself, else the copies committed here."""
        mine = [v for v in (self.own, self.prior) if v is not None]
        pool = mine if mine else list(self.copies.values())
        return [v.save_id for v in sorted(pool, key=lambda v: -v.order) if v.committed]

    def info(self) -> dict[str, Any]:
        shown = self.readable()
        head = shown[0] if shown else (self.own or next(iter(self.copies.values())))
        out = head.info()
        out["saves"] = self.committed_ids()
        if len(shown) > 1:
            out["blobs"] = sum(len(v.blobs) for v in shown)
            out["nbytes"] = sum(b.nbytes for v in shown for b in v.blobs.values())
        return out


def check_save_id(value: object) -> str:
    """A save id as a request names it: printable, URL-safe and bounded (save uses uuid4 hex)."""
    if not isinstance(value, str) or not _SAVE_ID.fullmatch(value):
        raise BadRequestError(f"invalid save_id {str(value)[:80]!r}: expected [A-Za-z0-9._-]{{1,128}}")
    return value
