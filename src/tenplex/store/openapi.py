"""The daemon's API as an OpenAPI 3.1 document, generated from its route table so it cannot drift."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .request import Route

_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")
_JSON = {"application/json": {"schema": {"type": "object"}}}
_RAW = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_ERROR = {"description": "a JSON error: {error, message}", "content": _JSON}


AUTH = (
    "Only the handshake (POST /v1/hello, then POST /v1/auth: an HMAC challenge-response in both "
    "directions, see tenplex.store.auth) and GET /v1/local are answered on a connection that has not "
    "authenticated; every other request there is answered 401. A Unix-socket peer of the store's uid or "
    "root is authenticated by its credentials. No request carries the token."
)


def document(routes: Iterable[Route], protocol: int) -> dict[str, Any]:
    """Every route with its path parameters; raw-byte bodies (blob writes, box reads) marked as such."""
    paths: dict[str, dict[str, Any]] = {}
    for method, pattern, fn, body, public in routes:
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
        if body != "none":
            op["requestBody"] = {"required": body == "raw", "content": _RAW if body == "raw" else _JSON}
        if public:
            op["x-unauthenticated"] = True
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tenplex tensor store", "version": str(protocol), "description": AUTH},
        "paths": paths,
    }
