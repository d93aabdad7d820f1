"""What a failed child process printed, cut so that the first crash shows, not only the last words.

A rank that dies first (an abort, a fatal signal, an exception) makes every other rank fail after it with
long tracebacks of broken connections; the tail of the output is then theirs. The assertion messages of
tests that run a command show where the first crash began as well as the tail."""

from __future__ import annotations

import subprocess

# the first line of a crash: Python's faulthandler, C++'s std::terminate, glibc's heap checks, an exception
# (words a log may hold in passing, such as "corrupted", would move the cut before the crash)
MARKERS = (
    "Fatal Python error",
    "terminate called",
    "free(): ",
    "malloc(): ",
    "Traceback (most recent call last)",
)


def first_crash(text: str, size: int = 4000) -> str:
    """`size` characters of `text` from the earliest crash marker ('' if none)."""
    at = [i for i in (text.find(m) for m in MARKERS) if i >= 0]
    return text[min(at) : min(at) + size] if at else ""


def failure(done: subprocess.CompletedProcess, size: int = 3000) -> str:
    """The exit code, the first crash in stderr and the tails of stdout and stderr."""
    err = done.stderr or ""
    head = first_crash(err)
    parts = [f"exit code {done.returncode}"]
    if head and head not in err[-size:]:
        parts += ["--- the first crash ---", head]
    parts += ["--- stdout (tail) ---", (done.stdout or "")[-size:], "--- stderr (tail) ---", err[-size:]]
    return "\n".join(parts)
