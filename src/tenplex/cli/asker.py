"""`tenplex` commands read one per line on stdin (a JSON list: the arguments), each answered with one JSON
line on stdout (`code`, `out`, `err`): the schedule driver's asks (`tenplex devices`, `layout`, `stop`)
from a process that imported torch once, on the rendezvous' host, instead of a new interpreter per ask (a
torch import: seconds, on a loaded machine more than the steps between an ask and its step)."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from .main import main as tenplex


def serve() -> int:
    import torch.distributed  # noqa: F401 - imported while the job starts, not on its first ask

    for line in sys.stdin:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = tenplex(json.loads(line))
            except SystemExit as e:  # argparse's refusal
                code = e.code if isinstance(e.code, int) else 2
        print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
