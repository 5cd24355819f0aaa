# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A served output that JSON cannot carry is answered as the server's fault.

Weights that produce NaN or infinity give logprobs (or other floats) of NaN.
The OpenAI routes serialize a whole response with JSON, which has no NaN, so
the serializer raises ``ValueError`` and vLLM's handler for ``ValueError``
answers ``400``: a client error, for a request that was valid, the fault
lying in the served weights. ``NonFiniteOutputs`` wraps the OpenAI routes
(``/v1/...``) and turns exactly that answer into ``500``, whose message names
the weight version that serves (``engine_client.get_weight_version()``) as
the cause. Every other answer passes through untouched; only ``400`` bodies
are read, and only under ``/v1/``. ``vllm.entrypoints.rl.factories`` mounts
it with the RL routes.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

# What Python's JSON encoder says when it meets NaN or infinity with
# ``allow_nan=False`` (Starlette's ``JSONResponse``).
NON_FINITE_JSON = "Out of range float values are not JSON compliant"

Scope = dict[str, Any]
Message = dict[str, Any]


class NonFiniteOutputs:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        body: list[bytes] = []

        async def send_or_hold(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] == 400:
                held = message
                return
            if held is None:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._answer(scope, held, b"".join(body), send)

        await self.app(scope, receive, send_or_hold)

    async def _answer(
        self, scope: Scope, start: Message, body: bytes, send: Any
    ) -> None:
        """The held ``400``, or the ``500`` naming the weights when it is the
        JSON encoder's refusal of a non-finite value."""
        if NON_FINITE_JSON.encode() not in body:
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        version = await _weight_version(scope)
        message = (
            f"the served weights (weight_version {version!r}) produced a NaN or "
            "infinite value in this request's output, which JSON cannot carry: "
            "the fault is in the served weights, not in the request. Sync "
            "weights that produce finite values"
        )
        logger.error("%s %s: %s", scope.get("method"), scope.get("path"), message)
        payload = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        ).encode()
        headers = [
            (k, v)
            for k, v in start.get("headers", [])
            if k.lower() not in (b"content-length", b"content-type")
        ]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": 500, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


async def _weight_version(scope: Scope) -> str | None:
    """The weight version the engine serves, or None when it cannot say."""
    app = scope.get("app")
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    try:
        return await engine.get_weight_version()  # type: ignore[union-attr]
    except Exception as e:
        logger.debug("no weight version for the non-finite answer: %s", e)
        return None
