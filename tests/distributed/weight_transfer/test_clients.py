# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sync clients: the HTTP client against a local stdlib server (routes,
plain-JSON bodies, errors carrying the server's message, timeouts that are both
``TimeoutError`` and ``requests``' ``ReadTimeout``), the Ray client against a
stand-in ``ray`` module (fan-out, upstream's two-call finish, optional timeouts),
the offline adapter."""

import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from vllm.distributed.weight_transfer.base import (
    VLLMWeightSyncClient,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    OfflineLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
)
from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.serving.update_guard import (
    COMMIT_HOLD_HEADER,
    COMMIT_HOLD_VALUE,
)
from vllm.distributed.weight_transfer.trainer.sync import commit_update


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.server.requests.append((self.path, body))  # type: ignore[attr-defined]
        info = body.get("update_info") if isinstance(body, dict) else None
        if isinstance(info, dict) and info.get("names") == ["bad"]:
            self._reply(500, {"error": "update_info.names: 'bad' is not a weight"})
            return
        if self.path == "/start_weight_update" and self.server.slow:  # type: ignore[attr-defined]
            time.sleep(1.0)
        headers = {}
        if self.path == "/start_weight_update" and self.server.holds:  # type: ignore[attr-defined]
            headers[COMMIT_HOLD_HEADER] = COMMIT_HOLD_VALUE
        self._reply(200, {"message": "ok"}, headers)

    def do_GET(self):  # noqa: N802
        self.server.requests.append((self.path, None))  # type: ignore[attr-defined]
        self._reply(200, {"world_size": 2, "is_paused": False})

    def _reply(self, status, payload, headers=None):
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.requests = []  # type: ignore[attr-defined]
    srv.slow = False  # type: ignore[attr-defined]
    srv.holds = False  # type: ignore[attr-defined]
    srv.handle_error = lambda *args: None  # type: ignore[method-assign]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def update_info():
    return IPCWeightTransferUpdateInfo.from_dict(
        {
            "names": ["w"],
            "dtype_names": ["float32"],
            "shapes": [[2]],
            "tensor_sizes": [8],
            "ipc_handles": {
                "cpu:h:0": {"kind": "shm", "name": "vllm-wt-1", "nbytes": 8}
            },
        }
    )


def test_http_client_posts_each_route_with_plain_json(server):
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}/")
    assert isinstance(client, VLLMWeightSyncClient)
    client.init_weight_transfer_engine({"packed": True})
    client.start_weight_update()
    client.update_weights(update_info())
    client.update_weights([update_info().to_dict(), update_info().to_dict()])
    client.finish_weight_update()
    client.finish_weight_update(weight_version="step-3")
    client.shutdown_weight_transfer_engine()
    paths = [p for p, _ in server.requests]
    assert paths == [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/update_weights",
        "/finish_weight_update",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
    ]
    bodies = [b for _, b in server.requests]
    assert bodies[0] == {"init_info": {"packed": True}}
    assert bodies[1] is None
    assert bodies[2] == {"update_info": update_info().to_dict()}
    assert "ipc_handles_pickled" not in json.dumps(bodies)
    assert len(bodies[3]["update_info"]) == 2
    assert bodies[4] is None
    assert bodies[5] == {"weight_version": "step-3"}


def test_http_error_carries_the_server_message(server):
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}")
    bad = {"names": ["bad"], "dtype_names": [], "shapes": []}
    with pytest.raises(requests.HTTPError, match="HTTP 500.*'bad' is not a weight"):
        client.update_weights(bad)


def test_http_client_refuses_non_json_payloads(server):
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}")
    with pytest.raises(TypeError, match="must be plain JSON"):
        client.update_weights({"ipc_handles": {"gpu": {"kind": "shm", "x": object()}}})
    assert server.requests == []


def test_http_client_times_out(server):
    server.slow = True
    client = HTTPVLLMWeightSyncClient(
        f"http://127.0.0.1:{server.server_port}", timeout=0.2
    )
    with pytest.raises(TimeoutError, match="no answer within 0.2s") as caught:
        client.start_weight_update()
    # Callers written against upstream's client catch requests' exceptions.
    assert isinstance(caught.value, requests.exceptions.ReadTimeout)
    assert isinstance(caught.value, requests.RequestException)


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs):
        self.actor.calls.append((self.name, args, kwargs))
        return ("ref", self.actor.delay)


class _Actor:
    def __init__(self, delay=0.0):
        self.calls = []
        self.delay = delay

    def __getattr__(self, name):
        return _Method(self, name)


@pytest.fixture
def fake_ray(monkeypatch):
    ray = types.ModuleType("ray")

    class GetTimeoutError(TimeoutError):  # as Ray's: a RayError and a TimeoutError
        pass

    errors = types.SimpleNamespace(GetTimeoutError=GetTimeoutError)
    ray.exceptions = errors  # type: ignore[attr-defined]

    def get(refs, timeout=None):
        ray.timeouts.append(timeout)
        if timeout is not None and any(d > timeout for _, d in refs):
            raise GetTimeoutError("timed out")
        return [None] * len(refs)

    ray.timeouts = []  # type: ignore[attr-defined]

    ray.get = get  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


def test_ray_client_fans_out_to_every_actor(fake_ray):
    actors = [_Actor(), _Actor()]
    client = RayVLLMWeightSyncClient(actors)  # type: ignore[arg-type]
    client.init_weight_transfer_engine({"packed": True})
    client.start_weight_update()
    client.update_weights(update_info())
    client.finish_weight_update(weight_version="v2")
    for actor in actors:
        names = [c[0] for c in actor.calls]
        assert names == [
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "update_weight_version",
        ]
        init_req = actor.calls[0][1][0]
        assert isinstance(init_req, WeightTransferInitRequest)
        assert init_req.init_info == {"packed": True}
        upd_req = actor.calls[2][1][0]
        assert isinstance(upd_req, WeightTransferUpdateRequest)
        assert upd_req.update_info == update_info().to_dict()
        # Upstream's two calls: actors whose finish takes no version work too.
        assert actor.calls[3][1:] == ((), {})
        assert actor.calls[4][1:] == (("v2",), {})


def test_ray_client_finish_without_a_version_is_one_call(fake_ray):
    actor = _Actor()
    RayVLLMWeightSyncClient(actor).finish_weight_update()  # type: ignore[arg-type]
    assert actor.calls == [("finish_weight_update", (), {})]


def test_ray_client_waits_without_limit_unless_given_a_timeout(fake_ray):
    RayVLLMWeightSyncClient(_Actor(delay=5.0)).start_weight_update()  # type: ignore[arg-type]
    assert fake_ray.timeouts == [None]
    client = RayVLLMWeightSyncClient(_Actor(delay=5.0), timeout=1.0)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="start_weight_update did not complete"):
        client.start_weight_update()


def test_ray_client_of_no_actors_does_nothing(fake_ray):
    client = RayVLLMWeightSyncClient([])
    client.start_weight_update()
    client.finish_weight_update("v1")
    assert client.get_world_size() == 0


def test_offline_client_wraps_requests_for_llm():
    class FakeLLM:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a, **k: self.calls.append((name, a, k))

    llm = FakeLLM()
    client = OfflineLLMWeightSyncClient(llm)
    client.init_weight_transfer_engine({"packed": False})
    client.update_weights(update_info())
    client.finish_weight_update("v")
    assert llm.calls[0] == (
        "init_weight_transfer_engine",
        ({"init_info": {"packed": False}},),
        {},
    )
    assert llm.calls[1][1][0] == {"update_info": update_info().to_dict()}
    assert llm.calls[2] == ("finish_weight_update", (), {"weight_version": "v"})


def test_http_client_sets_the_version_and_reads_the_world_size(server):
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}")
    client.update_weight_version("step-4")
    assert client.get_world_size() == 2
    assert server.requests == [
        ("/update_weight_version", {"new_version": "step-4"}),
        ("/get_world_size?include_dp=true", None),
    ]


def test_ray_client_sets_the_version_on_every_actor(fake_ray):
    actors = [_Actor(), _Actor()]
    client = RayVLLMWeightSyncClient(actors)  # type: ignore[arg-type]
    client.update_weight_version("v5")
    for actor in actors:
        assert actor.calls == [("update_weight_version", ("v5",), {})]


def test_offline_client_sets_the_version_and_reads_the_world_size():
    class FakeLLM:
        def __init__(self):
            self.calls = []

        def update_weight_version(self, v):
            self.calls.append(("update_weight_version", v))

        def get_world_size(self, include_dp=True):
            self.calls.append(("get_world_size", include_dp))
            return 3

    llm = FakeLLM()
    client = OfflineLLMWeightSyncClient(llm)
    client.update_weight_version("v6")
    assert client.get_world_size() == 3
    assert llm.calls == [("update_weight_version", "v6"), ("get_world_size", True)]


# -- the commit (full_resync.commit_update) -----------------------------------


class _CommitClient:
    """Records the calls of a commit; ``paused`` is whether someone else
    holds generation; ``fail_finish`` makes the commit raise."""

    def __init__(self, paused=False, fail_finish=False):
        self.calls = []
        self.paused = paused
        self.fail_finish = fail_finish

    def is_paused(self):
        self.calls.append("is_paused")
        return self.paused

    def pause_generation(self, mode="keep"):
        self.calls.append(f"pause:{mode}")

    def resume_generation(self):
        self.calls.append("resume")

    def finish_weight_update(self, weight_version=None):
        self.calls.append(f"finish:{weight_version}")
        if self.fail_finish:
            raise RuntimeError("the commit failed")

    def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(f"reset:{reset_running_requests}")


def test_the_commit_holds_generation_for_the_finish_and_the_cache_reset():
    client = _CommitClient()
    commit_update(client, "v3")  # type: ignore[arg-type]
    assert client.calls == [
        "is_paused",
        "pause:keep",
        "finish:v3",
        "reset:True",
        "resume",
    ]


def test_the_commit_leaves_a_pause_it_did_not_take():
    client = _CommitClient(paused=True)
    commit_update(client, None)  # type: ignore[arg-type]
    assert client.calls == ["is_paused", "finish:None", "reset:True"]


def test_a_failed_commit_still_resumes_generation():
    client = _CommitClient(fail_finish=True)
    with pytest.raises(RuntimeError, match="the commit failed"):
        commit_update(client, "v4")  # type: ignore[arg-type]
    assert client.calls[-1] == "resume"


def test_a_client_with_upstreams_four_methods_only_gets_a_plain_finish():
    class Plain:
        def __init__(self):
            self.calls = []

        def finish_weight_update(self, weight_version=None):
            self.calls.append(("finish", weight_version))

    client = Plain()
    commit_update(client, "v5")  # type: ignore[arg-type]
    assert client.calls == [("finish", "v5")]


def test_ray_actors_commit_without_holding_generation(fake_ray):
    """A sync actor serves one call at a time: holding generation across
    several calls could deadlock with a generate call queued in between."""

    class Bare:  # an actor class with the sync methods only
        def finish_weight_update(self):
            pass

    # ``_Actor`` answers every method; a bare handle has only its own.
    actor = _Actor()
    client = RayVLLMWeightSyncClient(actor)  # type: ignore[arg-type]
    commit_update(client, None)
    assert [c[0] for c in actor.calls] == [
        "finish_weight_update",
        "reset_prefix_cache",
    ]
    bare = RayVLLMWeightSyncClient(Bare())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="have no reset_prefix_cache"):
        bare.reset_prefix_cache(reset_running_requests=True)


def test_a_failed_resume_is_tried_once_more():
    class FlakyResume(_CommitClient):
        def resume_generation(self):
            super().resume_generation()
            if self.calls.count("resume") == 1:
                raise ConnectionError("the answer was lost")

    client = FlakyResume()
    commit_update(client, "v6")  # type: ignore[arg-type]
    assert client.calls[-2:] == ["resume", "resume"]


@pytest.mark.parametrize("holds", [False, True], ids=["upstream-server", "fork-server"])
def test_a_server_that_holds_the_commit_gets_the_finish_alone(server, holds):
    """The fork's server says, on start, that it holds generation for the
    commit: the commit is then one finish request, with no pause, is_paused,
    reset or resume of the trainer's own."""
    server.holds = holds
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}")
    client.start_weight_update()
    assert client.server_holds_commit is holds
    commit_update(client, "v7")
    paths = [p.split("?")[0] for p, _ in server.requests[1:]]
    if holds:
        assert paths == ["/finish_weight_update"]
    else:
        assert paths == [
            "/is_paused",
            "/pause",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
