"""Small helpers every layer may use: byte sizes, terminal tables, ports, token files, logging.

This package imports nothing from the rest of tenplex, so any module can depend on it.
"""

from .format import human_bytes, print_table
from .logs import logger
from .net import free_port
from .sizes import SizeError, parse_size
from .tokens import TokenFileError, default_token_path, read_token, token_from_file

__all__ = [
    "SizeError",
    "TokenFileError",
    "default_token_path",
    "free_port",
    "human_bytes",
    "logger",
    "parse_size",
    "print_table",
    "read_token",
    "token_from_file",
]
