"""The daemon's API as an OpenAPI 3.1 document, generated from its route table so it cannot drift."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from re import Pattern
from typing import Any

_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")
_JSON = {"application/json": {"schema": {"type": "object"}}}
_RAW = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_ERROR = {"description": "a JSON error: {error, message}", "content": _JSON}


def document(routes: Iterable[tuple[str, Pattern[str], Callable[..., Any]]], protocol: int) -> dict[str, Any]:
    """Every route with its path parameters; raw-byte bodies (blob writes, box reads) marked as such."""
    paths: dict[str, dict[str, Any]] = {}
    for method, pattern, fn in routes:
        path = _GROUP.sub(lambda m: "{" + m.group(1) + "}", pattern.pattern.rstrip("$"))
        raw_out = path.endswith("/read")
        op: dict[str, Any] = {
            "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}",
            "summary": (fn.__doc__ or fn.__name__.strip("_").replace("_", " ")).strip().splitlines()[0],
            "parameters": [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                for n in _GROUP.findall(pattern.pattern)
            ],
            "responses": {
                "200": {"description": "raw C-order bytes after a JSON preamble" if raw_out else "JSON",
                        "content": _RAW if raw_out else _JSON},
                "4XX": _ERROR,
            },
        }  # fmt: skip
        if method in ("POST", "PUT"):
            op["requestBody"] = {"required": method == "PUT", "content": _RAW if method == "PUT" else _JSON}
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tenplex tensor store", "version": str(protocol)},
        "components": {"securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"token": []}],  # a token is required whenever the store binds beyond loopback
        "paths": paths,
    }
