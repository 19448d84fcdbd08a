"""HTTP answers in one shape: status lines from http.HTTPStatus and the JSON error envelope.

The WSGI app (app.py) and the transport (httpserver.py, which refuses abusive requests before
the app sees them) both answer through these, so an error looks the same wherever it starts:
``{"error": {"code": ..., "message": ...}}`` (docs/reference.md, "HTTP API of the daemon").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any

Headers = list[tuple[str, str]]
Response = tuple[str, Headers, bytes]  # WSGI status line, headers, body


def status_line(status: int) -> str:
    """``"404 Not Found"``: the code and its standard reason phrase (none for an unknown code)."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} "


def encode_json(body: Mapping[str, Any]) -> bytes:
    """The one JSON encoding of an answer's body."""
    return (json.dumps(body, default=str) + "\n").encode()


def json_response(status: int, body: Mapping[str, Any] | bytes) -> Response:
    """A JSON answer that no cache keeps; ``body`` may come already encoded (encode_json)."""
    data = body if isinstance(body, bytes) else encode_json(body)
    return (status_line(status), [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(data))),
                                  ("Cache-Control", "no-store")], data)


def error_response(status: int, code: str, message: str,
                   retry_after_s: float | None = None) -> Response:
    """The JSON error envelope; ``retry_after_s`` adds Retry-After in whole seconds (>= 1)."""
    status_text, headers, data = json_response(
        status, {"error": {"code": code, "message": message}})
    if retry_after_s is not None:
        headers.append(("Retry-After", str(max(1, math.ceil(retry_after_s)))))
    return status_text, headers, data


def wire_bytes(status_text: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """A complete HTTP/1.1 response on one connection that then closes."""
    head = [f"HTTP/1.1 {status_text}"]
    head += [f"{k}: {v}" for k, v in headers if k.lower() != "connection"]
    head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
