# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``lora_routes.AdapterIdGuard`` without a server: an adapter push whose id
the OpenAI server's registry gives another name is answered 409 before the
engine sees it, a malformed header 400, a worker's refusal 400 instead of
500, and pushed ids are reserved against ``/v1/load_lora_adapter``'s
numbering. ``test_lora_http.py`` runs the same through ``vllm serve``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from vllm.distributed.weight_transfer.lora.wire import (
    REFUSED_MARK,
    AdapterConfig,
    AdapterHeader,
    memory_path,
)
from vllm.distributed.weight_transfer.serving.lora_routes import (
    LORA_ID_HEADER,
    AdapterIdGuard,
)
from vllm.lora.request import LoRARequest
from vllm.utils.counter import AtomicCounter

CONFIG = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj",))


class Route:
    """The app behind the guard: answers 200, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        message = await receive()
        self.bodies.append(message.get("body", b""))
        if self.error is not None:
            raise self.error
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def models(*loaded: LoRARequest) -> Any:
    counter = AtomicCounter(max((r.lora_int_id for r in loaded), default=0))
    return SimpleNamespace(
        lora_requests={r.lora_name: r for r in loaded}, lora_id_counter=counter
    )


def post(guard: AdapterIdGuard, path: str, body: Any, state: Any) -> tuple[int, str]:
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "app": SimpleNamespace(state=SimpleNamespace(openai_serving_models=state)),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": json.dumps(body).encode()}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if "body" in m).decode()
    return status, text


def push_body(name: str = "evil", lora_id: int = 1) -> dict:
    adapter = AdapterHeader(name, lora_id, CONFIG).to_dict()
    return {"update_info": {"names": [], "adapter": adapter}}


def test_a_push_of_an_id_the_server_gave_another_name_is_409_before_the_engine():
    route = Route()
    guard = AdapterIdGuard(route)
    state = models(LoRARequest("sft", 1, "/peft/sft"))
    status, text = post(guard, "/update_weights", push_body(), state)
    assert status == 409
    assert "lora_id 1 already serves adapter 'sft'" in text and REFUSED_MARK in text
    assert route.bodies == []
    # Its own name, or its own memory path under a server id, goes through.
    assert post(guard, "/update_weights", push_body("sft"), state)[0] == 200
    mem = models(LoRARequest("evil", 1, memory_path("evil")))
    assert post(guard, "/update_weights", push_body(), mem)[0] == 200


def test_a_malformed_adapter_header_is_400_before_the_engine():
    route = Route()
    guard = AdapterIdGuard(route)
    body = push_body()
    body["update_info"]["adapter"]["name"] = "x\nWARNING forged log line"
    status, text = post(guard, "/update_weights", body, models())
    assert status == 400 and "adapter name" in text and route.bodies == []


def test_a_workers_refusal_is_answered_400_with_its_message():
    refusal = Exception(f"Worker failed with error '{REFUSED_MARK}rank 16'")
    guard = AdapterIdGuard(Route(refusal))
    status, text = post(guard, "/update_weights", push_body(), models())
    assert status == 400 and "rank 16" in text
    assert guard.pushed == {}  # refused: not reserved


def test_pushed_ids_are_reserved_against_the_servers_numbering():
    guard = AdapterIdGuard(Route())
    state = models()
    for lora_id in (1, 2):
        assert (
            post(guard, "/update_weights", push_body("evil", lora_id), state)[0] == 200
        )
    # The server would give a new name id 1: it gets 3.
    post(guard, "/v1/load_lora_adapter", {"lora_name": "sft"}, state)
    assert state.lora_id_counter.value == 2
    # The pushed adapter's own name keeps the next id.
    guard.pushed = {3: "policy"}
    post(guard, "/v1/load_lora_adapter", {"lora_name": "policy"}, state)
    assert state.lora_id_counter.value == 2


def test_the_load_answer_names_the_id_the_server_gave():
    guard = AdapterIdGuard(Route())
    state = models(LoRARequest("sft", 4, "/peft/sft"))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/load_lora_adapter",
        "app": SimpleNamespace(state=SimpleNamespace(openai_serving_models=state)),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b'{"lora_name": "sft"}'}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    assert (LORA_ID_HEADER.encode(), b"4") in sent[0]["headers"]
