# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One-line HTTP calls on a ``vllm serve`` (a ``server.ServerProcess``) that
the weight-sync tests make between and during syncs: ``post`` a body to a
route, read the served ``weight_info``, and read the sync counters
``/metrics`` exposes (``failures`` per phase, ``committed_syncs``); and
``assert_serves``: the server serves a model's weights exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import requests

from vllm.distributed.weight_transfer.testing.fresh_load import assert_serves_weights
from vllm.distributed.weight_transfer.testing.server import metric_value

if TYPE_CHECKING:
    import torch

    from vllm.distributed.weight_transfer.testing.server import ServerProcess

# The phases ``vllm:weight_transfer_failures_total`` counts failures under.
FAILURE_PHASES = ("start", "update", "finish", "abort", "verify")


def post(
    server: ServerProcess, route: str, body: dict | None = None
) -> requests.Response:
    return requests.post(f"{server.base_url}/{route}", json=body, timeout=120)


def weight_info(server: ServerProcess) -> dict[str, Any]:
    return requests.get(f"{server.base_url}/weight_info", timeout=30).json()


def failures(server: ServerProcess, backend: str = "ipc") -> dict[str, float]:
    """The failed syncs ``server`` counted for ``backend``, per phase."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return {
        phase: metric_value(
            text, "vllm:weight_transfer_failures_total", backend=backend, phase=phase
        )
        for phase in FAILURE_PHASES
    }


def committed_syncs(server: ServerProcess, backend: str = "ipc") -> float:
    """The syncs ``server`` committed for ``backend``."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return metric_value(text, "vllm:weight_transfer_syncs_total", backend=backend)


def assert_serves(server: ServerProcess, model: torch.nn.Module) -> None:
    """The server serves exactly what a fresh load of ``model`` serves, and
    what a HF forward of it gives."""
    assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
