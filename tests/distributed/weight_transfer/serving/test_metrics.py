# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sync log lines and the API-server sync metrics derived from the RL routes."""

import time
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.serving import metrics as sync_metrics
from vllm.distributed.weight_transfer.serving.metrics import (
    ROUTE_OPERATIONS,
    RouteSyncObserver,
    WeightSyncMetricsMiddleware,
    WeightTransferMetrics,
)
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    PublicationHeader,
    attach_publication,
    fenced_version,
)
from vllm.distributed.weight_transfer.verification.record import SyncRecord
from vllm.entrypoints.rl.factories import register_rl_api_routers

MANIFEST = Manifest.from_params([ParamMeta("w", torch.float32, (256,))])  # 1024 B


def header(backend: str = "ipc") -> PublicationHeader:
    return PublicationHeader.create(
        backend=backend, model_version=1, manifest=MANIFEST, trainer_devices=["cpu:0"]
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def observer(registry):
    metrics = WeightTransferMetrics(registry)
    return RouteSyncObserver(metrics=lambda: metrics, clock=Clock())


def value(registry, name, **labels) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def sync(observer, *, update_ok=True, finish_ok=True, info=None, backend="ipc"):
    observer._clock.now = 100.0
    observer.observe_route("start", started=100.0, ok=True, backend=backend)
    observer.observe_route(
        "update", started=100.5, ok=update_ok, backend=backend, update_info=info
    )
    observer._clock.now = 102.0
    observer.observe_route("finish", started=101.5, ok=finish_ok, backend=backend)


# -- SyncRecord ---------------------------------------------------------------


def test_record_renders_one_line_with_bytes_rate_and_phases():
    h = header()
    rec = SyncRecord(backend="ipc", side="trainer")
    rec.bind(h)
    rec.nbytes = 2_000_000_000
    with rec.phase("transfer"):
        pass
    rec.finish()
    rec.seconds = 2.0
    line = rec.log_line()
    assert line.startswith(
        f"weight sync [ipc trainer] publication {h.publication_id[:12]} v1: "
    )
    assert "2.000 GB in 2.000 s (1.00 GB/s); transfer 0.000 s" in line
    assert "\n" not in line
    rec.read_bytes = 50_000_000  # a delta sync read less than it landed
    assert "(1.00 GB/s, 0.050 GB read as deltas and whole chunks)" in rec.log_line()


def test_record_names_the_failed_phase():
    rec = SyncRecord(backend="sharded_rdt", side="worker 3")
    with pytest.raises(RuntimeError), rec.phase("pull"):
        raise RuntimeError("nixl read failed")
    rec.finish(ok=False, error=RuntimeError("nixl read\nfailed"))
    assert "FAILED after" in rec.log_line()
    assert "in phase pull" in rec.log_line()
    assert "nixl read failed" in rec.log_line()


def test_phases_accumulate():
    rec = SyncRecord(backend="ipc", side="trainer")
    for _ in range(3):
        with rec.phase("copy"):
            time.sleep(0.001)
    assert rec.phases["copy"] >= 0.003


# -- RouteSyncObserver ---------------------------------------------------------


def test_committed_sync_counts_bytes_and_duration(registry, observer):
    sync(observer, info=attach_publication({"names": []}, header()))
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="ipc") == 1024
    assert value(registry, "vllm:weight_transfer_sync_seconds_sum", backend="ipc") == 2


def test_per_worker_list_payload_is_understood(registry, observer):
    info = [attach_publication({}, header("sharded_rdt"))] * 2
    sync(observer, info=info, backend="unknown")
    assert (
        value(registry, "vllm:weight_transfer_bytes_total", backend="sharded_rdt")
        == 1024
    )


def test_sync_without_header_counts_time_but_no_bytes(registry, observer):
    sync(observer, info={"names": []}, backend="nccl")
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="nccl") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="nccl") == 0


@pytest.mark.parametrize(
    "kwargs, phase",
    [
        ({"update_ok": False}, "update"),
        ({"finish_ok": False}, "finish"),
        ({"info": {"abort": "trainer rank 1 died"}}, "abort"),
    ],
)
def test_failures_are_counted_once_by_phase(registry, observer, kwargs, phase):
    sync(observer, **kwargs)
    labels = {"backend": "ipc", "phase": phase}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 0


def test_fenced_version_after_commit_counts_a_verify_failure(registry, observer):
    sync(observer, info=attach_publication({}, header()))
    observer.observe_route(
        "update_weight_version",
        started=0,
        ok=True,
        backend="ipc",
        new_version=fenced_version("abcdef0123", "worker 1 missing"),
    )
    labels = {"backend": "ipc", "phase": "verify"}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1


def test_an_abort_after_the_prepare_counts_a_verify_failure(registry, observer):
    observer.observe_route("start", started=100.0, ok=True, backend="ipc")
    for info in (
        attach_publication({"names": []}, header()),
        {"prepare": "abcdef0123"},  # the workers wrote their receipts
        {"abort": "receipt of worker 1 missing"},  # the trainer rejected them
    ):
        observer.observe_route(
            "update", started=100.5, ok=True, backend="ipc", update_info=info
        )
    observer.observe_route("finish", started=101.5, ok=True, backend="ipc")
    labels = {"backend": "ipc", "phase": "verify"}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 0


def test_failed_start_is_counted(registry, observer):
    observer.observe_route("start", started=0, ok=False, backend="ipc")
    labels = {"backend": "ipc", "phase": "start"}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1


# -- middleware ---------------------------------------------------------------


def test_middleware_observes_real_routes(registry):
    metrics = WeightTransferMetrics(registry)
    observer = RouteSyncObserver(metrics=lambda: metrics)
    app = FastAPI()
    app.add_middleware(WeightSyncMetricsMiddleware, observer=observer)
    fail = {"update": False}

    @app.post("/start_weight_update")
    async def start():
        return {"message": "ok"}

    @app.post("/update_weights")
    async def update(body: dict):
        if fail["update"]:
            raise HTTPException(status_code=500, detail="manifest mismatch")
        return {"message": "ok"}

    @app.post("/finish_weight_update")
    async def finish():
        return {"message": "ok"}

    client = TestClient(app)
    info = attach_publication({"names": []}, header())
    for ok in (True, False):
        fail["update"] = not ok
        client.post("/start_weight_update")
        client.post("/update_weights", json={"update_info": info})
        client.post("/finish_weight_update")
    # unknown backend: the app has no engine client to read the config from
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="ipc") == 1024
    labels = {"backend": "ipc", "phase": "update"}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1


# -- default wiring: upstream's RL router as vllm serve mounts it --------------


class FakeEngine:
    """The engine-client calls the weight routes make, with a configured backend."""

    def __init__(self, backend: str) -> None:
        # Staged: the update guard (its own tests) only holds the commit.
        self.vllm_config = SimpleNamespace(
            weight_transfer_config=SimpleNamespace(backend=backend, staging="host")
        )
        self.paused = False
        self.fail_update = False
        self.version: str | None = None

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, request) -> None:
        if self.fail_update:
            raise ValueError("manifest mismatch")

    async def finish_weight_update(self, weight_version=None) -> None:
        if weight_version is not None:
            self.version = weight_version

    async def update_weight_version(self, new_version) -> None:
        self.version = new_version

    async def get_weight_version(self) -> str | None:
        return self.version

    async def is_paused(self) -> bool:
        return self.paused

    async def pause_generation(self, mode: str = "keep") -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True


@pytest.fixture
def rl_app(registry, monkeypatch):
    """A FastAPI app with the RL routes registered the way ``vllm serve`` does."""
    metrics = WeightTransferMetrics(registry)
    monkeypatch.setattr(
        sync_metrics._observer, "value", RouteSyncObserver(metrics=lambda: metrics)
    )
    app = FastAPI()
    app.state.engine_client = FakeEngine("ipc")
    register_rl_api_routers(app)
    return app


def push(app: FastAPI, ok: bool = True, info=None, **client_kwargs) -> None:
    """One start -> update -> finish through the app; the update fails if not ok."""
    app.state.engine_client.fail_update = not ok
    client = TestClient(app, raise_server_exceptions=False, **client_kwargs)
    assert client.post("/start_weight_update").status_code == 200
    if info is None:
        info = attach_publication({"names": []}, header())
    updated = client.post("/update_weights", json={"update_info": info})
    assert updated.status_code == (200 if ok else 500), updated.text
    if ok:
        assert updated.json() == {"message": "Weights updated"}
    client.post("/finish_weight_update")


def test_rl_routes_record_sync_metrics_without_flags(registry, rl_app):
    push(rl_app, ok=True)
    push(rl_app, ok=False)
    TestClient(rl_app).post("/update_weight_version", json={"new_version": "7"})
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="ipc") == 1024
    labels = {"backend": "ipc", "phase": "update"}
    assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 1


def test_without_a_header_the_configured_backend_is_the_label(registry, rl_app):
    rl_app.state.engine_client = FakeEngine("nccl")
    push(rl_app, info={"names": []})
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="nccl") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="nccl") == 0


def test_the_observed_paths_are_upstream_rl_routes(rl_app):
    posts = {
        route.path
        for route in rl_app.routes
        if "POST" in getattr(route, "methods", set())
    }
    assert set(ROUTE_OPERATIONS) <= posts


def test_middleware_named_again_observes_each_request_once(registry, rl_app):
    # What ``vllm serve --middleware ...WeightSyncMetricsMiddleware`` adds.
    rl_app.add_middleware(WeightSyncMetricsMiddleware)
    push(rl_app)
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="ipc") == 1024
    # a second observation of the start would abandon the first as unfinished
    for phase in ("start", "update", "finish"):
        labels = {"backend": "ipc", "phase": phase}
        assert value(registry, "vllm:weight_transfer_failures_total", **labels) == 0


def test_routes_below_a_root_path_are_observed(registry, rl_app):
    rl_app.root_path = "/rl"
    push(rl_app, base_url="http://testserver/rl", root_path="/rl")
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1


def test_an_adapter_push_publication_is_not_a_base_weight_publication(
    registry, observer
):
    """A LoRA adapter push's publication orders the adapter's versions only:
    the routes count the sync, but no bytes of a base-weight publication."""
    info = attach_publication({"names": [], "adapter": {"name": "policy"}}, header())
    sync(observer, info=info)
    assert value(registry, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    assert value(registry, "vllm:weight_transfer_bytes_total", backend="ipc") == 0


# -- GET /weight_update_status ---------------------------------------------------


def test_status_shows_the_serving_version_and_the_staged_publication(rl_app):
    client = TestClient(rl_app)
    idle = client.get("/weight_update_status").json()
    assert idle == {
        "weight_version": None,
        "staging": "host",
        "open": None,
        "committed": None,
        "adapters": {},
    }
    pub = header()
    assert client.post("/start_weight_update").status_code == 200
    info = attach_publication({"names": []}, pub)
    assert client.post("/update_weights", json={"update_info": info}).is_success
    staging = client.get("/weight_update_status").json()
    # the engine still serves the version before; the staged one is named
    assert staging["weight_version"] is None and staging["committed"] is None
    opened = staging["open"]
    assert opened["publication_id"] == pub.publication_id
    assert opened["model_version"] == 1 and opened["payload_bytes"] == 1024
    assert opened["backend"] == "ipc" and opened["seconds_open"] >= 0
    assert not opened["prepared"] and not opened["failed"]
    assert opened["adapter"] is None
    prepare = {"prepare": pub.publication_id}
    assert client.post("/update_weights", json={"update_info": prepare}).is_success
    # every worker attested what it staged: the staged version is verified
    assert client.get("/weight_update_status").json()["open"]["prepared"]
    assert client.post(
        "/finish_weight_update", json={"weight_version": "step-1"}
    ).is_success
    done = client.get("/weight_update_status").json()
    assert done["weight_version"] == "step-1" and done["open"] is None
    assert done["committed"] == {
        "publication_id": pub.publication_id,
        "model_version": 1,
        "payload_bytes": 1024,
    }


def test_status_names_a_failed_update_and_keeps_the_last_commit(rl_app):
    push(rl_app, ok=True)
    committed = TestClient(rl_app).get("/weight_update_status").json()["committed"]
    client = TestClient(rl_app, raise_server_exceptions=False)
    rl_app.state.engine_client.fail_update = True
    client.post("/start_weight_update")
    info = attach_publication({"names": []}, header())
    assert client.post("/update_weights", json={"update_info": info}).status_code == 500
    status = client.get("/weight_update_status").json()
    assert status["open"]["failed"] and status["committed"] == committed


def test_status_names_each_adapter_push_apart_from_the_base_weights(rl_app):
    push(rl_app, ok=True)
    client = TestClient(rl_app)
    committed = client.get("/weight_update_status").json()["committed"]
    assert committed is not None
    adapter = {"name": "policy", "lora_id": 7, "version": "step-3"}
    config = {"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}
    message = {"adapter": {**adapter, "config": config}}
    push(rl_app, ok=True, info=attach_publication(message, header()))
    status = client.get("/weight_update_status").json()
    # the base weights' last commit stays; the adapter has its own entry
    assert status["committed"] == committed
    assert status["adapters"] == {"policy": adapter}


# -- the body's kind (``common.messages``) --------------------------------------


def test_a_body_mixing_kinds_is_neither_an_abort_nor_a_publication(observer):
    """The observer reads kinds by the workers' rule: a list whose elements
    differ is refused before the workers, so it names nothing and aborts
    nothing."""
    decoy = [attach_publication({"names": []}, header()), {"abort": "decoy"}]
    observer.observe_route("start", started=100.0, ok=True, backend="ipc")
    observer.observe_route(
        "update", started=100.5, ok=False, backend="ipc", update_info=decoy
    )
    opened = observer.update_status()["open"]
    assert opened["publication_id"] is None and opened["failed"]
    labels = {"backend": "ipc", "phase": "update"}
    failures = observer._metrics().failures
    assert failures.labels(**labels)._value.get() == 1
    assert failures.labels(backend="ipc", phase="abort")._value.get() == 0


def test_a_refused_start_leaves_the_open_update_open(observer):
    h = header()
    observer.observe_route("start", started=100.0, ok=True, backend="ipc")
    observer.observe_route(
        "update",
        started=100.5,
        ok=True,
        backend="ipc",
        update_info=attach_publication({"names": []}, h),
    )
    observer.observe_route("start", started=101.0, ok=False, backend="ipc")
    opened = observer.update_status()["open"]
    assert opened is not None and opened["publication_id"] == h.publication_id
    failures = observer._metrics().failures
    assert failures.labels(backend="ipc", phase="start")._value.get() == 1
    assert failures.labels(backend="ipc", phase="finish")._value.get() == 0
