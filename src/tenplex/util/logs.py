"""The `tenplex` logger: library code logs here; the CLI decides what reaches the terminal."""

from __future__ import annotations

import logging

logger = logging.getLogger("tenplex")


def get(name: str) -> logging.Logger:
    """A child logger (`tenplex.<name>`) for one part, so users can tune parts separately."""
    return logger.getChild(name)
