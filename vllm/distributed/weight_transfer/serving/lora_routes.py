# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve``'s side of LoRA adapter pushes: one id names one adapter.

A worker's LoRA manager holds one adapter per integer id. Two parties hand
ids out: the OpenAI server numbers the adapters ``/v1/load_lora_adapter``
loads (from 1, ``OpenAIServingModels.lora_id_counter``), and a trainer's push
names its own (``AdapterHeader.lora_id``). ``AdapterIdGuard``, an ASGI
middleware mounted with the RL routes, keeps the two apart before the engine
sees either call, so no request ever reaches an engine step with an id two
adapters claim (a raise there stops ``vllm serve``):

* an adapter push (``/update_weights`` with an ``adapter`` header) is
  answered 400 when its header is malformed (a name outside the publication
  id's characters, a bad id or config), and 409 when the server's registry
  gives its ``lora_id`` to another adapter name, naming both;
* every pushed id the engine accepted is reserved: a ``/v1/load_lora_adapter``
  of a new name moves the server's counter past the pushed ids of other
  names, so the server never numbers another adapter with one;
* the answer to ``/v1/load_lora_adapter`` names the id the server gave the
  adapter (header ``x-vllm-lora-id``), which the server reports nowhere else;
* a worker's refusal of an adapter (its text carries
  ``lora_adapters.REFUSED_MARK``) reaches the route as a plain exception,
  which the server would answer 500; it is answered 400 with the worker's
  message.

With several API-server processes each guards the calls it serves.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.common.asgi import (
    json_object,
    json_response,
    post_route,
    read_body,
)
from vllm.distributed.weight_transfer.lora.wire import (
    ADAPTER_KEY,
    REFUSED_MARK,
    AdapterHeader,
    memory_path,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_PUSH_ROUTE = "/update_weights"
_LOAD_ROUTE = "/v1/load_lora_adapter"
# The answer's header naming the id ``/v1/load_lora_adapter`` gave the adapter.
LORA_ID_HEADER = "x-vllm-lora-id"


class AdapterIdGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: Any) -> None:
        self.app = app
        # Ids pushes named and the engine accepted: their adapter name.
        self.pushed: dict[int, str] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = post_route(scope)
        if route == _PUSH_ROUTE:
            await self._push(scope, receive, send)
        elif route == _LOAD_ROUTE:
            await self._load(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _push(self, scope: dict, receive: Any, send: Any) -> None:
        body, replay = await read_body(receive)
        headers = []
        update_info = json_object(body).get("update_info")
        # A list holds one message per worker rank (data parallel).
        items = update_info if isinstance(update_info, list) else [update_info]
        for item in items:
            if not isinstance(item, dict) or ADAPTER_KEY not in item:
                continue
            try:
                headers.append(AdapterHeader.from_dict(item[ADAPTER_KEY]))
            except ValueError as e:
                await json_response(
                    send, 400, f"{REFUSED_MARK}malformed adapter header: {e}"
                )
                return
        for header in headers:
            clash = self.registered_clash(scope, header)
            if clash is not None:
                await json_response(send, 409, REFUSED_MARK + clash)
                return
        status = await self._call(scope, replay, send)
        if status is not None and status < 300:
            self.pushed.update((h.lora_id, h.name) for h in headers)

    async def _call(self, scope: dict, receive: Any, send: Any) -> int | None:
        """The route's answer status; a worker's refusal of the adapter,
        raised as a plain exception, answered 400 with its message."""
        status: int | None = None

        async def forward(message: dict) -> None:
            nonlocal status
            if message.get("type") == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, forward)
        except Exception as e:
            if status is not None or REFUSED_MARK not in str(e):
                raise
            await json_response(send, 400, str(e))
            return 400
        return status

    async def _load(self, scope: dict, receive: Any, send: Any) -> None:
        body, replay = await read_body(receive)
        name = json_object(body).get("lora_name")
        models = _serving_models(scope)
        if not isinstance(name, str) or models is None:
            await self.app(scope, replay, send)
            return
        self.reserve_pushed_ids(models, name)

        async def naming_the_id(message: dict) -> None:
            request = models.lora_requests.get(name)
            if message.get("type") == "http.response.start" and request is not None:
                headers = list(message.get("headers", []))
                headers.append(
                    (LORA_ID_HEADER.encode(), str(request.lora_int_id).encode())
                )
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, replay, naming_the_id)

    def registered_clash(self, scope: dict, header: AdapterHeader) -> str | None:
        """Why the server's registry refuses ``header``'s id (None: it
        does not give it to another adapter name)."""
        models = _serving_models(scope)
        for request in getattr(models, "lora_requests", {}).values():
            if request.lora_int_id != header.lora_id:
                continue
            if request.lora_name == header.name or request.lora_path == memory_path(
                header.name
            ):
                continue
            return (
                f"adapter {header.name!r}: lora_id {header.lora_id} already "
                f"serves adapter {request.lora_name!r} (loaded by "
                "/v1/load_lora_adapter from "
                f"{request.lora_path!r}); push under an id the server does not "
                "hand out, e.g. from 1000. Nothing changed"
            )
        return None

    def reserve_pushed_ids(self, models: Any, name: str) -> None:
        """Move the server's id counter past the ids pushed under names
        other than ``name``, which a new adapter ``name`` would get next."""
        if name in models.lora_requests:
            return  # it keeps the id it has
        counter = models.lora_id_counter
        while self.pushed.get(counter.value + 1, name) != name:
            skipped = counter.inc(1)
            logger.info(
                "LoRA id %d is pushed adapter %r's: /v1/load_lora_adapter of %r "
                "gets a later one",
                skipped,
                self.pushed[skipped],
                name,
            )


def _serving_models(scope: dict) -> Any:
    app = scope.get("app")
    state = getattr(app, "state", None)
    models = getattr(state, "openai_serving_models", None)
    return models if hasattr(models, "lora_requests") else None
