# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An ``ipc`` worker engine driven in this process, without a vLLM engine:
for unit tests and benchmarks of the worker's lifecycle on plain modules.

``direct_ipc_engine(model)`` builds the fork's ``IPCWeightTransferEngine``
over ``model`` on the CPU; ``DirectEngineClient`` is the client a trainer
engine calls, forwarding each call to that worker engine as vLLM's RPC
handlers would; ``load_through_weight_loaders`` is the ``load_weights`` a
plain module needs so that the planner can record it (each tensor through
its parameter's ``weight_loader``, as vLLM models load)."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine


def load_through_weight_loaders(
    module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """Load ``weights`` into ``module``'s parameters of the same names, each
    through the parameter's ``weight_loader`` (vLLM's default loader when it
    has none); returns every parameter name, as vLLM's ``load_weights``."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(module.named_parameters())
    for name, tensor in weights:
        param = params[name]
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    return set(params)


def direct_ipc_engine(
    model: torch.nn.Module,
    checkpoint: str | None = None,
    landing: str = "reload",
    **config: Any,
) -> IPCWeightTransferEngine:
    """The ``ipc`` worker engine over ``model`` on the CPU, configured with
    ``landing`` and ``config`` (``WeightTransferConfig`` fields);
    ``checkpoint``, a local checkpoint folder the served model came from."""
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(dtype=None, model=checkpoint),
    )
    return IPCWeightTransferEngine(
        SimpleNamespace(backend="ipc", landing=landing, **config),
        vllm_config,
        torch.device("cpu"),
        model,
    )


class DirectEngineClient:
    """The client a trainer engine calls, forwarding to ``engine`` in this
    process; the weight versions the trainer sets are kept in ``versions``."""

    def __init__(self, engine: IPCWeightTransferEngine) -> None:
        self.engine = engine
        self.versions: list[str] = []

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: Any = None) -> None:
        self.engine.finish_weight_update()

    def update_weight_version(self, new_version: str) -> None:
        self.versions.append(new_version)

    def get_world_size(self) -> int:
        return 1
