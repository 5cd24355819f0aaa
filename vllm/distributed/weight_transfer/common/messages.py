# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vocabulary of ``update_weights`` messages, and the one rule that says
what a body asks of the workers.

A message (one worker's ``update_info``) is of one ``MessageKind``, decided by
its fields in the order the worker engine reads them
(``worker_lifecycle.LayerwiseWorkerEngine.update_weights``):

* ``{"abort": reason}``: ``ABORT``, closes the open update;
* ``{"prepare": publication_id}``: ``PREPARE``, the trainer sent every weight;
* a message with an ``"adapter"`` header: ``ADAPTER``, a LoRA adapter staged
  apart from the model;
* any other JSON object: ``WEIGHTS``, base weights that may land in the
  served model;
* anything that is not a JSON object: ``MALFORMED``.

The kind says what the message may do, not whether it is valid: an abort or
prepare message with other fields is still of that kind (the worker refuses
it, and no weight lands from it).

A body's ``update_info`` is one message for every worker, or a list indexed
the way vLLM's ``Worker.update_weights`` picks its element:
``data_parallel_index * world_size + rank`` (``worker_index``), so each
worker reads only its own. ``classify_update`` therefore accepts a list only
when it holds one message per worker and every message is of the same kind;
any other body is ``UnclassifiableUpdate``, because what it does would
differ from worker to worker. The weight update guard, the sync metrics and
the worker engines all read kinds through this module.
"""

from __future__ import annotations

import enum
from typing import Any

# ``{"abort": reason}`` closes the open update (``verification.fence``).
ABORT_FIELD = "abort"
# ``{"prepare": publication_id}``: every weight was sent; receipts next.
PREPARE_FIELD = "prepare"
# The header of a LoRA adapter push's message (``lora_adapters``).
ADAPTER_KEY = "adapter"

# Worker methods that open, feed or close a weight update. Over HTTP they
# are the RL routes' to call, never ``/collective_rpc``'s.
WEIGHT_TRANSFER_METHODS = frozenset(
    {
        "init_weight_transfer_engine",
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "shutdown_weight_transfer_engine",
    }
)


class MessageKind(enum.Enum):
    WEIGHTS = "weights"
    ADAPTER = "adapter"
    ABORT = "abort"
    PREPARE = "prepare"
    MALFORMED = "malformed"


class UnclassifiableUpdate(ValueError):
    """An ``update_weights`` body whose effect differs between workers, or
    that is no message at all."""


def message_kind(message: Any) -> MessageKind:
    """The kind of one worker's message; see the module docstring."""
    if not isinstance(message, dict):
        return MessageKind.MALFORMED
    if ABORT_FIELD in message:
        return MessageKind.ABORT
    if PREPARE_FIELD in message:
        return MessageKind.PREPARE
    if ADAPTER_KEY in message:
        return MessageKind.ADAPTER
    return MessageKind.WEIGHTS


def classify_update(update_info: Any, workers: int | None = None) -> MessageKind:
    """The one kind of every worker's message in ``update_info``.

    ``workers`` is how many workers read the body (``expected_messages``);
    None skips the length check. Raises ``UnclassifiableUpdate`` naming the
    cause for a list of the wrong length, a list mixing kinds, or a message
    that is not a JSON object."""
    messages = update_info if isinstance(update_info, list) else [update_info]
    if not messages:
        raise UnclassifiableUpdate(_length_refusal(0, workers))
    kinds = [message_kind(m) for m in messages]
    if MessageKind.MALFORMED in kinds:
        bad = kinds.index(MessageKind.MALFORMED)
        where = "update_info"
        if isinstance(update_info, list):
            where += f"[{bad}]"
        raise UnclassifiableUpdate(
            f"{where} is a {type(messages[bad]).__name__}, not a JSON object; "
            "each worker's message must be an object"
        )
    if len(set(kinds)) > 1:
        raise UnclassifiableUpdate(
            "update_info mixes message kinds across workers ("
            + ", ".join(f"[{i}] {k.value}" for i, k in enumerate(kinds))
            + "): each worker would do something different. Send one kind "
            "per call (weights, adapter, abort or prepare) to every worker"
        )
    if isinstance(update_info, list) and workers not in (None, len(messages)):
        raise UnclassifiableUpdate(_length_refusal(len(messages), workers))
    return kinds[0]


def _length_refusal(length: int, workers: int | None) -> str:
    return (
        f"update_info is a list of {length} messages but the server runs "
        f"{workers if workers is not None else 'at least one'} worker(s), and "
        "each worker reads element data_parallel_index * world_size + rank; "
        "send one message per worker, or one message (not a list) for all"
    )


def update_kind(update_info: Any) -> MessageKind:
    """``classify_update`` without the length check, ``MALFORMED`` for a body
    it refuses (for observers that must not raise)."""
    try:
        return classify_update(update_info)
    except UnclassifiableUpdate:
        return MessageKind.MALFORMED


def first_message(update_info: Any) -> Any:
    """The first worker's message of ``update_info`` (None for an empty
    list); every message of a classified body is of its kind."""
    if isinstance(update_info, list):
        return update_info[0] if update_info else None
    return update_info


def worker_index(data_parallel_index: int, world_size: int, rank: int) -> int:
    """The element of a list ``update_info`` that worker ``rank`` of
    data-parallel replica ``data_parallel_index`` reads (vLLM's rule)."""
    return data_parallel_index * world_size + rank


def expected_messages(vllm_config: Any) -> int:
    """How many workers read an ``update_weights`` body: every worker of
    every data-parallel replica."""
    parallel = getattr(vllm_config, "parallel_config", None)
    across = getattr(parallel, "world_size_across_dp", None)
    if isinstance(across, int) and across > 0:
        return across
    world_size = getattr(parallel, "world_size", 1) or 1
    dp_size = getattr(parallel, "data_parallel_size", 1) or 1
    return int(world_size) * int(dp_size)
