# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The few ASGI steps the fork's API-server middlewares share: which route a
request is for, reading its JSON body once while the route still gets it,
and answering with an error of the OpenAI server's shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def route_path(scope: dict) -> str:
    """The request's path below the app's ``root_path`` (what routing
    matches)."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "")).rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


def post_route(scope: dict) -> str | None:
    """``route_path`` of an HTTP POST; None for anything else."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    return route_path(scope)


async def read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a ``receive`` that hands it to the route."""
    chunks = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` parsed as a JSON object; ``{}`` when it is empty, not JSON,
    or not an object (the route answers what is malformed)."""
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def with_header(send: Send, name: str, value: str) -> Send:
    """``send`` that adds one header to the response."""

    async def send_with_header(message: dict) -> None:
        if message.get("type") == "http.response.start":
            headers = list(message.get("headers", []))
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_header


async def json_response(send: Send, status: int, message: str) -> None:
    """An error answer: ``{"error": {"message": ..., "code": status}}``."""
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
