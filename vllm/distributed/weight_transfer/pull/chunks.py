# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cut a worker's plan into pulls: pure functions, no tensors, no I/O.

A `WorkerPlan` says which slices a worker needs, per gather group. The producers
that serve them are trainer ranks, each holding part of the checkpoint, so the
plan is split by producer (`RdtRouter.producer_for`) into `PullChunk`s: one
chunk per (group, producer) that has something for this worker. A chunk's
slices are packed back to back, each at a 16-byte aligned offset, in one
contiguous buffer; producer and consumer both derive that layout from the chunk
itself, so they agree without exchanging it.

``seq`` numbers a consumer's chunks per producer in pull order (group order).
The producer reads the chunk list once, at registration, and afterwards a pull
is just ``(consumer_id, seq)``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, dtype_from_name
from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan
from vllm.distributed.weight_transfer.pull.routing import RdtRouter

PACK_ALIGN = 16


def _align(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


@dataclass(frozen=True)
class PackedSlice:
    """A slice and the byte offset where it sits in its chunk's buffer."""

    spec: SliceSpec
    offset: int


@dataclass(frozen=True)
class PullChunk:
    """The slices of one gather group that one producer packs for a consumer."""

    group: int
    producer: int
    seq: int
    slices: tuple[PackedSlice, ...]

    def __post_init__(self) -> None:
        expected = pack_offsets([p.spec for p in self.slices])[0]
        actual = [p.offset for p in self.slices]
        if actual != expected:
            raise ValueError(
                f"chunk (group {self.group}, producer {self.producer}, seq "
                f"{self.seq}) has offsets {actual} but its slices pack at "
                f"{expected}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer, padding included."""
        if not self.slices:
            return 0
        last = self.slices[-1]
        return last.offset + last.spec.nbytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of slice data, padding excluded."""
        return sum(p.spec.nbytes for p in self.slices)

    @property
    def unit(self) -> int:
        """The smallest itemsize among the slices' dtypes: the element size
        a delta compares the packed bytes in (itemsizes are powers of two,
        and slices sit at 16-byte offsets, so it divides every slice)."""
        return min(
            (dtype_from_name(p.spec.dtype).itemsize for p in self.slices),
            default=1,
        )

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.spec.source for p in self.slices))

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "producer": self.producer,
            "seq": self.seq,
            "slices": [p.spec.to_json() for p in self.slices],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PullChunk:
        return make_chunk(
            group=data["group"],
            producer=data["producer"],
            seq=data["seq"],
            specs=[SliceSpec.from_json(s) for s in data["slices"]],
        )


def pack_offsets(specs: Sequence[SliceSpec]) -> tuple[list[int], int]:
    """Offsets of ``specs`` packed in order at 16-byte boundaries, and the
    packed size."""
    offsets = []
    end = 0
    for spec in specs:
        start = _align(end)
        offsets.append(start)
        end = start + spec.nbytes
    return offsets, end


def make_chunk(
    *, group: int, producer: int, seq: int, specs: Sequence[SliceSpec]
) -> PullChunk:
    offsets, _ = pack_offsets(specs)
    return PullChunk(
        group=group,
        producer=producer,
        seq=seq,
        slices=tuple(PackedSlice(s, o) for s, o in zip(specs, offsets, strict=True)),
    )


def chunks_digest(chunks: Sequence[PullChunk]) -> str:
    """sha256 (32 hex chars) of what a producer packs for these chunks; equal
    digests mean identical serve buffers, so consumers may share them."""
    payload = json.dumps(
        [c.to_json() for c in chunks], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PullPlan:
    """A consumer's pulls in issue order (group order, then producer)."""

    consumer_id: int
    num_producers: int
    chunks: tuple[PullChunk, ...]

    def for_producer(self, producer: int) -> tuple[PullChunk, ...]:
        return tuple(c for c in self.chunks if c.producer == producer)

    def digest(self, producer: int) -> str:
        return chunks_digest(self.for_producer(producer))

    def serve_bytes(self, producer: int) -> int:
        """Largest chunk this consumer pulls from ``producer``."""
        return max((c.nbytes for c in self.for_producer(producer)), default=0)

    @property
    def max_chunk_bytes(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.chunks)

    def payload_bytes_by_producer(self) -> dict[int, int]:
        out = dict.fromkeys(range(self.num_producers), 0)
        for c in self.chunks:
            out[c.producer] += c.payload_bytes
        return out


def build_pull_plan(plan: WorkerPlan, router: RdtRouter, consumer_id: int) -> PullPlan:
    """Split ``plan`` into chunks, routing each slice to the producer that serves
    ``consumer_id`` its source name."""
    if not 0 <= consumer_id < router.num_consumers:
        raise ValueError(
            f"consumer_id {consumer_id} is outside 0..{router.num_consumers - 1}"
        )
    chunks: list[PullChunk] = []
    next_seq = [0] * router.num_producers
    for group in plan.groups:
        by_producer: dict[int, list[SliceSpec]] = {}
        for spec in group.slices:
            producer = router.producer_for(consumer_id, spec.source, group.index)
            by_producer.setdefault(producer, []).append(spec)
        for producer in sorted(by_producer):
            chunks.append(
                make_chunk(
                    group=group.index,
                    producer=producer,
                    seq=next_seq[producer],
                    specs=by_producer[producer],
                )
            )
            next_seq[producer] += 1
    return PullPlan(
        consumer_id=consumer_id,
        num_producers=router.num_producers,
        chunks=tuple(chunks),
    )
