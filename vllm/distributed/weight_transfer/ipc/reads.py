# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What one ``ipc`` update message reads on a worker: each buffer it names,
this worker's handle selected and mapped through a ``BufferImporter``
(``read_message``), reused as is while nothing changed since the message
before."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed.weight_transfer.buffers.dataplane import (
    BufferImporter,
    MappedBuffers,
    mapping_key,
)
from vllm.distributed.weight_transfer.buffers.handles import BufferHandle
from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class MessageReads:
    """The buffers one update message reads, mapped (``read_message``), for
    the message layout ``views`` while the importer's mappings are at
    ``generation``."""

    views: object  # IPCWeightTransferUpdateInfo.layout_views
    generation: int
    device_keys: frozenset[str]  # the trainer's keys this worker read
    handles: list[BufferHandle]
    buffers: list[torch.Tensor]
    mapping_keys: frozenset[tuple]
    shm_keys: tuple[tuple, ...]  # those of shared-memory segments
    mapped: MappedBuffers
    kept: bool  # every buffer persistent, in a packed message


def read_message(
    info: IPCWeightTransferUpdateInfo,
    importer: BufferImporter,
    last: MessageReads | None = None,
) -> MessageReads:
    """Map what ``info`` reads: this worker's handle of each buffer,
    selected and opened through ``importer`` (once per update, kept across
    updates for persistent ones).

    A short message that names no handles (``info.reuses_handles``) reads
    the buffers of the message that set its layout, which must all still be
    mapped: the importer never maps an old export again. While no mapping
    changed since ``last`` (the reads of the previous message) read the same
    layout, those reads are reused as they are (``BufferImporter.use``), so
    a layout of thousands of a trainer's adopted storages costs nothing per
    buffer."""
    if (
        info.reuses_handles
        and last is not None
        and last.views is info.layout_views
        and last.generation == importer.generation
    ):
        importer.use(last.mapping_keys, last.shm_keys)
        return last
    selected = [
        importer.select(hmap, f"update_info.ipc_handles{suffix}")
        for suffix, hmap in indexed_buffers(info)
    ]
    handles = [handle for _, handle in selected]
    if info.reuses_handles and not all(map(importer.holds, handles)):
        raise ValueError(
            "update_info names a layout without ipc_handles, but this worker "
            "no longer maps every buffer that layout's message named (an "
            "update failed or read other buffers since); send the full message"
        )
    buffers = [importer.open(h) for h in handles]
    keys = [mapping_key(h) for h in handles]
    return MessageReads(
        views=info.layout_views,
        generation=importer.generation,
        device_keys=frozenset(key for key, _ in selected),
        handles=handles,
        buffers=buffers,
        mapping_keys=frozenset(keys),
        shm_keys=tuple(k for k in keys if k[0] == "shm"),
        mapped=MappedBuffers(keys, buffers),
        kept=info.packed and all(h.persistent for h in handles),
    )


def indexed_buffers(info: IPCWeightTransferUpdateInfo) -> list[tuple[str, dict]]:
    """``(field suffix, handles by device key)`` per buffer ``info`` names,
    the suffix for error messages."""
    buffers = info.buffers()
    if info.packed and len(buffers) == 1:
        return [("", buffers[0])]
    return [(f"[{i}]", b) for i, b in enumerate(buffers)]
