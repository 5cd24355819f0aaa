# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve``'s update guard answers a prepare message that names another
publication than the open update's itself, so the refusal never reaches the
workers (whose refusal would close the update) and the open sync goes on."""

from __future__ import annotations

from ..verification import samples as verification_samples
from .test_update_guard import HELD_THEN_RELEASED, WEIGHTS, RecordingEngine, Server, run

OPEN_ID = "pub-0123456789"
STRAY_ID = "pub-stray-9876543210"


def test_a_prepare_naming_another_publication_is_refused_and_the_sync_goes_on():
    header = verification_samples.header(publication_id=OPEN_ID).to_dict()
    message = {**WEIGHTS, "publication": header}

    async def go(server: Server) -> None:
        assert await server.post("/start_weight_update") == 200
        assert await server.update(message) == 200
        assert await server.update({"prepare": STRAY_ID}) == 409
        answer = server.answer("/update_weights")
        assert f"names publication '{STRAY_ID}'" in answer
        assert f"open update is publication {OPEN_ID}" in answer
        # the open sync goes on: more weights, its own prepare, the commit
        assert await server.update(message) == 200
        assert await server.update({"prepare": OPEN_ID}) == 200
        assert await server.post("/finish_weight_update", {}) == 200

    server = Server(RecordingEngine())
    run(go(server))
    prepares = [body for path, body, _ in server.routes.seen if b"prepare" in body]
    assert len(prepares) == 1 and STRAY_ID.encode() not in prepares[0]
    assert server.engine.calls == HELD_THEN_RELEASED  # nothing fenced or aborted


def test_a_prepare_before_any_publication_was_named_reaches_the_workers():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        assert await server.update({"prepare": STRAY_ID}) == 200

    server = Server(RecordingEngine())
    run(go(server))
    assert [path for path, _, _ in server.routes.seen][-1] == "/update_weights"
