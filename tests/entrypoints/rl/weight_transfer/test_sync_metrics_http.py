# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sync metrics reach a real ``vllm serve``'s ``/metrics`` with no extra flag.

The server is a plain ``vllm serve --weight-transfer-config '{"backend":"ipc"}'``
(dev mode on for the RL routes). A real ``ipc`` sync from this process is
counted as committed with the bytes its publication announced; an update whose
publication header the worker rejects is counted as a failure of the update
phase, and the server keeps serving. Upstream's weight-operation metrics stay.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.testing import (
    completions_greedy,
    load_hf_model,
)
from vllm.distributed.weight_transfer.testing.server import metric_value, serve
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    PublicationHeader,
    attach_publication,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with serve(tiny_model_dir, weight_transfer_backend="ipc") as s:
        yield s


def test_sync_metrics_appear_on_metrics(server, tiny_model_dir):
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    model = load_hf_model(tiny_model_dir, "float32")
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(model),
    )
    trainer.send_weights()

    header = PublicationHeader.create(
        backend="ipc",
        model_version=1,
        manifest=Manifest.from_params([ParamMeta("w", torch.float32, (4,))]),
        trainer_devices=["cpu:test:0"],
    )
    client.start_weight_update()
    rejected = requests.post(
        f"{server.base_url}/update_weights",
        json={"update_info": attach_publication({"names": []}, header)},
        timeout=120,
    )
    assert not rejected.ok  # the worker closes the update on any failure

    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    assert metric_value(text, "vllm:weight_transfer_syncs_total", backend="ipc") == 1
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        metric_value(text, "vllm:weight_transfer_bytes_total", backend="ipc") == nbytes
    )
    assert (
        metric_value(text, "vllm:weight_transfer_sync_seconds_count", backend="ipc")
        == 1
    )
    assert (
        metric_value(
            text, "vllm:weight_transfer_failures_total", backend="ipc", phase="update"
        )
        == 1
    )
    for operation in ("start", "update", "finish"):
        count = metric_value(
            text,
            "vllm:rl_weight_update_operation_duration_seconds_count",
            operation=operation,
        )
        assert count >= 1
    assert "vllm:rl_weight_update_operations_in_flight" in text
    assert completions_greedy(server.base_url, server.model).tokens
