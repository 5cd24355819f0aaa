# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` backend's transfer plan: which tensors travel in which chunk, and
where each lies in its buffer. Pure functions over ``ParamMeta``; no tensors.

The trainer builds the plan from ``WeightSource.metadata()`` before it
materializes anything, then fills one chunk at a time, so a trainer rank never
holds more than the buffer plus the tensor being copied.

Packed plan: one reusable buffer of ``buffer_nbytes``. Its size is the total
size of the model (each tensor aligned) capped at ``buffer_cap_bytes``, but
never less than the largest tensor, so every tensor fits. Tensors are placed in
metadata order at offsets rounded up to ``alignment`` bytes; a tensor that would
cross the end of the buffer starts the next chunk.

Overlapped packed plan (``overlap=True``, a model larger than the cap, and
no tensor larger than half the cap): two buffers of half the cap each, used
alternately, so the trainer fills chunk ``k + 1`` while the workers load
chunk ``k``; together they take no more memory than the one buffer would.
Chunk ``k`` lives in buffer ``k % num_buffers``.

Unpacked plan: every tensor is its own buffer (offset 0). Chunks still group
tensors so that the bytes exported at once stay within ``buffer_cap_bytes``
(at least one tensor per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.ipc_wire import dtype_name, tensor_nbytes

DEFAULT_ALIGNMENT = 64
DEFAULT_BUFFER_CAP_BYTES = 1024**3


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a chunk: ``nbytes`` bytes at ``offset``."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """Tensors sent in one ``update_weights`` call, in metadata order."""

    index: int
    slots: tuple[TensorSlot, ...]

    @property
    def end(self) -> int:
        """Bytes of the packed buffer this chunk uses."""
        return max((s.offset + s.nbytes for s in self.slots), default=0)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


@dataclass(frozen=True)
class TransferPlan:
    packed: bool
    alignment: int
    buffer_nbytes: int  # packed: each buffer's size; unpacked: 0
    chunks: tuple[Chunk, ...]
    num_buffers: int = 1  # packed: chunk k uses buffer k % num_buffers

    def buffer_of(self, chunk: Chunk) -> int:
        return chunk.index % self.num_buffers if self.num_buffers else 0

    @property
    def num_tensors(self) -> int:
        return sum(len(c.slots) for c in self.chunks)

    def slots(self) -> list[TensorSlot]:
        return [s for c in self.chunks for s in c.slots]


def packed_buffer_nbytes(
    metas: Sequence[ParamMeta], buffer_cap_bytes: int, alignment: int
) -> int:
    """Size of the packed buffer: the aligned total, capped, but >= largest tensor."""
    sizes = [tensor_nbytes(m.dtype, m.shape) for m in metas]
    total = sum(align_up(s, alignment) for s in sizes)
    largest = max(sizes, default=0)
    return max(min(total, buffer_cap_bytes), largest)


def plan_transfer(
    metas: Sequence[ParamMeta],
    *,
    packed: bool,
    buffer_cap_bytes: int = DEFAULT_BUFFER_CAP_BYTES,
    alignment: int = DEFAULT_ALIGNMENT,
    overlap: bool = False,
) -> TransferPlan:
    """Split ``metas`` (in order) into chunks; see the module docstring."""
    if buffer_cap_bytes <= 0:
        raise ValueError(
            f"packed_buffer_size_bytes must be positive, got {buffer_cap_bytes}"
        )
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise ValueError(f"WeightSource.metadata() lists {m.name!r} twice")
        seen.add(m.name)

    limit = (
        packed_buffer_nbytes(metas, buffer_cap_bytes, alignment)
        if packed
        else buffer_cap_bytes
    )
    num_buffers = 1 if packed else 0
    total = sum(align_up(tensor_nbytes(m.dtype, m.shape), alignment) for m in metas)
    largest = max((tensor_nbytes(m.dtype, m.shape) for m in metas), default=0)
    if packed and overlap and total > limit and 2 * largest <= buffer_cap_bytes:
        limit = buffer_cap_bytes // 2
        num_buffers = 2
    chunks: list[Chunk] = []
    current: list[TensorSlot] = []
    cursor = 0
    for m in metas:
        nbytes = tensor_nbytes(m.dtype, m.shape)
        offset = align_up(cursor, alignment) if packed else 0
        used = offset + nbytes if packed else cursor + nbytes
        if current and used > limit:
            chunks.append(Chunk(len(chunks), tuple(current)))
            current, cursor = [], 0
            offset = 0
            used = nbytes
        current.append(
            TensorSlot(m.name, dtype_name(m.dtype), tuple(m.shape), offset, nbytes)
        )
        cursor = used
    if current:
        chunks.append(Chunk(len(chunks), tuple(current)))
    return TransferPlan(
        packed=packed,
        alignment=alignment,
        buffer_nbytes=limit if packed else 0,
        chunks=tuple(chunks),
        num_buffers=num_buffers,
    )
