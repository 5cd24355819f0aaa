# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Message kinds a feature registers with the worker lifecycle."""

import ast
import inspect

import pytest

from vllm.distributed.weight_transfer.common.messages import MessageKind
from vllm.distributed.weight_transfer.lora.worker_handler import AdapterMessages
from vllm.distributed.weight_transfer.worker import handlers, lifecycle


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
