"""`tenplex` command line: one module per command, each with `register(subparsers)`.

Every command reports bad input as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from importlib import import_module
from typing import Any

from ..ptc import TenplexError

# command modules in src/tenplex/cli/, each defining register(subparsers) -> None
COMMANDS = (
    "plan_cmd",
    "choose_cmd",
    "store_cmd",
    "train_cmd",
    "inspect_cmd",
    "run_cmd",
    "agent_cmd",
    "deploy_cmd",
    "import_cmd",
    "export_cmd",
)


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help shows its default, unless the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False  # a flag: off unless given
            or default in ("", [], argparse.SUPPRESS)
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2
        print(f"tenplex: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tenplex", description="Dynamic parallelism for PyTorch training jobs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        import_module(f".{name}", __package__).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.whole_process = argv is None  # the command line of its own process, not a call from Python
    # `kill -USR1 PID` prints every thread's stack to stderr and the command goes on: what a run that
    # seems stuck is waiting for
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, OSError, ValueError):  # stderr is no file: main() called in-process
        pass
    try:
        return int(args.func(args) or 0)
    except TenplexError as e:
        print(f"tenplex: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tenplex: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
