# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One trainer rank's producer: live gather groups in, packed chunks out.

The producer knows nothing about how bytes travel; a transport
(`sharded_rdt_transport`, `sharded_rdt_nixl`, `sharded_rdt_ray`) calls it.

Consumers (inference workers), once per engine init:
    ``register(consumer_id, chunks, digest)`` -> the serve slots it will read.
Trainer rank, once per sync:
    1. ``begin_sync(live_consumer_ids)``
    2. per gather group this rank holds, in order:
       ``wait_credit()`` (at most ``gather_lookahead + 1`` groups resident),
       then ``publish(group, {name: tensor})``
    3. ``end_sync()`` (returns when every live consumer has read every chunk)
Consumers, during a sync, per chunk in ``seq`` order:
    ``pack(consumer_id, seq)`` -> `Packed` (slot, packed view, checksum);
    read it; ``read_done(consumer_id, seq)``.
Consumers, at the end of a sync (producer 0 only):
    ``deliver_receipt(receipt)`` -> ``receipts``, the `ReceiptInbox` the sending
    trainer rank collects verified-publication receipts from.

With ``checksums`` on, each packed chunk's ``ws1`` payload checksum is computed
on the producer's device right after packing; the consumer compares it with
the bytes that reached it.

With ``delta_bases_bytes`` above 0, the producer keeps (`PublishedBases`, on
the serve buffers' device, at most that many bytes) the bytes it last packed
for each chunk, and
each later packing also writes the delta from them into the slot's delta
buffer: `Packed.delta` offers it next to the whole chunk, and the consumer
reads whichever it can use.

A group is released (its tensors dropped, a credit returned) once every live
consumer that pulls from it here has read its chunk. Consumers whose plans are
identical and who sit at the same position in different replicas share serve
slots: the chunk is packed once and read by each of them.

Every wait is bounded: when nothing happens for ``stall_timeout_s`` (no
registration, publish, pack or read), the producer fails, and every waiter on
both sides raises. ``fail(reason)`` does the same at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm.distributed.weight_transfer.plan.ops import (
    dtype_from_name,
    replay_slice,
)
from vllm.distributed.weight_transfer.pull.chunks import (
    PullChunk,
    chunks_digest,
)
from vllm.distributed.weight_transfer.pull.delta_bases import PublishedBases
from vllm.distributed.weight_transfer.pull.routing import (
    DEFAULT_GATHER_LOOKAHEAD,
    DEFAULT_STALL_TIMEOUT_S,
    buffer_alloc_bytes,
    serve_share_key,
)
from vllm.distributed.weight_transfer.verification import (
    ReceiptInbox,
    payload_checksum,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_POLL_S = 1.0


class ProducerError(RuntimeError):
    """The sync failed on this producer; every waiter raises it."""


@torch.no_grad()
def pack_chunk(
    chunk: PullChunk, tensors: Mapping[str, torch.Tensor], out: torch.Tensor
) -> None:
    """Replay each slice of ``chunk`` on the live ``tensors`` and copy it to its
    offset in ``out`` (uint8, at least ``chunk.nbytes`` long)."""
    end = 0
    for packed in chunk.slices:
        spec = packed.spec
        # The alignment gap before the slice is zeroed, so the packed bytes
        # (and their checksum and deltas) depend on the weights alone.
        out[end : packed.offset].zero_()
        end = packed.offset + spec.nbytes
        tensor = tensors.get(spec.source)
        if tensor is None:
            raise ProducerError(
                f"group {chunk.group} was published without {spec.source!r}, "
                "which a consumer's plan reads from this rank"
            )
        if spec.nbytes == 0:
            continue
        value = replay_slice(tensor, spec)
        dst = out[packed.offset : packed.offset + spec.nbytes]
        dst.view(dtype_from_name(spec.dtype)).view(spec.shape).copy_(value)


class PackedDelta(NamedTuple):
    """A packed chunk's delta against the bytes packed for it before: its wire
    header and its bytes (in the slot's delta buffer)."""

    header: dict[str, Any]
    view: torch.Tensor


class Packed(NamedTuple):
    """A packed chunk: its serve slot, its bytes (valid until ``read_done``),
    their payload checksum (None when checksums are off), and the delta
    offered next to them (None when there is none)."""

    slot: int
    view: torch.Tensor
    checksum: str | None
    delta: PackedDelta | None = None


@dataclass
class _Consumer:
    consumer_id: int
    chunks: tuple[PullChunk, ...]
    digest: str
    share: int
    last_gen: int = 0  # the last sync this consumer pulled in


@dataclass
class _Slot:
    seq: int = -1  # chunk seq packed here; -1 when empty
    packing: bool = False
    checksum: str | None = None  # of the packed bytes, when checksums are on
    delta: PackedDelta | None = None  # offered next to the packed bytes
    readers: set[int] = field(default_factory=set)


@dataclass
class _Share:
    digest: str
    members: set[int]
    buffers: list[torch.Tensor]
    slots: list[_Slot]
    # One per slot when deltas are on: where a chunk's delta is written.
    delta_buffers: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class ProducerSettings:
    """How a producer serves, apart from what it serves (the keyword
    arguments of `Producer` after ``served_names``)."""

    # Serve slots per share: chunks packed ahead of the consumer's reads.
    num_slots: int = 2
    gather_lookahead: int = DEFAULT_GATHER_LOOKAHEAD
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # Consumers per replica: those at one position in different replicas
    # share serve slots (0: none share).
    workers_per_replica: int = 0
    # Serve buffers are allocated at least this large.
    buffer_presize_bytes: int = 0
    checksums: bool = False
    # Serve buffers of exactly the largest chunk, not rounded up to
    # 256 MiB (for small payloads whose size changes rarely).
    exact_buffers: bool = False
    # Bytes of last-packed chunks kept (next to the serve buffers) to
    # encode deltas against
    # (0: no deltas).
    delta_bases_bytes: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.gather_lookahead < 0 or self.stall_timeout_s <= 0:
            raise ValueError(
                f"num_slots={self.num_slots}, gather_lookahead="
                f"{self.gather_lookahead}, stall_timeout_s={self.stall_timeout_s}: "
                "need >= 1, >= 0 and > 0"
            )
        if self.delta_bases_bytes < 0:
            raise ValueError(f"delta_bases_bytes={self.delta_bases_bytes}: need >= 0")


class Producer:
    """See the module docstring; ``settings`` are `ProducerSettings`' fields."""

    def __init__(
        self,
        *,
        rank: int,
        names: Sequence[str],
        group_lens: Sequence[int],
        served_names: Collection[str],
        device: torch.device | str = "cpu",
        on_new_buffer: Callable[[torch.Tensor], None] | None = None,
        **settings: Any,
    ) -> None:
        if sum(group_lens) != len(names):
            raise ValueError(
                f"group_lens sum to {sum(group_lens)} but there are {len(names)} names"
            )
        self.settings = ProducerSettings(**settings)
        self.rank = rank
        self.device = torch.device(device)
        self._on_new_buffer = on_new_buffer
        self.receipts = ReceiptInbox()
        self._group_of: dict[str, int] = {}
        start = 0
        for gi, n in enumerate(group_lens):
            for name in names[start : start + n]:
                self._group_of[name] = gi
            start += n
        self.served_names = frozenset(served_names)
        unknown = sorted(self.served_names - set(self._group_of))
        if unknown:
            raise ValueError(
                f"producer rank {rank} serves {unknown[:3]} which are not among "
                f"the {len(names)} checkpoint names"
            )

        self._cond = threading.Condition()
        self._consumers: dict[int, _Consumer] = {}
        self._shares: dict[int, _Share] = {}
        self._active = False
        self._live: frozenset[int] = frozenset()
        self._resident: dict[int, Mapping[str, torch.Tensor]] = {}
        self._published: set[int] = set()
        self._pending: dict[int, set[tuple[int, int]]] = {}
        self._gen = 0  # sync generation, bumped by begin_sync
        self._error: ProducerError | None = None
        self._error_gen = 0  # the generation the error belongs to
        self._doomed: dict[int, str] = {}  # sync id -> failure before it began
        self._last_progress = time.monotonic()
        self.packed_bytes = 0
        self.max_resident = 0
        limit = self.settings.delta_bases_bytes
        self.bases = PublishedBases(limit) if limit else None
        self.deltas_offered = 0  # chunks packed with a delta this sync
        self.delta_bytes = 0  # and the deltas' bytes

    # -- consumers ----------------------------------------------------------

    def register(
        self, consumer_id: int, chunks: Sequence[PullChunk], digest: str
    ) -> list[torch.Tensor]:
        """Record a consumer's chunks for this producer and return the serve
        buffers (one per slot) its pulls are packed into."""
        chunks = tuple(chunks)
        for position, chunk in enumerate(chunks):
            if chunk.producer != self.rank or chunk.seq != position:
                raise ValueError(
                    f"consumer {consumer_id} registered chunk (producer "
                    f"{chunk.producer}, seq {chunk.seq}) at position {position} "
                    f"with producer rank {self.rank}; chunks must be this "
                    "producer's, in seq order"
                )
            for source in chunk.sources:
                if source not in self._group_of:
                    raise ValueError(
                        f"consumer {consumer_id} asks producer rank {self.rank} "
                        f"for unknown checkpoint tensor {source!r}; its plan was "
                        "baked from other metadata than the trainer's"
                    )
                if source not in self.served_names:
                    raise ValueError(
                        f"pull routed to the wrong producer: consumer "
                        f"{consumer_id} asks producer rank {self.rank} for "
                        f"{source!r}, which this rank does not hold"
                    )
                if self._group_of[source] != chunk.group:
                    raise ValueError(
                        f"consumer {consumer_id} lists {source!r} in group "
                        f"{chunk.group} but it belongs to group "
                        f"{self._group_of[source]}"
                    )
        if chunks_digest(chunks) != digest:
            raise ValueError(
                f"consumer {consumer_id} sent plan digest {digest} but its chunks "
                f"hash to {chunks_digest(chunks)}"
            )
        need = max((c.nbytes for c in chunks), default=0)
        key = serve_share_key(consumer_id, self.settings.workers_per_replica)
        with self._cond:
            if self._active:
                raise ProducerError(
                    f"consumer {consumer_id} registered with producer rank "
                    f"{self.rank} during a sync; initialize inference engines "
                    "between syncs"
                )
            share = self._shares.get(key)
            others = set() if share is None else share.members - {consumer_id}
            if share is not None and others and share.digest != digest:
                raise ValueError(
                    f"consumer {consumer_id} registered plan digest {digest} with "
                    f"producer rank {self.rank}, but consumers {sorted(others)}, "
                    f"which share its serve buffer, registered {share.digest}; "
                    "engines sharing a worker position need the same model, "
                    "dtype and parallel layout (or set workers_per_replica=0)"
                )
            if share is None or not others:
                old = share.buffers if share is not None else []
                if old and old[0].numel() >= need:
                    buffers = old
                    delta_buffers = share.delta_buffers if share else []
                else:
                    buffers = self._allocate(need) if need else []
                    delta_buffers = (
                        self._allocate(need) if need and self.bases is not None else []
                    )
                if self.bases is not None and (share is None or share.digest != digest):
                    self.bases.forget(key)  # kept for another plan
                share = _Share(
                    digest=digest,
                    members=set(),
                    buffers=buffers,
                    slots=[_Slot() for _ in range(self.settings.num_slots)],
                    delta_buffers=delta_buffers,
                )
                self._shares[key] = share
            share.members.add(consumer_id)
            previous = self._consumers.get(consumer_id)
            if previous is not None and previous.share != key:
                self._shares[previous.share].members.discard(consumer_id)
            self._consumers[consumer_id] = _Consumer(consumer_id, chunks, digest, key)
            self._progress()
            return list(share.buffers)

    def registered(self) -> frozenset[int]:
        """The ids of the consumers registered now."""
        with self._cond:
            return frozenset(self._consumers)

    def failure_of(self, sync_id: int) -> str | None:
        """Why sync ``sync_id`` failed (a consumer aborted it, begun or not),
        or None."""
        with self._cond:
            if self._error is not None and self._error_gen == sync_id:
                return str(self._error)
            return self._doomed.get(sync_id)

    def forget_consumers(self) -> None:
        """Between syncs: drop every registration (the serve buffers stay for
        the next registrations), so the next sync counts only consumers that
        register anew. For producers whose consumers change every sync."""
        with self._cond:
            if self._active:
                raise ProducerError(
                    f"producer rank {self.rank}: forget_consumers during a sync"
                )
            self._consumers.clear()
            for share in self._shares.values():
                share.members.clear()

    def _allocate(self, need: int) -> list[torch.Tensor]:
        size = (
            max(need, self.settings.buffer_presize_bytes)
            if self.settings.exact_buffers
            else buffer_alloc_bytes(need, self.settings.buffer_presize_bytes)
        )
        buffers = [
            torch.empty(size, dtype=torch.uint8, device=self.device)
            for _ in range(self.settings.num_slots)
        ]
        if self._on_new_buffer is not None:
            for buffer in buffers:
                self._on_new_buffer(buffer)
        return buffers

    def pack(self, consumer_id: int, seq: int, sync_id: int | None = None) -> Packed:
        """Pack chunk ``seq`` of ``consumer_id`` (or find it packed by a sharer)
        and return it as `Packed`; the view stays valid until this
        consumer calls ``read_done(consumer_id, seq)``. ``sync_id``, when the
        consumer knows it, names the sync its first pull belongs to, so a sync
        that failed before the consumer arrived is reported at once."""
        with self._cond:
            consumer = self._consumers.get(consumer_id)
            if consumer is None:
                raise ProducerError(
                    f"consumer {consumer_id} pulled from producer rank {self.rank} "
                    "without registering; call init_weight_transfer_engine first"
                )
            if not 0 <= seq < len(consumer.chunks):
                raise ProducerError(
                    f"consumer {consumer_id} pulled seq {seq} from producer rank "
                    f"{self.rank}, which has {len(consumer.chunks)} chunks for it"
                )
            chunk = consumer.chunks[seq]
            if seq == 0 and sync_id is not None:
                self._wait(
                    lambda: self._gen >= sync_id and self._active,
                    f"consumer {consumer_id} waiting for the trainer to begin "
                    f"sync {sync_id}",
                    floor=sync_id,
                )
                if self._gen != sync_id:
                    raise ProducerError(
                        f"consumer {consumer_id} pulled for sync {sync_id} but "
                        f"producer rank {self.rank} is at sync {self._gen}"
                    )
                consumer.last_gen = self._gen
            elif seq == 0:
                # Without a sync id, the first pull joins the sync in progress or
                # waits for the next begin_sync; failures of earlier syncs are
                # not this one's.
                floor = max(
                    consumer.last_gen + 1,
                    self._gen if self._active else self._gen + 1,
                )
                self._wait(
                    lambda: self._active and self._gen >= floor,
                    f"consumer {consumer_id} waiting for the trainer to begin a sync",
                    floor=floor,
                )
                consumer.last_gen = self._gen
            gen = consumer.last_gen
            self._raise_if_failed(gen)
            if not self._active or self._gen != gen:
                raise ProducerError(
                    f"consumer {consumer_id} pulled seq {seq} from producer rank "
                    f"{self.rank} outside the sync it started"
                )
            if consumer_id not in self._live:
                raise ProducerError(
                    f"consumer {consumer_id} pulled from producer rank {self.rank} "
                    f"but is not live in this sync (live: {sorted(self._live)})"
                )
            self._wait(
                lambda: chunk.group in self._resident,
                f"consumer {consumer_id} waiting for group {chunk.group}",
                floor=gen,
            )
            share = self._shares[consumer.share]
            slot_index = seq % self.settings.num_slots
            slot = share.slots[slot_index]
            self._wait(
                lambda: (slot.seq == seq and not slot.packing) or not slot.readers,
                f"consumer {consumer_id} waiting for serve slot {slot_index}",
                floor=gen,
            )
            buffer = share.buffers[slot_index]
            if slot.seq == seq:
                view = buffer[: chunk.nbytes]
                return Packed(slot_index, view, slot.checksum, slot.delta)
            slot.seq = seq
            slot.packing = True
            slot.checksum = None
            slot.delta = None
            slot.readers = {c for c in share.members if c in self._live}
            tensors = self._resident[chunk.group]
        view = buffer[: chunk.nbytes]
        try:
            pack_chunk(chunk, tensors, buffer)
            if buffer.is_cuda:
                # The copies are queued on the device; a consumer's RDMA read
                # of the buffer does not wait for them.
                torch.cuda.current_stream(buffer.device).synchronize()
            checksum = payload_checksum(view) if self.settings.checksums else None
            delta = self._offer_delta(
                share, consumer.share, slot_index, chunk, gen, checksum
            )
        except BaseException as e:
            self.fail(f"packing group {chunk.group} for consumer {consumer_id}: {e}")
            raise
        with self._cond:
            slot.packing = False
            slot.checksum = checksum
            slot.delta = delta
            self.packed_bytes += chunk.payload_bytes
            if delta is not None:
                self.deltas_offered += 1
                self.delta_bytes += delta.view.numel()
            self._progress()
        return Packed(slot_index, view, checksum, delta)

    def _offer_delta(
        self,
        share: _Share,
        key: int,
        slot_index: int,
        chunk: PullChunk,
        gen: int,
        checksum: str | None,
    ) -> PackedDelta | None:
        """With deltas on: the delta from the bytes last packed for ``chunk``
        to the ones in its slot now, written to the slot's delta buffer (None
        when there is no base or the delta is no smaller); the slot's bytes
        become the chunk's base."""
        if self.bases is None or not chunk.nbytes:
            return None
        out = share.delta_buffers[slot_index]
        view = share.buffers[slot_index][: chunk.nbytes]
        header = self.bases.offer(
            (key, chunk.seq), view, gen, out, unit=chunk.unit, digest=checksum
        )
        if header is None:
            return None
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        return PackedDelta(header, out[: header["buffer_nbytes"]])

    def _known_chunk(
        self, consumer_id: int, seq: int, asked: str
    ) -> tuple[_Consumer, _Slot]:
        """``consumer_id``'s state and the slot its chunk ``seq`` packs into
        (call with ``_cond`` held); a `ProducerError` naming ``asked`` when
        there is no such chunk."""
        consumer = self._consumers.get(consumer_id)
        if consumer is None or not 0 <= seq < len(consumer.chunks):
            raise ProducerError(
                f"{asked} for unknown chunk (consumer {consumer_id}, seq {seq}) "
                f"on producer rank {self.rank}"
            )
        slots = self._shares[consumer.share].slots
        return consumer, slots[seq % self.settings.num_slots]

    def packed_checksum(self, consumer_id: int, seq: int) -> str | None:
        """The checksum of chunk ``seq`` as packed for ``consumer_id``, for a
        transport that returns the bytes alone; call it before ``read_done``."""
        with self._cond:
            _, slot = self._known_chunk(consumer_id, seq, "checksum asked")
            if slot.seq != seq or slot.packing:
                raise ProducerError(
                    f"chunk seq {seq} of consumer {consumer_id} is not packed on "
                    f"producer rank {self.rank}; ask for its checksum between "
                    "pack and read_done"
                )
            return slot.checksum

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        """A worker's verified-publication receipt, for the sending trainer rank."""
        self.receipts.deliver(receipt)

    def read_done(self, consumer_id: int, seq: int) -> None:
        """``consumer_id`` has read chunk ``seq``; free its slot and, once every
        reader is done with the group, the group."""
        with self._cond:
            consumer, slot = self._known_chunk(consumer_id, seq, "read_done")
            gi = consumer.chunks[seq].group
            if slot.seq == seq:
                slot.readers.discard(consumer_id)
            pending = self._pending.get(gi)
            if pending is not None:
                pending.discard((consumer_id, seq))
                if not pending and gi in self._resident:
                    self._release(gi)
            self._progress()

    def consumer_lost(self, consumer_id: int, reason: str) -> None:
        """Fail the sync if ``consumer_id`` still had chunks to read here."""
        with self._cond:
            waiting = self._active and any(
                cid == consumer_id for p in self._pending.values() for cid, _ in p
            )
        if waiting:
            self.fail(f"consumer {consumer_id} {reason} mid-sync")

    # -- trainer ------------------------------------------------------------

    def begin_sync(
        self, live_consumer_ids: Iterable[int], sync_id: int | None = None
    ) -> None:
        """Start sync ``sync_id`` (default: the next one) for the live
        consumers; every trainer rank passes the same id, which rides the
        update info to the workers."""
        live = frozenset(live_consumer_ids)
        with self._cond:
            if sync_id is not None and sync_id <= self._gen:
                raise ProducerError(
                    f"producer rank {self.rank}: begin_sync({sync_id}) after sync "
                    f"{self._gen}; sync ids must increase"
                )
            if self._active:
                raise ProducerError(
                    f"producer rank {self.rank}: begin_sync while a sync is active"
                )
            missing = sorted(live - set(self._consumers))
            if missing:
                raise ProducerError(
                    f"consumers {missing} are live but have not registered with "
                    f"producer rank {self.rank}; run init_weight_transfer_engine "
                    "on every inference engine (get_worker_init_payload) first"
                )
            self._gen = self._gen + 1 if sync_id is None else sync_id
            self._live = live
            self._resident = {}
            self._published = set()
            self._pending = {}
            for cid in live:
                for chunk in self._consumers[cid].chunks:
                    self._pending.setdefault(chunk.group, set()).add((cid, chunk.seq))
            for share in self._shares.values():
                share.slots = [_Slot() for _ in range(self.settings.num_slots)]
            self.packed_bytes = 0
            self.max_resident = 0
            self.deltas_offered = 0
            self.delta_bytes = 0
            self._active = True
            self._progress()
            # A consumer that gave up on this sync before it began.
            doomed = self._doomed.pop(self._gen, None)
            self._doomed = {k: v for k, v in self._doomed.items() if k > self._gen}
            if doomed is not None:
                self._set_error(doomed)

    def wait_credit(self) -> None:
        """Block until another group may be published."""
        with self._cond:
            self._wait(
                lambda: len(self._resident) <= self.settings.gather_lookahead,
                f"the trainer waiting for consumers to free one of groups "
                f"{sorted(self._resident)}",
            )

    def publish(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._cond:
            self._raise_if_failed(self._gen)
            if not self._active:
                raise ProducerError("publish outside a sync; call begin_sync first")
            if group in self._published:
                raise ProducerError(f"group {group} published twice in one sync")
            self._published.add(group)
            self._resident[group] = dict(tensors)
            self.max_resident = max(self.max_resident, len(self._resident))
            if not self._pending.get(group):
                self._release(group)
            self._progress()

    def end_sync(self) -> None:
        """Block until every live consumer has read every chunk from here."""
        with self._cond:
            unpublished = sorted(
                g for g, p in self._pending.items() if p and g not in self._published
            )
            if unpublished:
                self._set_error(
                    f"producer rank {self.rank}: consumers wait for groups "
                    f"{unpublished} that this rank never published; its "
                    "WeightSource must yield every group it holds"
                )
            self._wait(
                lambda: not any(self._pending.values()),
                f"the trainer waiting for consumers to read groups "
                f"{sorted(g for g, p in self._pending.items() if p)}",
            )
            self._active = False
            self._resident = {}

    def fail(self, reason: str, sync_id: int | None = None) -> None:
        """Fail the current sync, waking every waiter. A failure for a sync
        this rank has not begun yet (``sync_id`` ahead of it: a worker refused
        the update before this trainer rank called ``begin_sync``) fails that
        sync as soon as it begins."""
        with self._cond:
            if sync_id is not None and sync_id > self._gen:
                self._doomed.setdefault(sync_id, reason)
                return
            self._set_error(reason)

    def fail_sync(self, sync_id: int, reason: str) -> None:
        """Fail sync ``sync_id`` whether or not it began: consumers already
        waiting for it to begin raise at once (``fail`` would keep a failure
        for a sync not begun until its ``begin_sync``)."""
        with self._cond:
            if sync_id > self._gen:
                if self._active:
                    self._set_error(f"sync {sync_id} failed: {reason}")
                self._gen = sync_id
            self._set_error(reason)

    def close(self) -> None:
        """Fail a sync in progress (waking its waiters); otherwise nothing."""
        with self._cond:
            if self._active:
                self._set_error(f"producer rank {self.rank} shut down mid-sync")

    @property
    def error(self) -> ProducerError | None:
        """The current sync's failure, if any."""
        return self._error if self._error_gen == self._gen else None

    @property
    def resident_groups(self) -> list[int]:
        with self._cond:
            return sorted(self._resident)

    # -- internals -----------------------------------------------------------

    def _release(self, group: int) -> None:
        del self._resident[group]
        self._cond.notify_all()

    def _progress(self) -> None:
        self._last_progress = time.monotonic()
        self._cond.notify_all()

    def _set_error(self, reason: str) -> None:
        if self._error is None or self._error_gen != self._gen:
            logger.error("sharded_rdt producer rank %d failed: %s", self.rank, reason)
            self._error = ProducerError(reason)
            self._error_gen = self._gen
        self._active = False
        self._resident = {}
        self._cond.notify_all()

    def _raise_if_failed(self, floor: int) -> None:
        if self._error is not None and self._error_gen >= floor:
            raise ProducerError(str(self._error))

    def _wait(
        self, ready: Callable[[], bool], what: str, floor: int | None = None
    ) -> None:
        """Wait (holding ``_cond``) until ``ready()``, raising failures of sync
        generation ``floor`` (default: the current one) or later, and failing
        the producer when nothing progresses for ``stall_timeout_s``."""
        started = time.monotonic()
        while True:
            self._raise_if_failed(self._gen if floor is None else floor)
            if ready():
                return
            now = time.monotonic()
            idle = now - max(self._last_progress, started)
            if idle >= self.settings.stall_timeout_s:
                stalled = (
                    f"producer rank {self.rank}: no progress for "
                    f"{self.settings.stall_timeout_s:.1f}s while {what}; a consumer "
                    "or a trainer rank most likely died or stalled mid-sync"
                )
                self._set_error(stalled)
                # This waiter raises its own cause: the current sync may keep
                # an earlier failure (the first one wins), which this wait,
                # for a later sync, did not raise above.
                raise ProducerError(stalled)
            self._cond.wait(min(self.settings.stall_timeout_s - idle, _POLL_S))
