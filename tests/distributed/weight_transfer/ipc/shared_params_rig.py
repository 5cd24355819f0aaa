# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers of the shared-parameter tests: a trainer over a model whose
parameters live in shared memory, the worker engine's kept segments, clients
that record or capture the messages, and a pinned rig that sends a
layout by id (no vLLM engine)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SharedParameters,
)
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from .worker_rig import (
    EngineClient,
    TinyNet,
    make_engine,
    planned_ready,
    state,
)


def trainer_for(engine, model, **kwargs):
    kwargs.setdefault("packed_buffer_size_bytes", 64)
    return IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, **kwargs),
        client=EngineClient(engine),
        source=ModuleSource(model),
    )


def kept_segments(engine) -> list:
    importer = engine._importer
    return [] if importer is None else importer.kept()


class RecordingClient(EngineClient):
    """Also records the names each update message carries."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.messages: list[list[str]] = []

    def update_weights(self, update_info):
        if "names" in update_info:
            self.messages.append(list(update_info["names"]))
        super().update_weights(update_info)


class ShortFormClient(RecordingClient):
    """Also records each message's form: "full" (names, with the layout id
    when it carries one) or "short" (only a layout id and the handles, or
    the id alone over several segments); ``handles`` records whether each
    message carried handles."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.forms: list[tuple[str, str | None]] = []
        self.handles: list[bool] = []

    def update_weights(self, update_info):
        # (Not the receipts' prepare message; over several segments the
        # short form carries no handles.)
        if "ipc_handles" in update_info or "layout" in update_info:
            form = "full" if "names" in update_info else "short"
            self.forms.append((form, update_info.get("layout")))
            self.handles.append("ipc_handles" in update_info)
        super().update_weights(update_info)


# ``max_segment_bytes`` for TinyNet's parameters (128, 64, 128 and 64 bytes
# as placed): all in one segment, or in two of 192 bytes.
ONE_SEGMENT = 1 << 20
TWO_SEGMENTS = 192


@contextlib.contextmanager
def pinned_rig(
    max_segment_bytes: int = ONE_SEGMENT, staging: str | None = None, **kwargs
):
    """A planned worker engine over ``planned_ready(0)`` (``target``), a
    trainer ``model`` placed in shared memory (``shared``, closed at exit;
    ``max_segment_bytes`` goes to ``place``) and its ``trainer`` sending
    with ``shared.source(model)`` through a ``ShortFormClient``
    (``client``); ``kwargs`` go to the trainer's init. ``staging``: the
    engine stages updates there (``WeightTransferConfig.staging``)."""
    target = planned_ready(0)
    config: dict[str, Any] = {}
    if staging is not None:
        config = {"staging": staging, "update_timeout_s": 60.0}
    engine = make_engine(target, landing="planned", **config)
    model = TinyNet(1)
    shared = SharedParameters.place(model, max_segment_bytes=max_segment_bytes)
    client = ShortFormClient(engine)
    kwargs.setdefault("packed_buffer_size_bytes", 64)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, **kwargs),
        client=client,
        source=shared.source(model),
    )
    try:
        yield SimpleNamespace(
            target=target,
            engine=engine,
            model=model,
            shared=shared,
            trainer=trainer,
            client=client,
        )
    finally:
        shared.close()


def step(model, scale: float = 3.0) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale).sub_(1)


def assert_served(target, model) -> None:
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
