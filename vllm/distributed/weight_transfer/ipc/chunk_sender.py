# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How an ``ipc`` trainer sends one sync's chunks (``ChunkSender``): each
chunk's tensors walked from the source one at a time (``_SourceCursor``),
packed into the packed buffer's half or, when they all lie in the trainer's
``SharedParameters``, named where they lie (chunks in one segment held to go
as one message), the ranks' handles shared, and the sender's
``update_weights`` call made at once or on a helper thread while the next
chunk fills (``_UpdateInFlight``). The engine hands it what it needs as
values and callables: its client (looked up at each call), trainer group,
settings, and its publication's ``attach`` and checksums."""

from __future__ import annotations

import itertools
import uuid
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    VLLMWeightSyncClient,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.buffers.dataplane import (
    ExportedBuffer,
    allocate_buffer,
    device_key,
    export_tensor,
    release_exported_cuda_memory,
    sync_device,
)
from vllm.distributed.weight_transfer.ipc.packing import (
    Chunk,
    TensorSlot,
    TransferPlan,
)
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SegmentOrder,
    SegmentPart,
    SharedParameters,
    SharedPlace,
    shared_place,
)
from vllm.distributed.weight_transfer.ipc.source_walk import _SourceCursor
from vllm.distributed.weight_transfer.ipc.upstream_wire import (
    check_upstream_device,
    upstream_unpacked_message,
    upstream_wire_handle,
)
from vllm.distributed.weight_transfer.ipc.whole_sync import (
    _SegmentsByOwner,
    _SharedInSync,
    _WholeMessage,
)
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferUpdateInfo,
    dtype_from_name,
    layout_digest,
)
from vllm.distributed.weight_transfer.trainer.group import TrainerGroup
from vllm.distributed.weight_transfer.trainer.sharded_gather import (
    gather_full_into,
    is_sharded,
)
from vllm.distributed.weight_transfer.verification import describe_error
from vllm.logger import init_logger

logger = init_logger(__name__)

Attach = Callable[[dict[str, Any], str, list[list[str | None]]], dict[str, Any]]


@dataclass(eq=False, kw_only=True)
class ChunkSender:
    """Sends one sync's chunks at a time for a trainer engine, and keeps what
    outlives a sync: the packed buffer kept between syncs
    (``keep_packed_buffer``) and the views of its slots. What it calls back
    into is given: ``on_sender(what, step)`` runs ``step`` on the sender rank
    (a failure raises on every rank), ``attach(message, what, per_rank)``
    adds the publication header, ``checksum(buf)`` and
    ``part_checksums(part)`` give payload checksums (None when off)."""

    client: Callable[[], VLLMWeightSyncClient]
    group: TrainerGroup
    rank: int
    is_sender: bool
    upstream_wire: bool
    keep_packed_buffer: bool | None
    on_sender: Callable[[str, Callable[[], Any]], Any]
    attach: Attach
    checksum: Callable[[torch.Tensor], str | None]
    part_checksums: Callable[[SegmentPart], list[str | None]]

    def __post_init__(self) -> None:
        # Sharded tensors (DTensors) whose shards were gathered straight into
        # their slot of a packed buffer, over this sender's life.
        self.gathered_into_slots = 0
        # The packed buffer kept between syncs (see ``keep_packed_buffer``);
        # whether the workers ended the last sync holding it mapped, and
        # whether the sync under way has written into it.
        self._kept_buffer: ExportedBuffer | None = None
        self._kept_mapped = self._kept_used = False
        # Views of chunks' slots in the kept buffer, for the plan they were
        # made for (``_kept_views``).
        self._views_for: TransferPlan | None = None
        self._views: dict[int, dict[int, torch.Tensor]] = {}
        # SharedParameters segments the sync under way names.
        self.shared_now = _SharedInSync(weakref.WeakKeyDictionary())
        # The whole message the sync under way sent, if it went whole.
        self.whole_now: _WholeMessage | None = None
        # Chunks in one shared segment waiting to go as one message.
        self._held: _HeldChunks | None = None
        # What ``send`` was given for the sync under way.
        self._plan: TransferPlan | None = None
        self._source: WeightSource | None = None
        self._pinned_owner: SharedParameters | None = None
        self._chunk_fields: list[dict[str, Any]] = []

    def begin(self, shared_kept: _SegmentsByOwner) -> None:
        """A sync starts; ``shared_kept``: the segments the workers may still
        hold mapped from the last one (those keep their export; any other is
        exported anew at its first use)."""
        self.shared_now = _SharedInSync(shared_kept)
        self._kept_used = False
        self.whole_now = None

    def committed(self) -> _SegmentsByOwner:
        """The sync committed: workers keep exactly the persistent buffers it
        used, which this returns (the shared segments)."""
        self._kept_mapped = self._kept_used
        return self.shared_now.used

    def send(
        self,
        plan: TransferPlan,
        cursor: _SourceCursor,
        buffers: list[ExportedBuffer],
        *,
        source: WeightSource | None,
        pinned_owner: SharedParameters | None,
        chunk_fields: list[dict[str, Any]],
    ) -> None:
        """Send every chunk of ``plan`` from ``cursor``; a packed buffer freed
        after the sync goes in ``buffers``. ``pinned_owner``: the buffer of
        a source that said nothing moved (a whole sync out of it gets a
        layout id); ``chunk_fields``: each packed chunk's fixed fields."""
        self._plan, self._source = plan, source
        self._pinned_owner, self._chunk_fields = pinned_owner, chunk_fields
        if not plan.packed:
            for chunk in plan.chunks:
                self._send_unpacked_chunk(chunk, cursor)
            cursor.finish()
            return
        in_flight = _UpdateInFlight(asynchronous=plan.overlapped)
        self._held = None
        try:
            previous: Chunk | None = None
            for chunk in plan.chunks:
                if previous is not None and chunk.overlaps(previous):
                    # The call in flight still reads these bytes.
                    self._settle(in_flight)
                self._send_packed_chunk(plan, chunk, cursor, buffers, in_flight)
                previous = chunk
            self._send_held(in_flight)
            self._settle(in_flight)
        finally:
            self._held = None
            in_flight.close()
        cursor.finish()

    def close(self) -> None:
        """Free the packed buffer kept between syncs, if any."""
        self._drop_kept_buffer()

    def _check_wire_device(self, tensor: torch.Tensor) -> None:
        """The upstream wire carries CUDA IPC handles only."""
        if self.upstream_wire:
            check_upstream_device(tensor)

    def _wire_handle(
        self,
        handle: dict[str, Any],
        key: str,
        dtype: torch.dtype = torch.uint8,
        shape: tuple[int, ...] | None = None,
    ) -> Any:
        """A rank's exported handle as this engine's wire carries it: the
        JSON object, or upstream's ``reduce_tensor`` arguments of a ``dtype``
        tensor of ``shape`` (default: the flat packed buffer)."""
        if not self.upstream_wire:
            return handle
        return upstream_wire_handle(handle, key, dtype, shape)

    def _settle(self, in_flight: _UpdateInFlight) -> None:
        """Wait for the update call in flight; every rank learns its outcome."""
        what = in_flight.what
        if what is None:
            return
        try:
            self.on_sender(what, in_flight.wait)
        finally:
            in_flight.reset()

    def _send_packed_chunk(
        self,
        plan: TransferPlan,
        chunk: Chunk,
        cursor: _SourceCursor,
        owned: list[ExportedBuffer],
        in_flight: _UpdateInFlight,
    ) -> None:
        """Fill this chunk's part of the buffer, share the handles, and hand
        the update call to ``in_flight`` once the call before it (which may
        still read the other half, never this chunk's bytes) has returned.

        A chunk whose tensors all lie in one ``SharedParameters`` segment, in
        the source's order, is not packed: its message names that segment and
        each tensor's offset in it, so the worker reads the trainer's own
        bytes (single-rank trainers, CPU or CUDA)."""
        error: str | None = None
        device: torch.device | None = None
        # Per buffer the message names, its checksum (None: checksums off).
        checksums: list[str | None] = [None]
        buffer: ExportedBuffer | None = None
        # What the message names of a ``SharedParameters``, when it reads one.
        part: SegmentPart | None = None
        # Copies from resident tensors are batched into one fused copy per dtype;
        # any other tensor is copied at once and dropped before the next one is
        # materialized.
        batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        # Tensors found in a shared segment, while every one so far was.
        in_segment: list[tuple[TensorSlot, torch.Tensor, int]] = []
        segment: SharedPlace | None = None
        may_share = self.group.world_size == 1 and not self.upstream_wire

        # The kept buffer's views of this chunk's slots, by offset, made at
        # the first sync that packed the chunk into it (None: not kept).
        views: dict[int, torch.Tensor] | None = None

        def pack(slot: TensorSlot, tensor: torch.Tensor) -> None:
            nonlocal buffer, device, views
            if buffer is None:
                # Chunks held before this one go first, and must have
                # arrived before a CUDA buffer is exported for this one: an
                # export no worker opens (the sync fails first) is never
                # released, as torch counts on the reader to let go.
                if self._held is not None:
                    self._send_held(in_flight)
                    self._settle(in_flight)
                buffer = self._packed_buffer(plan.buffer_nbytes, tensor.device, owned)
                views = self._kept_views(buffer, plan, chunk.index)
            assert buffer.tensor is not None
            device = buffer.tensor.device
            if slot.nbytes:
                dst = views.get(slot.offset) if views is not None else None
                if dst is None:
                    # (The source matches its slot: ``_check_yielded``.)
                    dst = buffer.tensor[slot.offset : slot.offset + slot.nbytes]
                    dst = dst.view(tensor.dtype).view(tensor.shape)
                    if views is not None:
                        views[slot.offset] = dst
                if is_sharded(tensor):
                    # A DTensor: its shards gathered straight into the slot
                    # when they lie there in rank order (FSDP2's layout).
                    self.gathered_into_slots += gather_full_into(dst, tensor)
                elif _is_resident(tensor):
                    dsts, srcs = batched.setdefault(tensor.dtype, ([], []))
                    dsts.append(dst)
                    srcs.append(tensor)
                else:
                    dst.copy_(tensor)

        # Where the tensors found in ``segment`` end, per segment: the wire
        # lists a buffer's tensors in increasing, non-overlapping order.
        order: SegmentOrder | None = None
        try:
            for slot in chunk.slots:
                tensor = cursor.next_unmaterialized()
                if is_sharded(tensor) and (may_share or self.upstream_wire):
                    tensor = materialize_full_tensor(tensor)
                if self.upstream_wire:
                    self._check_wire_device(tensor)
                if may_share:
                    # (Runs for every tensor of every sync: kept lean.)
                    offset: int | None = None
                    if not slot.nbytes:
                        offset = order.last_end if order is not None else None
                    elif segment is not None:
                        # Most tensors lie in the segments of the one before.
                        offset = segment.owner.locate(tensor)
                    else:
                        segment = shared_place(tensor)
                        if segment is not None:
                            offset = segment.offset
                            order = SegmentOrder(segment.owner)
                            # Synced below before the handle goes out: the
                            # trainer's last writes may still be queued.
                            device = segment.owner.device
                    if (
                        offset is not None
                        and order is not None
                        and order.fits(offset, slot.nbytes)
                    ):
                        in_segment.append((slot, tensor, offset))
                        order.add(offset, slot.nbytes)
                        continue
                    # Not all in the segments, in order: pack the chunk.
                    may_share, segment, order = False, None, None
                    for kept_slot, kept, _ in in_segment:
                        pack(kept_slot, kept)
                    in_segment.clear()
                pack(slot, tensor)
                del tensor  # the next tensor is materialized with this one gone
            for dsts, srcs in batched.values():
                torch._foreach_copy_(dsts, srcs)
            batched.clear()
            sync_device(device)
            if segment is not None and self._hold(chunk, segment, in_segment):
                # Sent together with the next chunks in the same segment.
                return
            # A chunk not held goes after the chunks held before it.
            self._send_held(in_flight)
            if segment is not None:
                part = _part_of(segment.owner, in_segment)
                checksums = self.part_checksums(part)
            elif buffer is not None and buffer.tensor is not None:
                start, end = chunk.span
                checksums = [self.checksum(buffer.tensor[start:end])]
        except Exception as e:
            error = describe_error(e)
            if self.group.world_size == 1:
                raise
        fields = self._chunk_fields[chunk.index]
        handle: Any = None
        if part is not None:
            device = part.owner.device
            fields = {**fields, **part.fields()}
            self.shared_now.use(part)
            handle = part.handles()
        elif buffer is not None:
            handle = buffer.handle.to_dict()
        in_segment.clear()
        key = device_key(device, self.rank) if device is not None else None
        payload = (key, handle, checksums) if handle is not None else None
        handles = self.group.exchange(payload, error, f"chunk {chunk.index}")
        self._settle(in_flight)
        what = f"update_weights of chunk {chunk.index}"
        if self.is_sender:
            given = [p for p in handles.values() if p is not None]
            merged = {
                k: h if isinstance(h, list) else self._wire_handle(h, k)
                for k, h, _ in given
            }
            message = self.attach(
                {**fields, "ipc_handles": merged},
                f"chunk {chunk.index}",
                [c for _, _, c in given],
            )
            in_flight.start(what, lambda: self.client().update_weights(message))
        else:
            in_flight.start(what, None)
        if not in_flight.asynchronous:
            self._settle(in_flight)

    def _hold(
        self,
        chunk: Chunk,
        place: SharedPlace,
        found: list[tuple[TensorSlot, torch.Tensor, int]],
    ) -> bool:
        """Hold a chunk whose tensors all lie in one ``SharedParameters``
        segment, to send with the chunks after it that lie in the same
        segment further on, as one message: nothing is packed, so the chunk
        cap (a packed buffer's size) does not apply, and each message costs
        the workers a round trip. Single-rank trainers only (the ones that
        read from segments); False when the chunk must go on its own."""
        if self.group.world_size != 1:
            return False
        held = self._held
        if held is not None and not held.takes(place, found):
            return False
        if held is None:
            held = self._held = _HeldChunks(place.owner, chunk.index)
        held.add(chunk.index, self._chunk_fields[chunk.index], found)
        return True

    def _send_held(self, in_flight: _UpdateInFlight) -> None:
        """Send the chunks held (``_hold``) as one message, if any."""
        held, self._held = self._held, None
        if held is None:
            return
        part = _part_of(held.owner, held.found)
        checksums = self.part_checksums(part)
        self.shared_now.use(part)
        key = device_key(held.owner.device, self.rank)
        what = f"chunks {held.first}-{held.last}"
        fields: dict[str, Any] = {
            **held.fields,
            **part.fields(),
            "ipc_handles": {key: part.handles()},
        }
        plan = self._plan
        if (
            held.owner is self._pinned_owner
            and plan is not None
            and held.first == 0
            and held.last == len(plan.chunks) - 1
        ):
            # The whole sync in one message from a source that knows when
            # nothing moved: its layout gets an id, which the next syncs
            # name, with the layout's digest, instead of repeating it
            # (``whole_sync.resend_whole``).
            layout = uuid.uuid4().hex
            fields["layout"] = layout
            whole = _WholeMessage(
                plan, self._source, held.owner, layout, layout_digest(fields), part
            )
            self.whole_now = whole
        message = self.attach(fields, what, [checksums])
        self._settle(in_flight)
        in_flight.start(
            f"update_weights of {what}", lambda: self.client().update_weights(message)
        )
        if not in_flight.asynchronous:
            self._settle(in_flight)

    def send_whole_message(self, whole: _WholeMessage) -> None:
        """The short form of ``whole``'s message, sent and waited for."""
        owner = whole.owner
        # The trainer's last writes may still be queued on the device.
        sync_device(owner.device)
        part = whole.part
        self.shared_now.use(part)
        checksums = self.part_checksums(part)
        short: dict[str, Any] = {"layout": whole.layout, "layout_digest": whole.digest}
        if part.indexes is None:
            short["ipc_handles"] = {device_key(owner.device, self.rank): part.handles()}
        # Over several segments the handles are left out: the workers read
        # the exports the layout's message named, which they still map.
        message = self.attach(short, "the whole sync", [checksums])
        self.whole_now = whole
        self.on_sender(
            "update_weights of the whole sync",
            lambda: self.client().update_weights(message),
        )

    def _packed_buffer(
        self, nbytes: int, device: torch.device, owned: list[ExportedBuffer]
    ) -> ExportedBuffer:
        """This sync's packed buffer: the one already in use or kept when it
        fits, else a new one, which is kept or put in ``owned`` (freed after
        the sync)."""
        if owned:
            return owned[0]
        keep = self.keep_packed_buffer
        if keep is None:
            keep = device.type == "cpu"
        kept = self._kept_buffer
        if kept is not None:
            assert kept.tensor is not None
            if kept.tensor.device == device and kept.tensor.numel() >= nbytes:
                if not self._kept_used:
                    # Workers that let go of it map it again: on CUDA that
                    # takes a fresh export (see ``SharedParameters``).
                    if not self._kept_mapped:
                        kept.export_anew()
                    self._kept_used = True
                return kept
            self._drop_kept_buffer()
        # A kept buffer is the same memory, written anew, at every sync:
        # workers keep it mapped (persistent) and bind their planned landing
        # to it once. Upstream's wire has no such mark.
        buffer = allocate_buffer(
            nbytes, device, persistent=keep and not self.upstream_wire
        )
        if keep:
            self._kept_buffer = buffer
            self._kept_used = True
        else:
            owned.append(buffer)
        return buffer

    def _kept_views(
        self, buffer: ExportedBuffer, plan: TransferPlan, index: int
    ) -> dict[int, torch.Tensor] | None:
        """The views of chunk ``index``'s slots in the kept ``buffer`` made so
        far (slot offset -> typed view), while ``plan`` (the same tensors at
        the same offsets) is the one they were made for; None for a buffer
        freed after the sync. Saves building a view per tensor per sync."""
        if buffer is not self._kept_buffer:
            return None
        if self._views_for is not plan:
            self._views_for, self._views = plan, {}
        return self._views.setdefault(index, {})

    def _drop_kept_buffer(self) -> None:
        """Free the kept packed buffer; the next sync writes into a new one."""
        self._views_for, self._views = None, {}
        self._kept_mapped = self._kept_used = False
        buffer, self._kept_buffer = self._kept_buffer, None
        if buffer is not None:
            buffer.close()
            release_exported_cuda_memory()

    def _send_unpacked_chunk(self, chunk: Chunk, cursor: _SourceCursor) -> None:
        error: str | None = None
        exported: list[ExportedBuffer] = []
        payload: list[tuple[str, dict, str | None]] = []
        try:
            try:
                for _ in chunk.slots:
                    tensor = cursor.next()
                    self._check_wire_device(tensor)
                    buf = export_tensor(tensor)
                    exported.append(buf)
                    payload.append(
                        (
                            device_key(tensor.device, self.rank),
                            buf.handle.to_dict(),
                            self.checksum(_bytes_of(tensor)),
                        )
                    )
                    del tensor
                sync_device(next((t.device for t in _owned(exported)), None))
            except Exception as e:
                error = describe_error(e)
                if self.group.world_size == 1:
                    raise
            per_rank = self.group.exchange(payload, error, f"chunk {chunk.index}")

            def send() -> None:
                merged: list[dict[str, Any]] = [{} for _ in chunk.slots]
                for rank_payload in per_rank.values():
                    for i, (key, handle, _) in enumerate(rank_payload):
                        slot = chunk.slots[i]
                        dtype = dtype_from_name(slot.dtype_name, slot.name)
                        merged[i][key] = self._wire_handle(
                            handle, key, dtype, slot.shape
                        )
                message = _unpacked_chunk_message(chunk, merged, self.upstream_wire)
                sums = [[c for _, _, c in p] for p in per_rank.values()]
                self.client().update_weights(
                    self.attach(message, f"chunk {chunk.index}", sums)
                )

            self.on_sender(f"update_weights of chunk {chunk.index}", send)
        finally:
            for buf in exported:
                buf.close()


class _HeldChunks:
    """Chunks held to travel as one message: all their tensors lie in
    ``owner``'s segments, at increasing offsets within each
    (``ChunkSender._hold``)."""

    def __init__(self, owner: SharedParameters, first: int) -> None:
        self.owner = owner
        self.first = self.last = first
        self.fields: dict[str, list[Any]] = {}
        self.found: list[tuple[TensorSlot, torch.Tensor, int]] = []
        self.order = SegmentOrder(owner)

    def takes(
        self, place: SharedPlace, found: list[tuple[TensorSlot, torch.Tensor, int]]
    ) -> bool:
        """Whether a chunk in ``place`` can join: the same segments, and in
        each its tensors after the ones held there (the wire lists a
        buffer's tensors in increasing, non-overlapping order). Nothing is
        counted in here; ``add`` does that."""
        if place.owner is not self.owner:
            return False
        return self.order.fits_all([(offset, slot.nbytes) for slot, _, offset in found])

    def add(
        self,
        index: int,
        fields: dict[str, Any],
        found: list[tuple[TensorSlot, torch.Tensor, int]],
    ) -> None:
        self.last = index
        for name, values in fields.items():
            if name != "offsets":  # each tensor's place: ``_send_held``
                self.fields.setdefault(name, []).extend(values)
        self.found.extend(found)
        for slot, _, offset in found:
            self.order.add(offset, slot.nbytes)


class _UpdateInFlight:
    """The sender's ``update_weights`` call of one chunk, at most one at a
    time: run at once (``asynchronous=False``) or on a helper thread, so the
    trainer fills the next chunk's buffer meanwhile. Every rank records the
    call's name (``what``; non-senders with no call) so that all ranks settle
    the same calls in the same order."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.what: str | None = None
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="ipc-update")
            if asynchronous
            else None
        )
        self._future: Future[None] | None = None
        self._error: BaseException | None = None

    def start(self, what: str, call: Callable[[], None] | None) -> None:
        assert self.what is None, f"{self.what} is still in flight"
        self.what = what
        if call is None:
            return
        if self._pool is not None:
            self._future = self._pool.submit(call)
            return
        try:
            call()
        except BaseException as e:
            self._error = e

    def wait(self) -> None:
        """Wait for the call in flight; raise its error. The client bounds
        every call it makes with its own timeout."""
        future, error = self._future, self._error
        self._future = self._error = None
        if future is not None:
            future.result()
        if error is not None:
            raise error

    def reset(self) -> None:
        self.what = None
        self._future = self._error = None

    def close(self) -> None:
        """Wait out a call still in flight (after a failure elsewhere), so it
        never overlaps the abort that follows."""
        future, self._future = self._future, None
        if future is not None:
            try:
                future.result()
            except BaseException as e:
                logger.debug("ipc: %s failed after an earlier error: %s", self.what, e)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 tensor on its device."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _is_resident(tensor: torch.Tensor) -> bool:
    """True when holding ``tensor`` costs no memory: it is a parameter, or a view
    of one, that lives on whether or not this engine keeps a reference."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(
        tensor._base, torch.nn.Parameter
    )


def _part_of(
    owner: SharedParameters, found: list[tuple[TensorSlot, torch.Tensor, int]]
) -> SegmentPart:
    """What a message of the tensors ``found`` in ``owner`` names: segments,
    offsets in them, and the bytes each checksum covers."""
    return owner.message_part([(offset, slot.nbytes) for slot, _, offset in found])


def _packed_chunk_fields(chunk: Chunk, offsets: bool = True) -> dict[str, Any]:
    """The handle-independent fields of a packed chunk's update message, built
    once per plan and shared read-only by every send. The worker validates them
    (``IPCWeightTransferUpdateInfo``); the plan is valid by construction.
    Without ``offsets`` (upstream's wire) the worker reads the tensors back to
    back from the buffer's start, which the plan must then be."""
    fields: dict[str, Any] = {
        "names": chunk.names,
        "dtype_names": [s.dtype_name for s in chunk.slots],
        "shapes": [list(s.shape) for s in chunk.slots],
        "tensor_sizes": [s.nbytes for s in chunk.slots],
    }
    if offsets:
        fields["offsets"] = [s.offset for s in chunk.slots]
    else:
        sizes = [s.nbytes for s in chunk.slots]
        starts = [0, *itertools.accumulate(sizes)][: len(sizes)]
        assert [s.offset for s in chunk.slots] == starts, "plan is not back to back"
    return fields


def _unpacked_chunk_message(
    chunk: Chunk, handles: list[dict[str, Any]], upstream_wire: bool
) -> dict[str, Any]:
    """The update message of an unpacked chunk: one handle map per tensor.
    Upstream's wire has no ``tensor_sizes`` here (the handles carry them)."""
    if upstream_wire:
        return upstream_unpacked_message(
            chunk.names,
            [s.dtype_name for s in chunk.slots],
            [list(s.shape) for s in chunk.slots],
            handles,
        )
    return IPCWeightTransferUpdateInfo(
        names=chunk.names,
        dtype_names=[s.dtype_name for s in chunk.slots],
        shapes=[list(s.shape) for s in chunk.slots],
        ipc_handles=handles,
        tensor_sizes=[s.nbytes for s in chunk.slots],
    ).to_dict()


def _owned(buffers: list[ExportedBuffer]) -> Iterator[torch.Tensor]:
    for buf in buffers:
        owner = buf._owner
        if isinstance(owner, torch.Tensor):
            yield owner
