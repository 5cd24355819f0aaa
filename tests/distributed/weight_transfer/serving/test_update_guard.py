# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``WeightUpdateGuard`` against a recording engine and a scripted ASGI app
(fast unit tests; ``test_ipc_http.py`` runs it inside ``vllm serve``)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.distributed.weight_transfer.serving.update_guard import WeightUpdateGuard

from ..verification import samples as verification_samples

HOLD_HEADER = b"x-vllm-weight-commit-hold"
WEIGHTS = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]}
# The engine calls of a hold the guard took and released: the pause, then the
# prefix cache reset with running requests and the resume.
HELD_THEN_RELEASED = [("pause", "keep"), ("reset_prefix_cache", True), ("resume",)]


class RecordingEngine:
    """The engine client calls the guard makes, in order."""

    def __init__(
        self, backend="ipc", staging="off", timeout_s=30.0, paused=False, workers=1
    ):
        self.calls: list[tuple] = []
        self.paused = paused
        self.vllm_config = SimpleNamespace(
            weight_transfer_config=SimpleNamespace(
                backend=backend, staging=staging, update_timeout_s=timeout_s
            ),
            parallel_config=SimpleNamespace(world_size_across_dp=workers),
        )

    async def is_paused(self) -> bool:
        return self.paused

    async def pause_generation(self, *, mode: str) -> None:
        self.calls.append(("pause", mode))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list:
        self.calls.append(("rpc", method, kwargs))
        return [None]

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("version", version))


class Routes:
    """An ASGI app answering each path with a scripted status; it notes what
    the engine had been asked before each route ran."""

    def __init__(self, engine: RecordingEngine, delay_s: float = 0.0) -> None:
        self.engine = engine
        self.status: dict[str, int] = {}
        self.seen: list[tuple[str, bytes, bool]] = []
        self.delay_s = delay_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["path"], body, self.engine.paused))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        status = self.status.get(scope["path"], 200)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


class Server:
    def __init__(self, engine: RecordingEngine, api_servers: int = 1, **kw) -> None:
        self.engine = engine
        self.routes = Routes(engine, **kw)
        # What a request goes through first (a test may wrap the guard).
        self.guard: Any = WeightUpdateGuard(self.routes)
        # The last answer's headers, by path.
        self.headers: dict[str, dict[bytes, bytes]] = {}
        self.bodies: dict[str, bytes] = {}
        self.app = SimpleNamespace(
            state=SimpleNamespace(
                engine_client=engine,
                args=SimpleNamespace(api_server_count=api_servers),
            )
        )

    async def post(self, path: str, body: Any = None) -> int:
        raw = json.dumps(body).encode() if body is not None else b""
        # The body in two pieces, as a client may stream it.
        pieces = [raw[: len(raw) // 2], raw[len(raw) // 2 :]]
        status = 0

        async def receive() -> dict:
            if pieces:
                return {
                    "type": "http.request",
                    "body": pieces.pop(0),
                    "more_body": bool(pieces),
                }
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.headers[path] = dict(message.get("headers", []))
            elif message["type"] == "http.response.body":
                self.bodies[path] = message.get("body", b"")

        scope = {"type": "http", "method": "POST", "path": path, "app": self.app}
        await self.guard(scope, receive, send)
        return status

    async def update(self, update_info: Any) -> int:
        return await self.post("/update_weights", {"update_info": update_info})

    def answer(self, path: str) -> str:
        """The error message of the last answer the guard itself gave."""
        return json.loads(self.bodies[path])["error"]["message"]


def run(coro) -> Any:
    return asyncio.run(coro)


def test_weights_are_held_from_the_first_message_until_finish():
    async def go(server: Server) -> None:
        assert await server.post("/start_weight_update") == 200
        assert server.engine.calls == []  # start alone holds nothing
        assert await server.update(WEIGHTS) == 200
        assert await server.update(WEIGHTS) == 200
        assert server.engine.calls == [("pause", "keep")]
        assert await server.update({"prepare": "p" * 8}) == 200
        assert await server.post("/finish_weight_update", {}) == 200
        assert server.engine.calls == HELD_THEN_RELEASED

    server = Server(RecordingEngine())
    run(go(server))
    # The weights reached the engine only once generation was held; the body
    # reached the route whole.
    path, body, paused = server.routes.seen[1]
    assert path == "/update_weights" and paused
    assert json.loads(body) == {"update_info": WEIGHTS}


def test_a_pause_someone_else_took_is_left_to_them():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        await server.post("/finish_weight_update")

    server = Server(RecordingEngine(paused=True))
    run(go(server))
    assert server.engine.calls == []


def test_a_client_pausing_during_the_hold_takes_the_pause_over():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        assert await server.post("/pause") == 200
        await server.post("/finish_weight_update")

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == [("pause", "keep")]


def test_resume_is_refused_while_weights_land():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        assert await server.post("/resume") == 200  # nothing held: passes
        await server.update(WEIGHTS)
        assert await server.post("/resume") == 409
        await server.post("/finish_weight_update")
        assert await server.post("/resume") == 200

    server = Server(RecordingEngine())
    run(go(server))
    assert [p for p, _, _ in server.routes.seen].count("/resume") == 2


def test_weights_refused_before_any_were_accepted_release_at_once():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        server.routes.status["/update_weights"] = 500
        await server.update(WEIGHTS)
        assert server.engine.paused is False
        assert await server.post("/resume") == 200

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == HELD_THEN_RELEASED


def test_a_failed_finish_after_accepted_weights_holds_until_a_finish_succeeds():
    """vLLM's worker keeps the update open while finish raises: generation
    waits for the trainer's abort and finish, and the abort fences the label."""

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        server.routes.status["/finish_weight_update"] = 500
        await server.post("/finish_weight_update")
        assert server.engine.paused is True
        assert await server.post("/resume") == 409
        server.routes.status["/finish_weight_update"] = 200
        await server.update({"abort": "the trainer saw the failure"})
        assert server.engine.paused is True
        await server.post("/finish_weight_update")
        assert server.engine.paused is False

    server = Server(RecordingEngine())
    run(go(server))
    kind, version = server.engine.calls[1]
    assert kind == "version" and version.startswith("fenced:unknown: aborted: ")
    assert "the trainer saw the failure" in version
    assert server.engine.calls[-1] == ("resume",)


def test_a_failed_update_after_accepted_weights_fences_the_label_and_releases():
    """The worker closes the update whenever update_weights raises: the label
    names the failure before generation resumes, and the update is over."""
    header = verification_samples.header(publication_id="pub-0123456789").to_dict()

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update({**WEIGHTS, "publication": header})
        server.routes.status["/update_weights"] = 500
        await server.update({**WEIGHTS, "publication": header})
        assert server.engine.paused is False

    server = Server(RecordingEngine())
    run(go(server))
    assert [c[0] for c in server.engine.calls] == [
        "pause",
        "version",
        "reset_prefix_cache",
        "resume",
    ]
    version = server.engine.calls[1][1]
    assert version.startswith("fenced:pub-0123456789: closed when update_weights")


def test_a_failed_finish_then_silence_is_fenced_at_the_deadline():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        server.routes.status["/finish_weight_update"] = 500
        await server.post("/finish_weight_update")
        await asyncio.sleep(0.5)

    server = Server(RecordingEngine(timeout_s=0.2))
    run(go(server))
    kinds = [c[0] for c in server.engine.calls]
    assert kinds == ["pause", "rpc", "rpc", "version", "reset_prefix_cache", "resume"]
    assert server.engine.calls[3][1].startswith("fenced:unknown: no weight update")


def test_abort_and_prepare_messages_hold_nothing():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update({"abort": "x"})
        await server.update({"prepare": "p" * 8})
        await server.update([{"abort": "x"}])

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == []


def test_a_silent_update_is_aborted_and_fenced_at_the_deadline():
    header = verification_samples.header(publication_id="pub-0123456789").to_dict()

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update({**WEIGHTS, "publication": header})
        await asyncio.sleep(0.5)

    server = Server(RecordingEngine(timeout_s=0.2))
    run(go(server))
    calls = server.engine.calls
    assert calls[0] == ("pause", "keep")
    abort = calls[1]
    assert abort[:2] == ("rpc", "update_weights")
    assert "update_timeout_s" in abort[2]["update_info"]["abort"]
    assert calls[2] == ("rpc", "finish_weight_update", None)
    kind, version = calls[3]
    assert kind == "version"
    assert version.startswith("fenced:pub-0123456789: no weight update call for 0.2 s")
    assert calls[4:] == [("reset_prefix_cache", True), ("resume",)]


def test_the_deadline_waits_for_a_call_in_flight():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)  # takes 0.4 s, twice the deadline
        await server.update(WEIGHTS)
        await server.post("/finish_weight_update")

    server = Server(RecordingEngine(timeout_s=0.2), delay_s=0.4)
    run(go(server))
    assert [c[0] for c in server.engine.calls] == [
        "pause",
        "reset_prefix_cache",
        "resume",
    ]


@pytest.mark.parametrize(
    "engine, api_servers",
    [
        (RecordingEngine(backend="nccl"), 1),
        (RecordingEngine(), 2),
        (RecordingEngine(staging="host"), 2),
    ],
    ids=["other-backend", "two-api-servers", "staged-two-api-servers"],
)
def test_the_guard_is_off_where_it_does_not_apply(engine, api_servers):
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        assert await server.post("/resume") == 200
        await server.post("/finish_weight_update")

    server = Server(engine, api_servers=api_servers)
    run(go(server))
    assert engine.calls == []
    assert HOLD_HEADER not in server.headers["/start_weight_update"]


@pytest.mark.parametrize("staging", ["off", "host", "device"])
def test_start_says_the_server_holds_the_commit(staging):
    server = Server(RecordingEngine(staging=staging))
    run(server.post("/start_weight_update"))
    assert server.headers["/start_weight_update"][HOLD_HEADER] == b"server"


@pytest.mark.parametrize("staging", ["host", "device"])
def test_a_staged_engine_is_held_for_the_commit_only(staging):
    """The transfer runs with generation on; the finish runs paused, then the
    old KV is dropped and generation resumes, all within that request."""

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        await server.update({"prepare": "p" * 8})
        assert server.engine.calls == []
        assert await server.post("/finish_weight_update", {}) == 200

    server = Server(RecordingEngine(staging=staging))
    run(go(server))
    paused_at = {path: paused for path, _, paused in server.routes.seen}
    assert paused_at == {
        "/start_weight_update": False,
        "/update_weights": False,
        "/finish_weight_update": True,
    }
    assert server.engine.calls == HELD_THEN_RELEASED


def test_a_failed_commit_still_resumes_and_a_clients_pause_is_left_alone():
    async def go(server: Server) -> None:
        server.routes.status["/finish_weight_update"] = 500
        assert await server.post("/finish_weight_update") == 500
        assert server.engine.paused is False
        server.engine.paused = True  # a client paused before the commit
        server.routes.status["/finish_weight_update"] = 200
        await server.post("/finish_weight_update")
        assert server.engine.paused is True

    server = Server(RecordingEngine(staging="host"))
    run(go(server))
    assert server.engine.calls == HELD_THEN_RELEASED


# A LoRA adapter push's message (``lora_adapters.ADAPTER_KEY``): staged apart
# from the model until its finish.
ADAPTER = {
    **WEIGHTS,
    "adapter": {"name": "policy", "lora_id": 1, "config": {}, "version": "v2"},
}


def test_an_adapter_push_holds_only_its_finish():
    """Generation goes on while the adapter is sent and prepared (a resume
    passes through); the finish runs paused, then the old KV is dropped and
    generation resumes, as for a staged commit."""

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(ADAPTER)
        await server.update({"prepare": "p" * 8})
        assert server.engine.calls == []
        assert await server.post("/resume") == 200
        assert await server.post("/finish_weight_update", {}) == 200

    server = Server(RecordingEngine())
    run(go(server))
    paused_at = {path: paused for path, _, paused in server.routes.seen}
    assert paused_at == {
        "/start_weight_update": False,
        "/update_weights": False,
        "/resume": False,
        "/finish_weight_update": True,
    }
    assert server.engine.calls == HELD_THEN_RELEASED


def test_a_silent_adapter_push_is_aborted_at_the_deadline_and_nothing_is_fenced():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(ADAPTER)
        await asyncio.sleep(0.5)

    server = Server(RecordingEngine(timeout_s=0.2))
    run(go(server))
    calls = server.engine.calls
    # Closed on the workers; no pause was taken, the version label stays.
    assert [c[:2] for c in calls] == [
        ("rpc", "update_weights"),
        ("rpc", "finish_weight_update"),
    ]
    assert "weights and adapters are unchanged" in (calls[0][2]["update_info"]["abort"])


def test_base_weights_after_an_adapter_are_held_from_their_first_message():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(ADAPTER)
        assert server.engine.calls == []
        await server.update(WEIGHTS)
        assert server.engine.calls == [("pause", "keep")]
        assert await server.post("/resume") == 409
        await server.post("/finish_weight_update")

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == HELD_THEN_RELEASED


@pytest.mark.parametrize("payload", ["weights", "adapter"])
def test_an_update_closed_at_the_deadline_is_no_longer_open_in_the_status(payload):
    """The abort and finish the guard sends itself reach the route observer:
    ``/weight_update_status`` shows nothing open, and the sync counts as
    aborted."""
    from prometheus_client import CollectorRegistry

    from vllm.distributed.weight_transfer.serving.metrics import (
        RouteSyncObserver,
        WeightSyncMetricsMiddleware,
        WeightTransferMetrics,
    )

    metrics = WeightTransferMetrics(CollectorRegistry())
    observer = RouteSyncObserver(metrics=lambda: metrics)
    server = Server(RecordingEngine(timeout_s=0.2))
    server.guard = WeightSyncMetricsMiddleware(
        WeightUpdateGuard(server.routes, observer=observer), observer=observer
    )

    async def go() -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS if payload == "weights" else ADAPTER)
        assert observer.update_status()["open"] is not None
        await asyncio.sleep(0.5)

    run(go())
    assert observer.update_status()["open"] is None
    assert metrics.failures.labels("ipc", "abort")._value.get() == 1
    assert metrics.syncs.labels("ipc")._value.get() == 0


# The decoys: element 0 is the rank-0 worker's weights, element 1 a
# message of another kind, for a server that runs one worker.
DECOYS = {
    "abort": [WEIGHTS, {"abort": "decoy"}],
    "prepare": [WEIGHTS, {"prepare": "p" * 8}],
    "adapter": [WEIGHTS, {"adapter": {}}],
    "too-long": [WEIGHTS, WEIGHTS],
    "empty": [],
    "not-an-object": [WEIGHTS, 5],
}


@pytest.mark.parametrize("case", DECOYS, ids=DECOYS)
def test_a_body_the_workers_would_read_differently_is_refused_before_the_engine(
    case,
):
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        assert await server.update(DECOYS[case]) == 422
        assert await server.post("/resume") == 200  # nothing is held

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == []
    assert "/update_weights" not in [p for p, _, _ in server.routes.seen]
    assert "refused before reaching the workers" in server.answer("/update_weights")


def test_a_body_without_update_info_is_refused():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        assert await server.post("/update_weights", {"names": []}) == 422

    server = Server(RecordingEngine())
    run(go(server))
    assert "update_info field" in server.answer("/update_weights")


def test_one_message_per_worker_of_one_kind_is_held_like_one_message():
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        assert await server.update([WEIGHTS, WEIGHTS]) == 200
        assert server.engine.calls == [("pause", "keep")]
        assert await server.update([WEIGHTS]) == 422  # one short of two workers
        await server.post("/finish_weight_update")

    server = Server(RecordingEngine(workers=2))
    run(go(server))
    assert server.engine.calls == HELD_THEN_RELEASED


@pytest.mark.parametrize(
    "method", ["update_weights", "start_weight_update", "finish_weight_update"]
)
@pytest.mark.parametrize("staging", ["off", "host"])
def test_collective_rpc_cannot_reach_the_weight_update_methods(method, staging):
    body = {"method": method, "kwargs": {"update_info": [WEIGHTS, {"abort": "x"}]}}

    async def go(server: Server) -> None:
        assert await server.post("/collective_rpc", body) == 403
        message = server.answer("/collective_rpc")
        assert method in message and "/update_weights" in message
        assert await server.post("/collective_rpc", {"method": "other"}) == 200

    server = Server(RecordingEngine(staging=staging))
    run(go(server))
    assert [p for p, _, _ in server.routes.seen] == ["/collective_rpc"]


def test_a_start_while_an_update_is_open_is_409_naming_it():
    header = verification_samples.header(publication_id="pub-0123456789").to_dict()

    async def go(server: Server) -> None:
        assert await server.post("/start_weight_update") == 200
        await server.update({**WEIGHTS, "publication": header})
        assert await server.post("/start_weight_update") == 409
        message = server.answer("/start_weight_update")
        assert "already active" in message and "pub-0123456789" in message
        # The takeover: abort, finish, start.
        await server.update({"abort": "abandoned: trainer B took over"})
        await server.post("/finish_weight_update")
        assert await server.post("/start_weight_update") == 200

    server = Server(RecordingEngine())
    run(go(server))
    assert [p for p, _, _ in server.routes.seen].count("/start_weight_update") == 2


def test_an_abort_of_accepted_weights_fences_the_label_and_late_messages_name_it():
    """Anyone's abort ends the update: the label names it before generation
    resumes, and the abandoned publication's next message is refused with
    the cause."""
    header = verification_samples.header(publication_id="pub-0123456789").to_dict()

    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update({**WEIGHTS, "publication": header})
        await server.update({"abort": "abandoned: a LoRA push"})
        await server.post("/finish_weight_update")
        assert server.engine.paused is False
        assert await server.update({**WEIGHTS, "publication": header}) == 409
        assert "abandoned: a LoRA push" in server.answer("/update_weights")
        await server.post("/start_weight_update")
        assert await server.update({**WEIGHTS, "publication": header}) == 409

    server = Server(RecordingEngine())
    run(go(server))
    kind, version = server.engine.calls[1]
    assert kind == "version"
    assert version.startswith("fenced:pub-0123456789: aborted: abandoned: a LoRA")
    assert server.engine.calls[2:] == HELD_THEN_RELEASED[1:]


def test_weights_with_no_update_open_are_refused_naming_how_the_last_one_ended():
    async def go(server: Server) -> None:
        assert await server.update(WEIGHTS) == 409
        assert "Call start_weight_update first" in server.answer("/update_weights")
        await server.post("/start_weight_update")
        await server.update({"abort": "the trainer gave up"})
        await server.post("/finish_weight_update")
        assert await server.update(WEIGHTS) == 409
        message = server.answer("/update_weights")
        assert "was aborted (the trainer gave up)" in message
        assert await server.update({"abort": "again"}) == 200  # always passes

    server = Server(RecordingEngine())
    run(go(server))
    assert server.engine.calls == []


@pytest.mark.parametrize("staging", ["off", "host"])
def test_the_finish_of_an_aborted_update_sets_no_version_label(staging):
    async def go(server: Server) -> None:
        await server.post("/start_weight_update")
        await server.update(WEIGHTS)
        await server.update({"abort": "the trainer gave up"})
        finish = {"weight_version": "v2"}
        assert await server.post("/finish_weight_update", finish) == 409
        assert "the trainer gave up" in server.answer("/finish_weight_update")
        assert await server.post("/finish_weight_update") == 200
        assert server.engine.paused is False

    server = Server(RecordingEngine(staging=staging))
    run(go(server))
    finishes = [b for p, b, _ in server.routes.seen if p == "/finish_weight_update"]
    assert finishes == [b""]
