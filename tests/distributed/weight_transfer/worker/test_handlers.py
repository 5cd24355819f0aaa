# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Message kinds a feature registers with the worker lifecycle."""

import ast
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer.common.messages import MessageKind
from vllm.distributed.weight_transfer.lora.wire import (
    ADAPTER_KEY,
    AdapterConfig,
    AdapterHeader,
)
from vllm.distributed.weight_transfer.lora.worker_handler import AdapterMessages
from vllm.distributed.weight_transfer.verification.checksum import payload_checksum
from vllm.distributed.weight_transfer.worker import handlers, lifecycle
from vllm.distributed.weight_transfer.worker.handlers import ReadTensors


def test_lora_registers_the_adapter_kind():
    assert handlers.handles(MessageKind.ADAPTER)
    assert isinstance(handlers.make_handler(MessageKind.ADAPTER, None), AdapterMessages)


def test_the_lifecycle_keeps_its_own_kinds():
    for kind in (MessageKind.WEIGHTS, MessageKind.ABORT, MessageKind.PREPARE):
        assert not handlers.handles(kind)
        with pytest.raises(ValueError, match="handles"):
            handlers.register_message_handler(kind, "x", "y")


def test_the_lifecycle_imports_no_feature():
    tree = ast.parse(inspect.getsource(lifecycle))
    imported = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    ]
    assert not [m for m in imported if ".lora" in m], imported


def test_the_lifecycle_names_no_feature():
    source = inspect.getsource(lifecycle).lower()
    assert "adapter" not in source and "lora" not in source


HEADER = AdapterHeader(
    name="policy", lora_id=7, config=AdapterConfig(2, 4.0, ("q_proj",))
)


class _Carried:
    """A backend's read of a message's tensors, from plain tensors."""

    def __init__(self, buffers: list[torch.Tensor], upstream_wire: bool = False):
        self.buffers = buffers
        self.upstream_wire = upstream_wire
        self.buffer_count = len(buffers)
        self.labels: list[str] = []

    @contextmanager
    def read(self, what: str) -> Iterator[ReadTensors]:
        self.labels.append(what)
        yield ReadTensors(
            payloads=self.buffers,
            tensors=lambda: [("a.lora_A.weight", self.buffers[0][:4].view(2, 2))],
        )


class _Engine:
    def __init__(self, backend_name: str, carried: _Carried | None) -> None:
        self.backend_name = backend_name
        self.carried = carried
        self.messages: list[dict[str, Any]] = []

    def carried_tensors(self, message: dict[str, Any]) -> _Carried | None:
        self.messages.append(message)
        return self.carried


class _Pushes:
    """What the handler asks of ``AdapterPushes`` when it reads an adapter."""

    def __init__(self, checksum: str | None) -> None:
        self.checksum = checksum
        self.checked: list[tuple[str, str]] = []
        self.received: list[list[tuple[str, torch.Tensor]]] = []

    def expected_checksum(self, header: AdapterHeader) -> str | None:
        return self.checksum

    def check_checksum(self, header: AdapterHeader, expected: str, got: str) -> None:
        self.checked.append((expected, got))

    def receive(self, header: AdapterHeader, tensors: list[Any]) -> None:
        self.received.append(tensors)


def _adapter_messages(engine: _Engine, pushes: _Pushes | None = None) -> Any:
    handler: Any = AdapterMessages(engine)
    handler._pushes = pushes
    return handler


def test_an_adapter_to_a_backend_that_maps_no_buffers_is_refused():
    handler = _adapter_messages(_Engine("sharded_rdt", None))
    with pytest.raises(ValueError, match="sharded_rdt backend does not map"):
        handler._read(HEADER, {ADAPTER_KEY: {}, "names": []})


@pytest.mark.parametrize(
    "carried, refusal",
    [
        (_Carried([torch.zeros(16, dtype=torch.uint8)], True), "fork's wire only"),
        (_Carried([torch.zeros(4, dtype=torch.uint8)] * 2), "names 2"),
    ],
)
def test_an_adapter_message_the_handler_cannot_check_is_refused(carried, refusal):
    pushes = _Pushes(checksum="x")
    handler = _adapter_messages(_Engine("ipc", carried), pushes)
    with pytest.raises(ValueError, match=refusal):
        handler._read(HEADER, {ADAPTER_KEY: {}})
    assert carried.labels == [] and pushes.received == []


@pytest.mark.parametrize("checksum", [None, "expected"])
def test_the_handler_checks_and_stages_what_the_backend_read(checksum):
    payload = torch.arange(16, dtype=torch.uint8)
    carried = _Carried([payload])
    engine = _Engine("ipc", carried)
    pushes = _Pushes(checksum)
    _adapter_messages(engine, pushes)._read(HEADER, {ADAPTER_KEY: {}, "names": []})
    # The backend reads the message without its adapter header.
    assert engine.messages == [{"names": []}]
    assert carried.labels == ["adapter"]
    expected = [] if checksum is None else [(checksum, payload_checksum(payload))]
    assert pushes.checked == expected
    [[(name, tensor)]] = pushes.received
    assert name == "a.lora_A.weight" and tensor.shape == (2, 2)
