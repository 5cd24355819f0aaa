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

Overlapped packed plan (``overlap=True`` and a model larger than the buffer):
the same one buffer, split in two halves that chunks use in turn, so the
trainer fills chunk ``k + 1`` in one half while the workers load chunk ``k``
from the other. A tensor larger than half the buffer travels alone from the
buffer's start; its chunk overlaps both halves, so it waits for the chunk
before it (``Chunk.overlaps``). The memory is the same as without overlap.

Unpacked plan: every tensor is its own buffer (offset 0). Chunks still group
tensors so that the bytes exported at once stay within ``buffer_cap_bytes``
(at least one tensor per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, partial

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.ipc.wire import dtype_name, tensor_nbytes

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

    @cached_property
    def span(self) -> tuple[int, int]:
        """``(start, end)``: the bytes of the packed buffer this chunk uses
        (computed once: every sync of a plan asks)."""
        if not self.slots:
            return (0, 0)
        return (
            min(s.offset for s in self.slots),
            max(s.offset + s.nbytes for s in self.slots),
        )

    def overlaps(self, other: Chunk) -> bool:
        """True when this chunk and ``other`` use common bytes of the buffer."""
        start, end = self.span
        other_start, other_end = other.span
        return start < other_end and other_start < end

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


@dataclass(frozen=True)
class TransferPlan:
    packed: bool
    alignment: int
    buffer_nbytes: int  # packed: the one buffer's size; unpacked: 0
    chunks: tuple[Chunk, ...]
    overlapped: bool = False  # packed: chunks alternate between two halves

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

    if not packed:
        return _unpacked_plan(metas, buffer_cap_bytes, alignment)
    buffer_nbytes = packed_buffer_nbytes(metas, buffer_cap_bytes, alignment)
    total = sum(align_up(tensor_nbytes(m.dtype, m.shape), alignment) for m in metas)
    overlapped = overlap and total > buffer_nbytes
    half = buffer_nbytes // 2 // alignment * alignment if overlapped else 0
    if overlapped and half == 0:
        overlapped, half = False, 0
    region_size = half if overlapped else buffer_nbytes
    chunks: list[Chunk] = []
    current: list[TensorSlot] = []
    region = 0  # 0: the first half (or the whole buffer), 1: the second half
    cursor = 0  # bytes used in the current region

    def flush() -> None:
        nonlocal current
        if current:
            chunks.append(Chunk(len(chunks), tuple(current)))
            current = []

    for m in metas:
        nbytes = tensor_nbytes(m.dtype, m.shape)
        slot = partial(TensorSlot, m.name, dtype_name(m.dtype), tuple(m.shape))
        if nbytes > region_size:  # only when overlapped: it travels alone
            flush()
            chunks.append(Chunk(len(chunks), (slot(0, nbytes),)))
            region, cursor = 0, 0
            continue
        offset = align_up(cursor, alignment)
        if current and offset + nbytes > region_size:
            flush()
            region = 1 - region if overlapped else 0
            offset = 0
        current.append(slot(region * half + offset, nbytes))
        cursor = offset + nbytes
    flush()
    return TransferPlan(
        packed=True,
        alignment=alignment,
        buffer_nbytes=buffer_nbytes,
        chunks=tuple(chunks),
        overlapped=overlapped,
    )


def _unpacked_plan(
    metas: Sequence[ParamMeta], buffer_cap_bytes: int, alignment: int
) -> TransferPlan:
    chunks: list[Chunk] = []
    current: list[TensorSlot] = []
    cursor = 0
    for m in metas:
        nbytes = tensor_nbytes(m.dtype, m.shape)
        if current and cursor + nbytes > buffer_cap_bytes:
            chunks.append(Chunk(len(chunks), tuple(current)))
            current, cursor = [], 0
        current.append(
            TensorSlot(m.name, dtype_name(m.dtype), tuple(m.shape), 0, nbytes)
        )
        cursor += nbytes
    if current:
        chunks.append(Chunk(len(chunks), tuple(current)))
    return TransferPlan(
        packed=False, alignment=alignment, buffer_nbytes=0, chunks=tuple(chunks)
    )
