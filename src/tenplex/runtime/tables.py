"""The one reader of the runtime's JSON/YAML files: schedules, para-config tables, calibrations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..ptc import TenplexError


class TableError(TenplexError):
    """A file that cannot be read or parsed; the message names it and what it was meant to be."""


def read_table(path: str | Path, what: str = "table", error: type[TenplexError] = TableError) -> Any:
    """The data of a JSON file, or a YAML one (.yaml/.yml, with PyYAML); `error` is raised, naming `what`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise error(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise error(f"YAML files ({what} {str(p)!r}) need PyYAML (pip install 'tenplex[yaml]')") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise error(f"{what} {str(p)!r} is not valid YAML: {e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise error(f"{what} {str(p)!r} is not valid JSON: {e}") from None
