# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sync log lines and the API-server sync metrics derived from the RL routes."""

import time

import pytest
import torch
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.fencing import fenced_version
from vllm.distributed.weight_transfer.publication import (
    Manifest,
    PublicationHeader,
    attach_publication,
)
from vllm.distributed.weight_transfer.sync_metrics import (
    RouteSyncObserver,
    SyncRecord,
    WeightSyncMetricsMiddleware,
    WeightTransferMetrics,
)

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
