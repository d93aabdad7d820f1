"""The thin adapter that runs PyTorch's own DCP tests on the tensor stores (scripts/torch_dcp_suite.py).

On the path of every process of the stores variant (the tests spawn their ranks), it swaps DCP's file-system
storage for tenplex's before any test imports it: `FileSystemWriter(path, ...)` becomes
`StoreWriter(checkpoint_id=path)`, `FileSystemReader(path, ...)` becomes `StoreReader(checkpoint_id=path)`,
in every module that hands them out (`torch.distributed.checkpoint`, its `filesystem` module, the default
storage `dcp.save(checkpoint_id=...)` picks, and the format converters). The tests and their assertions are
untouched; `overwrite` and `_extensions` go to `StoreWriter` (which takes DCP's stream transforms and keeps
the bytes as written); the options that shape files (thread counts, one file per rank, the reader's
extension registry) have nothing to shape in a store.
"""

from __future__ import annotations

import os
from typing import Any

SWAP = "TENPLEX_DCP_SWAP"  # set by the runner for the stores variant only


def install() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _storage_utils, filesystem, format_utils

    from tenplex.dcp import StoreReader, StoreWriter

    fs_writer, fs_reader = filesystem.FileSystemWriter, filesystem.FileSystemReader

    class FileSystemWriter(StoreWriter):
        def __init__(
            self,
            path: str | os.PathLike,
            *args: Any,
            overwrite: bool = True,
            _extensions: Any = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(checkpoint_id=path, overwrite=overwrite, _extensions=_extensions)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
            return fs_writer.validate_checkpoint_id(checkpoint_id)

    class FileSystemReader(StoreReader):
        def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
            super().__init__(checkpoint_id=path)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
            return fs_reader.validate_checkpoint_id(checkpoint_id)

    for module in (dcp, filesystem, _storage_utils, format_utils):
        module.FileSystemWriter, module.FileSystemReader = FileSystemWriter, FileSystemReader


if os.environ.get(SWAP) == "1":
    install()
