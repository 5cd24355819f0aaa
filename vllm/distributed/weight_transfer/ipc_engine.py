# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` weight-transfer backend: a trainer on the same host as the vLLM
workers shares its weights' bytes with them in place, chunk by chunk.

Data planes (chosen from the device of the tensors the source yields):
CUDA tensors travel through CUDA IPC, CPU tensors through POSIX shared memory,
so vLLM CPU workers receive updates too. Wire format, device keys and rejection
rules: ``ipc_wire``. Chunk planning: ``ipc_packing``.

Protocol of ``IPCTrainerWeightTransferEngine.send_weights()`` (every trainer
rank calls it; the rank with ``init_info.rank == 0`` is the sender)::

    plan = plan_transfer(source.metadata())       # before any tensor exists
    sender: pub = TrainerPublication.open(...)    ; ranks share their devices
    sender: client.start_weight_update()          ; all ranks agree
    for chunk in plan.chunks:
        every rank: materialize the chunk's tensors one at a time (checking
            each against the metadata), copy each into the chunk's buffer,
            drop it; the next tensor is not requested before the chunk is sent
        all ranks exchange handles (a barrier)    ; sender merges them by device
        sender: wait for the previous chunk's update_weights ; all ranks agree
        sender: client.update_weights(pub.attach(chunk info, checksums))
            ; without overlap it is waited for here; with overlap it runs on
            a helper thread while every rank fills the next chunk into the
            other half of the buffer. Either way no rank overwrites bytes its
            colocated worker still reads: a chunk that shares bytes with the
            one in flight waits for that call (and its barrier) first
    sender: client.finish_weight_update()         ; all ranks agree
    sender: pub.verify(every worker's receipt), then
            client.update_weight_version(weight_version) ; all ranks agree

Packed mode (the default) reuses one buffer per trainer rank for every chunk,
sized from the metadata: the model's aligned size capped at
``packed_buffer_size_bytes``, but at least the largest tensor. With
``overlap_chunks`` (default on) a model larger than the buffer travels in
chunks that alternate between the buffer's two halves, so packing overlaps the
workers' loading; a tensor larger than half the buffer travels alone. CPU
buffers are kept from one sync to the next (``keep_packed_buffer``). Unpacked mode
exports each tensor separately and keeps every exported tensor alive until all
workers have read it (the barrier after its chunk).

The worker lands each chunk through ``LayerwiseReloadSession``
(``layerwise_session``): start -> load per chunk -> finish, so fused and
quantized layers are processed after loading. It maps each buffer once per
update and releases it at finish.

Verified publication (``verified_sync``, on by default): the sender opens a
``TrainerPublication`` whose header rides in every update message; each worker
checks the header's manifest against the served checkpoint's shapes and every
tensor against the manifest before it touches a weight, and writes a receipt
at finish into a shared-memory directory the trainer reads. ``send_weights``
returns only after every worker's receipt was verified, and only then stamps
``weight_version``; on any failure it sets the served version to
``fenced:<publication id>: <reason>`` and re-raises. With
``verify_checksums=True`` every rank checksums each chunk it exported, the
sender checks that the ranks agree, and each worker checksums the bytes it
mapped before loading them. A worker whose weights were touched by a failed
update is fenced: it refuses ``update_weights`` and ``finish_weight_update``
until a full resync completes. See ``docs/training/weight_transfer/
verification.md``.

Failures: a malformed update is rejected with ``ValueError`` before any weight
is touched. Any failure inside ``update_weights`` puts every layer that did not
complete back on its resident weights before re-raising, so the server keeps
serving. When the trainer fails after ``start_weight_update`` it sends
``{"abort": reason}`` and then finishes, with the same effect. Waits among
trainer ranks are bounded by ``timeout_s`` (or the caller's group timeout); the
HTTP and Ray clients bound every call to the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.checkpoint_structure import (
    Shapes,
    check_manifest_dtypes,
    check_manifest_shapes,
    checkpoint_dtype_kinds,
    checkpoint_shapes,
    module_dtype_kinds,
)
from vllm.distributed.weight_transfer.checksum import payload_checksum
from vllm.distributed.weight_transfer.fencing import (
    WeightsFencedError,
    WeightState,
    fenced_message,
    set_served_version,
)
from vllm.distributed.weight_transfer.full_resync import FullResyncTrainerEngine
from vllm.distributed.weight_transfer.ipc_dataplane import (
    BufferImporter,
    ExportedBuffer,
    allocate_buffer,
    device_key,
    export_tensor,
    release_exported_cuda_memory,
)
from vllm.distributed.weight_transfer.ipc_packing import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_CAP_BYTES,
    Chunk,
    TransferPlan,
    plan_transfer,
)
from vllm.distributed.weight_transfer.ipc_wire import (
    ABORT_FIELD,
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
    abort_reason,
    dtype_name,
)
from vllm.distributed.weight_transfer.layerwise_session import (
    LayerwiseReloadSession,
)
from vllm.distributed.weight_transfer.publication import describe_error
from vllm.distributed.weight_transfer.receipts import DEFAULT_RECEIPT_TIMEOUT_S
from vllm.distributed.weight_transfer.stale_updates import start_update
from vllm.distributed.weight_transfer.trainer_group import (
    TrainerGroup,
    make_trainer_group,
)
from vllm.distributed.weight_transfer.verified_sync import (
    TrainerPublication,
    WorkerPublication,
    device_identity,
    served_world_size,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

DEFAULT_PACKED_BUFFER_SIZE_BYTES = DEFAULT_BUFFER_CAP_BYTES
DEFAULT_TIMEOUT_S = 300.0

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "IPCTrainerInitInfo",
    "IPCTrainerWeightTransferEngine",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
]


# ---------------------------------------------------------------------------
# trainer side


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the ``ipc`` backend (never sent as is).

    ``packed`` and ``packed_buffer_size_bytes`` keep upstream's names; packing
    is on by default and the size is a cap (see ``ipc_packing``). The others
    are optional: ``process_group`` is the group of colocated trainer ranks
    (default: all ranks of torch.distributed, over a new gloo group),
    ``timeout_s`` bounds every wait among them, ``alignment_bytes`` aligns each
    tensor in the packed buffer.

    Verified publication: ``verify_publication`` (default on) sends a
    publication header and waits for every worker's receipt; turn it off only
    for a server whose ipc workers do not understand the header.
    ``verify_checksums`` adds payload checksums. ``model_version`` is the first
    publication's model version (then one more per send); without it, the
    version is the wall clock in microseconds (at least one more than the last),
    so a new trainer engine, or one resumed from an older checkpoint, still
    publishes a version the workers accept. ``weight_version`` stays a label:
    RL steps can repeat after a resume, and workers refuse versions that go
    backwards. ``receipt_timeout_s`` bounds the wait for receipts after
    ``finish_weight_update`` returned.

    ``keep_packed_buffer`` keeps the packed buffer from one ``send_weights``
    to the next instead of freeing it after each sync; ``shutdown()`` frees
    it. The default (``None``) keeps shared-memory buffers, whose pages cost
    more to create than to fill, and frees GPU buffers, so a colocated engine
    gets that memory back between syncs.

    ``overlap_chunks`` (default on) lets chunks alternate between the packed
    buffer's two halves when the model spans several chunks: the trainer
    fills one half while the workers load the other, with at most one
    ``update_weights`` call in flight (made from a helper thread). A tensor
    larger than half the buffer travels alone and waits for the call before
    it. The buffer is the same size either way.
    """

    backend: ClassVar[str] = "ipc"
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    alignment_bytes: int = DEFAULT_ALIGNMENT
    process_group: Any = field(default=None, repr=False, compare=False)
    verify_publication: bool = True
    verify_checksums: bool = False
    model_version: int | None = None
    receipt_timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S
    keep_packed_buffer: bool | None = None
    overlap_chunks: bool = True

    def __post_init__(self) -> None:
        if self.packed_buffer_size_bytes <= 0:
            raise ValueError(
                "IPCTrainerInitInfo.packed_buffer_size_bytes must be positive, "
                f"got {self.packed_buffer_size_bytes}"
            )
        if self.timeout_s <= 0:
            raise ValueError(
                f"IPCTrainerInitInfo.timeout_s must be positive, got {self.timeout_s}"
            )
        if self.verify_checksums and not self.verify_publication:
            raise ValueError(
                "IPCTrainerInitInfo.verify_checksums needs verify_publication=True: "
                "checksums travel in the publication header"
            )
        if self.model_version is not None and self.model_version < 0:
            raise ValueError(
                "IPCTrainerInitInfo.model_version must be >= 0, got "
                f"{self.model_version}"
            )
        if self.receipt_timeout_s <= 0:
            raise ValueError(
                "IPCTrainerInitInfo.receipt_timeout_s must be positive, got "
                f"{self.receipt_timeout_s}"
            )


def _check_yielded(meta: ParamMeta, name: str, tensor: Any) -> torch.Tensor:
    """``tensor`` as the metadata announced it, or ValueError naming it."""
    if name != meta.name:
        raise ValueError(
            f"WeightSource yielded {name!r} where metadata() announced "
            f"{meta.name!r}; iteration must follow metadata() order"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"WeightSource yielded {type(tensor).__name__} for {name!r}, not a tensor"
        )
    if tensor.dtype != meta.dtype:
        raise ValueError(
            f"WeightSource yielded {name!r} as {dtype_name(tensor.dtype)} but "
            f"metadata() says {dtype_name(meta.dtype)}"
        )
    if tuple(tensor.shape) != tuple(meta.shape):
        raise ValueError(
            f"WeightSource yielded {name!r} with shape {list(tensor.shape)} but "
            f"metadata() says {list(meta.shape)}"
        )
    return tensor


class _SourceCursor:
    """Walks a source in metadata order, one tensor alive at a time."""

    def __init__(self, source: WeightSource, metas: list[ParamMeta]) -> None:
        self._it: Iterator[tuple[str, torch.Tensor]] = iter(source)
        self._metas = metas
        self._index = 0

    def next(self) -> torch.Tensor:
        meta = self._metas[self._index]
        try:
            name, tensor = next(self._it)
        except StopIteration:
            raise ValueError(
                f"WeightSource stopped before {meta.name!r}; metadata() announced "
                f"{len(self._metas)} tensors, iteration gave {self._index}"
            ) from None
        self._index += 1
        return _check_yielded(meta, name, tensor)

    def finish(self) -> None:
        try:
            name, _ = next(self._it)
        except StopIteration:
            return
        raise ValueError(
            f"WeightSource yielded {name!r} after the {len(self._metas)} tensors "
            "metadata() announced"
        )


def _sync_device(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class IPCTrainerWeightTransferEngine(FullResyncTrainerEngine[IPCTrainerInitInfo]):
    """Trainer side of the ``ipc`` backend; see the module docstring."""

    init_info_cls = IPCTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        rank: int | None = None,
        group: TrainerGroup | None = None,
        alignment_bytes: int = DEFAULT_ALIGNMENT,
        verify_publication: bool = True,
        verify_checksums: bool = False,
        model_version: int | None = None,
        receipt_timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
        keep_packed_buffer: bool | None = None,
        overlap_chunks: bool = True,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.rank = rank if rank is not None else (0 if is_sender else 1)
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.alignment_bytes = alignment_bytes
        self.group: TrainerGroup = group or make_trainer_group(self.rank)
        self.last_plan: TransferPlan | None = None
        self._plan_cache: tuple[tuple, TransferPlan] | None = None
        self._chunk_fields: list[dict[str, Any]] = []
        self.verify_publication = verify_publication
        self.verify_checksums = verify_checksums and verify_publication
        self.receipt_timeout_s = receipt_timeout_s
        self._next_version = model_version
        self._explicit_version = model_version is not None
        # The publication being sent (sender only), and the last one verified.
        self._pub: TrainerPublication | None = None
        self.last_publication: TrainerPublication | None = None
        self.keep_packed_buffer = keep_packed_buffer
        self.overlap_chunks = overlap_chunks
        # The packed buffer kept between syncs (see ``keep_packed_buffer``).
        self._kept_buffer: ExportedBuffer | None = None

    @classmethod
    def from_init_info(
        cls,
        init_info: IPCTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> Self:
        group = make_trainer_group(
            init_info.rank, init_info.process_group, init_info.timeout_s
        )
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            rank=init_info.rank,
            group=group,
            alignment_bytes=init_info.alignment_bytes,
            verify_publication=init_info.verify_publication,
            verify_checksums=init_info.verify_checksums,
            model_version=init_info.model_version,
            receipt_timeout_s=init_info.receipt_timeout_s,
            keep_packed_buffer=init_info.keep_packed_buffer,
            overlap_chunks=init_info.overlap_chunks,
        )
        if engine.is_sender and init_info.verify_publication:
            missing = [
                m
                for m in ("get_world_size", "update_weight_version")
                if not callable(getattr(client, m, None))
            ]
            if missing and init_info.verify_checksums:
                raise TypeError(
                    f"{type(client).__name__} has no {' or '.join(missing)}, which "
                    "verify_checksums needs (a receipt from every worker, and the "
                    "version set once they verified); use a client from "
                    "vllm.distributed.weight_transfer.clients"
                )
            if missing:
                # A client written against upstream's four-method protocol still
                # works; it gets upstream's guarantees, not verified publication.
                logger.warning(
                    "ipc: %s has no %s, so this trainer sends without verified "
                    "publication (no receipts, version set at finish). Use a "
                    "client from vllm.distributed.weight_transfer.clients to "
                    "verify every sync.",
                    type(client).__name__,
                    " or ".join(missing),
                )
                engine.verify_publication = engine.verify_checksums = False
        error = None
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine({"packed": init_info.packed})
            except Exception as e:
                error = f"init_weight_transfer_engine: {e}"
                if group.world_size == 1:
                    raise
        # Every rank follows the sender's choice, which depends on its client.
        flags = group.exchange(
            engine.verify_publication if engine.is_sender else None,
            error,
            "init_weight_transfer_engine",
        )
        if False in flags.values():
            engine.verify_publication = engine.verify_checksums = False
        return engine

    # -- send ----------------------------------------------------------------

    def send_weights(self, weight_version: str | None = None) -> None:
        """Push the source's current weights; see the module docstring.

        ``weight_version``, if given, becomes the server's weight version once
        every worker's receipt is verified (at finish when verification is
        off).
        """
        assert self.source is not None
        metas = list(self.source.metadata())
        plan = self._plan_for(metas)
        self.last_plan = plan
        pub = self._open_publication(metas)
        try:
            error = self._on_sender(
                "start_weight_update",
                lambda: start_update(self.client, f"ipc trainer rank {self.rank}"),
            )
            self.group.exchange(None, error, "start_weight_update")
            buffers: list[ExportedBuffer] = []
            try:
                try:
                    self._send_chunks(plan, metas, buffers)
                    if pub is not None or weight_version is None:
                        error = self._call_server("finish_weight_update")
                    else:
                        error = self._call_server(
                            "finish_weight_update", weight_version
                        )
                    self.group.exchange(None, error, "finish_weight_update")
                except BaseException as e:
                    # Also after a failed finish: vLLM's Worker keeps the update
                    # open until an engine call raises or a finish returns.
                    self._abort_on_server(
                        f"trainer rank {self.rank}: {describe_error(e)}"
                    )
                    # A worker that timed out may still be reading the kept
                    # buffer; the next sync writes into a new one.
                    self._drop_kept_buffer()
                    raise
            finally:
                # Workers release their mappings at finish; only then is the
                # packed buffer dropped, so CUDA can reclaim it at once.
                for buffer in buffers:
                    buffer.close()
                release_exported_cuda_memory()
            if self.verify_publication:
                error = self._on_sender(
                    "verify receipts", lambda: self._commit(weight_version)
                )
                self.group.exchange(None, error, "verify receipts")
        except BaseException as e:
            if pub is not None:
                pub.fail(self.client, e)
            raise
        finally:
            self._pub = None
            if pub is not None:
                pub.close()

    def _open_publication(self, metas: list[ParamMeta]) -> TrainerPublication | None:
        """Gather every rank's device; the sender opens the publication."""
        if not self.verify_publication:
            return None
        devices = self.group.exchange(_trainer_device(), None, "publication")
        version = self._model_version()
        if not self.is_sender:
            return None
        self._pub = TrainerPublication.open(
            backend="ipc",
            model_version=version,
            metas=metas,
            channel="shm",
            checksums=self.verify_checksums,
            trainer_devices=[devices[r] for r in sorted(devices)],
        )
        return self._pub

    def _model_version(self) -> int:
        if self._explicit_version:
            assert self._next_version is not None
            version = self._next_version
        else:
            version = max(time.time_ns() // 1000, self._next_version or 0)
        self._next_version = version + 1
        return version

    def _commit(self, weight_version: str | None) -> None:
        """Verify every worker's receipt, then make the version visible."""
        pub = self._pub
        assert pub is not None
        workers = served_world_size(self.client)
        # One engine: its workers are ranks 0..n-1. Several engines behind one
        # client (a Ray client over several actors) each number their workers
        # from 0, so the trainer waits for that many distinct workers instead.
        engines = len(getattr(self.client, "handles", None) or [self.client])
        expected: range | int = range(workers) if engines == 1 else workers
        pub.verify(expected, timeout_s=self.receipt_timeout_s)
        self.last_publication = pub
        if weight_version is not None:
            set_served_version(self.client, weight_version)

    def _plan_for(self, metas: list[ParamMeta]) -> TransferPlan:
        """The transfer plan of ``metas``, reused while the metadata is unchanged."""
        key = tuple((m.name, m.dtype, tuple(m.shape)) for m in metas)
        if self._plan_cache is None or self._plan_cache[0] != key:
            plan = plan_transfer(
                metas,
                packed=self.packed,
                buffer_cap_bytes=self.packed_buffer_size_bytes,
                alignment=self.alignment_bytes,
                overlap=self.overlap_chunks,
            )
            self._plan_cache = (key, plan)
            self._chunk_fields = [_packed_chunk_fields(c) for c in plan.chunks]
        return self._plan_cache[1]

    def _call_server(self, method: str, *args: Any) -> str | None:
        """Run a client call on the sender; return its failure as text so every
        rank learns of it (a single-process trainer raises it directly)."""
        return self._on_sender(method, lambda: getattr(self.client, method)(*args))

    def _on_sender(self, what: str, step: Any) -> str | None:
        """Run ``step()`` on the sender; its failure as text (see _call_server)."""
        if not self.is_sender:
            return None
        if self.group.world_size == 1:
            step()
            return None
        try:
            step()
        except Exception as e:
            logger.error("ipc weight transfer: %s failed: %s", what, e)
            return f"{what}: {e}"
        return None

    def _checksum(self, buf: torch.Tensor) -> str | None:
        """The payload checksum of ``buf`` (1-D bytes) when checksums are on."""
        if not self.verify_checksums:
            return None
        if self._pub is not None:
            return self._pub.checksum(buf)
        return payload_checksum(buf)

    def _attach(
        self, message: dict[str, Any], what: str, per_rank: list[list[str | None]]
    ) -> dict[str, Any]:
        """``message`` with the publication header and, when checksums are on,
        one checksum per buffer; every rank must have exported equal bytes."""
        if self._pub is None:
            return message
        sums: list[str | None] = []
        for i, rank_sums in enumerate(zip(*per_rank, strict=True)):
            if len(set(rank_sums)) > 1:
                raise ValueError(
                    f"trainer ranks exported different bytes for buffer {i} of "
                    f"{what} (checksums {list(rank_sums)}); every rank must send "
                    "the same weights"
                )
            sums.append(rank_sums[0])
        return self._pub.attach(message, checksums=sums if self._pub.checksums else ())

    def _abort_on_server(self, reason: str) -> None:
        """Best effort: leave the server serving its previous weights."""
        if not self.is_sender:
            return
        for method, args in (
            ("update_weights", ({ABORT_FIELD: reason[:2000]},)),
            ("finish_weight_update", ()),
        ):
            try:
                getattr(self.client, method)(*args)
            except Exception as e:  # the server may have aborted on its own
                logger.debug("ipc abort: %s raised %s", method, e)

    def _send_chunks(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        buffers: list[ExportedBuffer],
    ) -> None:
        """Send every chunk; a packed buffer freed after the sync goes in
        ``buffers``."""
        assert self.source is not None
        cursor = _SourceCursor(self.source, metas)
        if not plan.packed:
            for chunk in plan.chunks:
                self._send_unpacked_chunk(chunk, cursor)
            cursor.finish()
            return
        in_flight = _UpdateInFlight(asynchronous=plan.overlapped)
        try:
            previous: Chunk | None = None
            for chunk in plan.chunks:
                if previous is not None and chunk.overlaps(previous):
                    # The call in flight still reads these bytes.
                    self._settle(in_flight)
                self._send_packed_chunk(plan, chunk, cursor, buffers, in_flight)
                previous = chunk
            self._settle(in_flight)
        finally:
            in_flight.close()
        cursor.finish()

    def _settle(self, in_flight: _UpdateInFlight) -> None:
        """Wait for the update call in flight; every rank learns its outcome."""
        what = in_flight.what
        if what is None:
            return
        error = self._on_sender(what, in_flight.wait)
        in_flight.reset()
        self.group.exchange(None, error, what)

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
        still read the other half, never this chunk's bytes) has returned."""
        error: str | None = None
        device: torch.device | None = None
        checksum: str | None = None
        buffer: ExportedBuffer | None = None
        # Copies from resident tensors are batched into one fused copy per dtype;
        # any other tensor is copied at once and dropped before the next one is
        # materialized.
        batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        try:
            for slot in chunk.slots:
                tensor = cursor.next()
                if buffer is None:
                    buffer = self._packed_buffer(
                        plan.buffer_nbytes, tensor.device, owned
                    )
                assert buffer.tensor is not None
                device = buffer.tensor.device
                if slot.nbytes:
                    dst = buffer.tensor[slot.offset : slot.offset + slot.nbytes]
                    dst = dst.view(tensor.dtype).view(tensor.shape)
                    if _is_resident(tensor):
                        dsts, srcs = batched.setdefault(tensor.dtype, ([], []))
                        dsts.append(dst)
                        srcs.append(tensor)
                    else:
                        dst.copy_(tensor)
                del tensor  # the next tensor is materialized with this one gone
            for dsts, srcs in batched.values():
                torch._foreach_copy_(dsts, srcs)
            batched.clear()
            _sync_device(device)
            if buffer is not None and buffer.tensor is not None:
                start, end = chunk.span
                checksum = self._checksum(buffer.tensor[start:end])
        except Exception as e:
            error = describe_error(e)
            if self.group.world_size == 1:
                raise
        key = device_key(device, self.rank) if device is not None else None
        payload = (
            (key, buffer.handle.to_dict(), checksum) if buffer is not None else None
        )
        handles = self.group.exchange(payload, error, f"chunk {chunk.index}")
        self._settle(in_flight)
        what = f"update_weights of chunk {chunk.index}"
        if self.is_sender:
            given = [p for p in handles.values() if p is not None]
            merged = {k: h for k, h, _ in given}
            message = self._attach(
                {**self._chunk_fields[chunk.index], "ipc_handles": merged},
                f"chunk {chunk.index}",
                [[c] for _, _, c in given],
            )
            in_flight.start(what, lambda: self.client.update_weights(message))
        else:
            in_flight.start(what, None)
        if not in_flight.asynchronous:
            self._settle(in_flight)

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
                return kept
            self._drop_kept_buffer()
        buffer = allocate_buffer(nbytes, device)
        if keep:
            self._kept_buffer = buffer
        else:
            owned.append(buffer)
        return buffer

    def _drop_kept_buffer(self) -> None:
        buffer, self._kept_buffer = self._kept_buffer, None
        if buffer is not None:
            buffer.close()
            release_exported_cuda_memory()

    def shutdown(self) -> None:
        """Free the packed buffer kept between syncs, if any."""
        self._drop_kept_buffer()

    def _send_unpacked_chunk(self, chunk: Chunk, cursor: _SourceCursor) -> None:
        error: str | None = None
        exported: list[ExportedBuffer] = []
        payload: list[tuple[str, dict, str | None]] = []
        try:
            try:
                for _ in chunk.slots:
                    tensor = cursor.next()
                    buf = export_tensor(tensor)
                    exported.append(buf)
                    payload.append(
                        (
                            device_key(tensor.device, self.rank),
                            buf.handle.to_dict(),
                            self._checksum(_bytes_of(tensor)),
                        )
                    )
                    del tensor
                _sync_device(next((t.device for t in _owned(exported)), None))
            except Exception as e:
                error = describe_error(e)
                if self.group.world_size == 1:
                    raise
            per_rank = self.group.exchange(payload, error, f"chunk {chunk.index}")
            error = None
            if self.is_sender:
                merged: list[dict[str, dict]] = [{} for _ in chunk.slots]
                for rank_payload in per_rank.values():
                    for i, (key, handle, _) in enumerate(rank_payload):
                        merged[i][key] = handle
                info = IPCWeightTransferUpdateInfo(
                    names=chunk.names,
                    dtype_names=[s.dtype_name for s in chunk.slots],
                    shapes=[list(s.shape) for s in chunk.slots],
                    ipc_handles=merged,
                    tensor_sizes=[s.nbytes for s in chunk.slots],
                )
                sums = [[c for _, _, c in p] for p in per_rank.values()]
                error = self._on_sender(
                    f"update_weights of chunk {chunk.index}",
                    lambda: self.client.update_weights(
                        self._attach(info.to_dict(), f"chunk {chunk.index}", sums)
                    ),
                )
            self.group.exchange(None, error, f"update_weights of chunk {chunk.index}")
        finally:
            for buf in exported:
                buf.close()


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


def _trainer_device() -> str:
    """This trainer rank's device identity (its current GPU, else the process)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return device_identity(torch.device("cuda", torch.cuda.current_device()))
    return device_identity("cpu")


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 tensor on its device."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _is_resident(tensor: torch.Tensor) -> bool:
    """True when holding ``tensor`` costs no memory: it is a parameter, or a view
    of one, that lives on whether or not this engine keeps a reference."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(
        tensor._base, torch.nn.Parameter
    )


def _packed_chunk_fields(chunk: Chunk) -> dict[str, Any]:
    """The handle-independent fields of a packed chunk's update message, built
    once per plan and shared read-only by every send. The worker validates them
    (``IPCWeightTransferUpdateInfo``); the plan is valid by construction."""
    return {
        "names": chunk.names,
        "dtype_names": [s.dtype_name for s in chunk.slots],
        "shapes": [list(s.shape) for s in chunk.slots],
        "tensor_sizes": [s.nbytes for s in chunk.slots],
        "offsets": [s.offset for s in chunk.slots],
    }


def _owned(buffers: list[ExportedBuffer]) -> Iterator[torch.Tensor]:
    for buf in buffers:
        owner = buf._owner
        if isinstance(owner, torch.Tensor):
            yield owner


# ---------------------------------------------------------------------------
# worker side


class IPCWeightTransferEngine(
    WeightTransferEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]
):
    """Worker side of the ``ipc`` backend; see the module docstring."""

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.packed = False
        self._session: LayerwiseReloadSession | None = None
        self._importer: BufferImporter | None = None
        # Device keys this worker read in the current or last update
        # (diagnostics: which trainer rank's buffers fed this worker).
        self.last_update_keys: set[str] = set()
        # Created on first use: naming the device queries it (a GPU's UUID),
        # and constructing the engine must not touch the device.
        self._pub: WorkerPublication | None = None
        # Set once a weight of the open update was handed to the loader.
        self._loaded = False
        # Set by an abort message until the finish that closes the update.
        self._aborted = False

    @property
    def pub(self) -> WorkerPublication:
        """This worker's publication state (verified publication, fencing)."""
        if self._pub is None:
            self._pub = WorkerPublication(
                backend="ipc",
                worker_rank=_worker_rank(self.vllm_config),
                worker_device=device_identity(self.device),
            )
        return self._pub

    # -- parsing ---------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> IPCWeightTransferInitInfo:
        return IPCWeightTransferInitInfo.from_dict(init_dict)

    def parse_update_info(
        self, update_dict: dict[str, Any]
    ) -> IPCWeightTransferUpdateInfo:
        return IPCWeightTransferUpdateInfo.from_dict(update_dict)

    # -- lifecycle -------------------------------------------------------------

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        self.packed = init_info.packed

    def start_weight_update(self) -> None:
        if self._session is not None and self._session.is_open:
            self._session.abort()
        self._release()
        self.last_update_keys = set()
        self.pub.start()
        self._loaded = False
        self._aborted = False
        session = LayerwiseReloadSession(
            self.model,
            self.model_config,
            on_abort=self._session_aborted,
            timeout_s=getattr(self.config, "update_timeout_s", None),
        )
        session.start()
        self._session = session

    def _session_aborted(self, reason: str, landed: bool) -> None:
        """The session aborted itself (a forward pass during landing)."""
        self.pub.fail(reason, weights_intact=not (landed and self._loaded))

    @property
    def fence_status(self) -> dict[str, Any]:
        """The worker's update state (``FenceStatus.to_dict``), for diagnostics."""
        return self.pub.fence.status.to_dict()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        reason = abort_reason(update_info)
        if reason is not None:
            self._close_aborted(reason)
            return
        self._refuse_if_fenced()
        try:
            checker = self.pub.checker
            update_info = self.pub.begin_message(update_info)
            if self.pub.checker is not checker and self.pub.header is not None:
                self._check_against_checkpoint()
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as e:
            self.pub.fail(e, weights_intact=not self._loaded)
            self._abort()
            if isinstance(e, Exception) and not str(e).strip():
                # The server returns the message to the trainer; never a blank.
                raise RuntimeError(
                    f"ipc update_weights failed: {describe_error(e)}"
                ) from e
            raise

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        if self._session is None or not self._session.is_open:
            raise RuntimeError(
                self._session.closed_message("ipc update_weights")
                if self._session is not None
                else "ipc update_weights needs an open update; call "
                "start_weight_update first"
            )
        self._session.check_deadline("ipc update_weights")
        if update_info.packed != self.packed:
            form = "one object" if update_info.packed else "a list"
            raise ValueError(
                f"update_info.ipc_handles is {form} (packed={update_info.packed}) "
                f"but init_weight_transfer_engine set packed={self.packed}"
            )
        if update_info.upstream_wire and self.device.type != "cuda":
            raise ValueError(
                "update_info.ipc_handles holds upstream 0.32's reduce_tensor "
                "tuples, which are CUDA IPC handles; this worker runs on "
                f"{self.device.type}. Send from the fork's "
                "IPCTrainerWeightTransferEngine, which moves CPU tensors "
                "through shared memory"
            )
        views = update_info.views()
        for view in views:
            self.pub.admit(view.name, view.dtype, view.shape, view.nbytes)
        importer = self._get_importer()
        selected = [
            importer.select(hmap, f"update_info.ipc_handles{suffix}")
            for suffix, hmap in _indexed(update_info)
        ]
        handles = [handle for _, handle in selected]
        self.last_update_keys.update(key for key, _ in selected)
        buffers = [importer.open(h) for h in handles]
        for i, (start, end) in enumerate(_spans(views, len(buffers))):
            self.pub.check_buffer(i, buffers[i][start:end])
        weights = []
        for view in views:
            raw = buffers[view.buffer][view.offset : view.offset + view.nbytes]
            if view.offset % view.dtype.itemsize:
                # Upstream packs without padding; a dtype view needs alignment.
                raw = raw.clone()
            weights.append((view.name, raw.view(view.dtype).view(view.shape)))
        self.pub.touch()
        self._loaded = True
        record = self.pub.record
        if record is not None:
            with record.phase("load"):
                self._session.load(weights, foreign_storages=importer.storage_ptrs())
        else:
            self._session.load(weights, foreign_storages=importer.storage_ptrs())
        del weights, buffers
        _sync_device(self.device)
        for view in views:
            self.pub.landed(view.name, view.nbytes)
        if not update_info.packed:
            importer.close()  # one-shot buffers: nothing refers to them any more

    def finish_weight_update(self) -> None:
        if self._aborted:
            # The finish that closes an update the trainer aborted: the
            # trainer knows, and vLLM's Worker keeps an update open for as
            # long as finish raises.
            self._aborted = False
            self._release()
            return
        self._refuse_if_fenced(closing=True)
        session, self._session = self._session, None
        try:
            if self.pub.fence.state != WeightState.UPDATING:
                # An earlier failure closed the update with the weights intact.
                return
            try:
                if session is not None and session.is_open:
                    session.finish()
            except BaseException as e:
                self.pub.fail(e, weights_intact=False)
                raise
            self.pub.finish()
        finally:
            self._release()

    def shutdown(self) -> None:
        self._abort()

    # -- internals -------------------------------------------------------------

    def _close_aborted(self, reason: str) -> None:
        """Close the open update on the trainer's ``{"abort": reason}``.

        Never raises: the trainer already knows the update failed, and the
        ``finish_weight_update`` it sends next closes the update quietly, so
        vLLM's Worker is ready for the resync. The engine is fenced if the
        update had touched a weight.
        """
        logger.warning("Trainer aborted the weight update: %s", reason)
        if self.pub.fence.state == WeightState.UPDATING:
            self.pub.fail(
                f"the trainer aborted the update: {reason}",
                weights_intact=not self._loaded,
            )
        self._aborted = True
        self._abort()

    def _refuse_if_fenced(self, closing: bool = False) -> None:
        status = self.pub.fence.status
        if status.state == WeightState.FENCED:
            message = fenced_message(status.reason or "unknown")
            if closing:
                message += (
                    ". vLLM's worker keeps this update open while "
                    "finish_weight_update raises: close it with update_weights "
                    "{'abort': '<reason>'} and then finish_weight_update (the "
                    "fork's trainers do this on failure), then send a full update"
                )
            raise WeightsFencedError(message)

    def _check_against_checkpoint(self) -> None:
        """Reject a manifest the served checkpoint contradicts, before loading."""
        header = self.pub.header
        assert header is not None and self.pub.checker is not None
        manifest = self.pub.checker.manifest
        shapes: Shapes | None = checkpoint_shapes(self.model_config)
        if shapes is not None:
            check_manifest_shapes(manifest, shapes, header.publication_id)
        kinds = checkpoint_dtype_kinds(self.model_config)
        if kinds is None:
            kinds = module_dtype_kinds(self.model)
        check_manifest_dtypes(manifest, kinds, header.publication_id)

    def _get_importer(self) -> BufferImporter:
        if self._importer is None:
            self._importer = BufferImporter(self.device, _local_rank(), writable=False)
        return self._importer

    def _abort(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None:
                session.abort()
        finally:
            self._release()

    def _release(self) -> None:
        if self._importer is not None:
            self._importer.close()


def _spans(views: list[Any], n_buffers: int) -> list[tuple[int, int]]:
    """Per buffer, the ``(start, end)`` of the bytes its views use: what the
    trainer checksummed."""
    starts: list[int | None] = [None] * n_buffers
    ends = [0] * n_buffers
    for view in views:
        first = starts[view.buffer]
        starts[view.buffer] = view.offset if first is None else min(first, view.offset)
        ends[view.buffer] = max(ends[view.buffer], view.offset + view.nbytes)
    return [(start or 0, end) for start, end in zip(starts, ends, strict=True)]


def _worker_rank(vllm_config: Any) -> int:
    """The worker's global rank across data-parallel replicas: the index
    vLLM's ``Worker`` uses to pick its element of a list payload."""
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_index = getattr(parallel, "data_parallel_index", 0) or 0
    world_size = getattr(parallel, "world_size", 1) or 1
    try:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank_in_group
    except (AssertionError, ImportError):
        rank = 0
    return dp_index * world_size + rank


def _indexed(info: IPCWeightTransferUpdateInfo) -> list[tuple[str, dict]]:
    """``(field suffix, handles)`` per buffer, for error messages."""
    buffers = info.buffers()
    if info.packed:
        return [("", buffers[0])]
    return [(f"[{i}]", b) for i, b in enumerate(buffers)]


def _local_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().local_rank
    except (AssertionError, ImportError):
        return 0
