# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc worker engine's test rig: small torch models ready for a layerwise
reload or a planned landing, the direct engine and client, and a push of one
update through them (no vLLM engine). The ipc, lora and worker tests share it."""

from __future__ import annotations

import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.landing.layerwise import LayerwiseReloadSession
from vllm.distributed.weight_transfer.testing.direct_engine import (
    DirectEngineClient,
    direct_ipc_engine,
    load_through_weight_loaders,
)


class TinyNet(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor)
        return set(params)


def reload_ready(seed: int) -> TinyNet:
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    net = TinyNet(seed)
    record_metadata_for_reloading(net)
    return net


# The worker engine over a plain module, and the client that drives it.
make_engine = direct_ipc_engine
EngineClient = DirectEngineClient


def state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def push(engine: IPCWeightTransferEngine, model: torch.nn.Module, **kwargs) -> None:
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64, **kwargs),
        client=EngineClient(engine),
        source=ModuleSource(model),
    ).send_weights()


class LoaderNet(TinyNet):
    """``TinyNet`` whose loading goes through weight loaders, as a vLLM
    model's does, so the planner can record it."""

    def load_weights(self, weights):
        return load_through_weight_loaders(self, weights)


def planned_ready(seed: int) -> LoaderNet:
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    net = LoaderNet(seed)
    record_metadata_for_reloading(net)
    return net


class NoReload:
    """Makes any use of the layerwise reload fail the test."""

    def __enter__(self):
        self.original = LayerwiseReloadSession.begin_landing

        def begin_landing(session):
            raise AssertionError("the layerwise reload was used")

        LayerwiseReloadSession.begin_landing = begin_landing  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        LayerwiseReloadSession.begin_landing = self.original  # type: ignore[method-assign]
