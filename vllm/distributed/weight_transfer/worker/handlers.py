# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Message handlers of a worker's update life, by message kind: a feature
whose messages the shared lifecycle (``worker.lifecycle``) does not land as
base weights registers a `MessageHandler` for its kind
(``common.messages.MessageKind``) by module path and class name; the module
is imported when a worker first meets a message of that kind. The lifecycle
knows no feature: it hands each message of a registered kind to that kind's
handler, and tells every handler it made when an update prepares, commits,
ends or the engine shuts down. A handler whose messages carry tensors in a
trainer's buffers has the backend read them (`CarriedTensors`, from the
engine's ``carried_tensors``); what it does with them is its own."""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.weight_transfer.common.messages import MessageKind

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class MessageHandler:
    """One worker engine's handler of one message kind, made on the first
    message of that kind; every hook but ``handle`` may do nothing."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def handle(self, update_info: dict[str, Any]) -> bool:
        """Take one message (the lifecycle checked the update is open, not
        aborted, not prepared and not fenced); False when it is not this
        handler's after all, and lands as base weights."""
        raise NotImplementedError

    def prepare_header(self) -> Any:
        """The publication header a prepare message must name while this
        handler's push is open (None: the engine's own)."""
        return None

    def prepare(self) -> None:
        """Check what this handler holds and write its receipt (the prepare
        message, or a finish)."""

    def commit(self) -> None:
        """The update finished: what this handler staged serves from now."""

    def discard(self, reason: str | None = None) -> None:
        """Drop what this handler staged (the update failed, was aborted,
        ended, or a new one started)."""

    def close(self) -> None:
        """The engine shuts down."""


@dataclass(frozen=True)
class ReadTensors:
    """A message's tensors as mapped: per buffer, the bytes from its start to
    the end of the last tensor in it (``payloads``, uint8: what a trainer's
    checksum of the buffer covers), and ``tensors()``, each tensor typed and
    shaped in them. Valid inside ``CarriedTensors.read`` only."""

    payloads: list[torch.Tensor]
    tensors: Callable[[], list[tuple[str, torch.Tensor]]]


class CarriedTensors(Protocol):
    """The tensors one message carries in a trainer's buffers, parsed by the
    backend but not yet mapped: what the message says of them first, then
    ``read``, which maps its buffers for the block and releases them after."""

    # The message is in upstream 0.32's format rather than the fork's.
    upstream_wire: bool
    # How many of the trainer's buffers the message names.
    buffer_count: int

    def read(self, what: str) -> AbstractContextManager[ReadTensors]:
        """Map the buffers (``what`` names the message in errors)."""
        ...


_HANDLERS: dict[MessageKind, tuple[str, str]] = {}


def register_message_handler(
    kind: MessageKind, module_path: str, class_name: str
) -> None:
    """Hand messages of ``kind`` to ``module_path.class_name`` (a
    `MessageHandler`), imported on first use."""
    if kind in (MessageKind.WEIGHTS, MessageKind.ABORT, MessageKind.PREPARE):
        raise ValueError(f"the worker lifecycle handles {kind} messages itself")
    _HANDLERS[kind] = (module_path, class_name)


def handles(kind: MessageKind) -> bool:
    return kind in _HANDLERS


def make_handler(kind: MessageKind, engine: Any) -> MessageHandler:
    """A new handler of ``kind`` for ``engine``; KeyError when none is
    registered."""
    module_path, class_name = _HANDLERS[kind]
    cls = getattr(importlib.import_module(module_path), class_name)
    return cls(engine)
