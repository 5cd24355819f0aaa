# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer side of the ``ipc`` backend: ``IPCTrainerInitInfo`` and
``IPCTrainerWeightTransferEngine``, which shares the source's bytes with the
colocated vLLM workers chunk by chunk (the worker side is ``ipc_worker``; the
backend as a whole is described in ``ipc_engine``).

``send_weights()`` (every trainer rank calls it; the rank with
``init_info.rank == 0`` is the sender) is one sync of ``trainer.sync`` (start,
send, prepare and verify receipts, commit; abort and fence on failure) whose
send step moves the plan's chunks::

    plan = plan_transfer(source.metadata())       # before any tensor exists
    sender: pub = TrainerPublication.open(...)    ; ranks share their devices
    send, for chunk in plan.chunks:
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

Wires (``IPCTrainerInitInfo.wire``): ``"fork"`` (the default) sends JSON
handle objects, tensor offsets and the publication header, which the fork's
worker reads. ``"upstream"`` sends what upstream vLLM 0.32's trainer sends, so
an unmodified 0.32 server can be updated: raw ``reduce_tensor`` argument
tuples keyed by GPU UUID (CUDA tensors only), tensors back to back in the
packed buffer, one chunk at a time, no publication header and so no receipts.
The fork's own worker reads both.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.buffers.dataplane import (
    ExportedBuffer,
    release_exported_cuda_memory,
)
from vllm.distributed.weight_transfer.ipc.chunk_sender import (
    ChunkSender,
    _packed_chunk_fields,
)
from vllm.distributed.weight_transfer.ipc.packing import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_CAP_BYTES,
    TransferPlan,
    plan_transfer,
)
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SegmentPart,
    SharedParameters,
)
from vllm.distributed.weight_transfer.ipc.source_walk import _SourceCursor
from vllm.distributed.weight_transfer.ipc.whole_sync import (
    _MovedWhileLanding,
    _pinned,
    _SegmentsByOwner,
    _SharedInSync,
    _WholeMessage,
    check_meanwhile,
    resend_whole,
)
from vllm.distributed.weight_transfer.trainer.group import (
    TrainerGroup,
    make_trainer_group,
    on_sender,
)
from vllm.distributed.weight_transfer.trainer.lifecycle import (
    FullResyncTrainerEngine,
    ModelVersions,
)
from vllm.distributed.weight_transfer.trainer.settings import VerifiedSyncSettings
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    TrainerPublication,
    device_identity,
    expected_workers,
    payload_checksum,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_PACKED_BUFFER_SIZE_BYTES = DEFAULT_BUFFER_CAP_BYTES
DEFAULT_TIMEOUT_S = 300.0

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "IPCTrainerInitInfo",
    "IPCTrainerWeightTransferEngine",
]


@dataclass
class IPCTrainerInitInfo(TrainerInitInfo, VerifiedSyncSettings):
    """Trainer-side settings of the ``ipc`` backend (never sent as is).

    ``packed`` and ``packed_buffer_size_bytes`` keep upstream's names; packing
    is on by default and the size is a cap (see ``ipc_packing``). The others
    are optional: ``process_group`` is the group of colocated trainer ranks
    (default: all ranks of torch.distributed, over a new gloo group),
    ``timeout_s`` bounds every wait among them, ``alignment_bytes`` aligns each
    tensor in the packed buffer.

    Verified publication: ``verify_publication``, ``verify_checksums``,
    ``model_version`` and ``receipt_timeout_s`` are ``VerifiedSyncSettings``'
    (keyword-only).

    ``keep_packed_buffer`` keeps the packed buffer from one ``send_weights``
    to the next instead of freeing it after each sync; ``shutdown()`` frees
    it. The default (``None``) keeps shared-memory buffers, whose pages cost
    more to create than to fill, and frees GPU buffers, so a colocated engine
    gets that memory back between syncs. A kept buffer is the same memory at
    every sync, so workers keep it mapped, and with the planned landing they
    bind each chunk's copies to it once: every later sync is one copy into
    the buffer and one copy out of it (the path of trainers whose tensors
    are new at every sync, e.g. FSDP's ``full_tensor()``, or several ranks).

    ``overlap_chunks`` (default on) lets chunks alternate between the packed
    buffer's two halves when the model spans several chunks: the trainer
    fills one half while the workers load the other, with at most one
    ``update_weights`` call in flight (made from a helper thread). A tensor
    larger than half the buffer travels alone and waits for the call before
    it. The buffer is the same size either way.

    ``check_while_landing`` (default on) applies to a source that says when
    nothing moved (``SharedParameters.source``): once a sync found nothing
    moved, the next one resends the layout at once and checks the source on
    a helper thread while the workers land it, instead of before (the check
    reads every parameter: 3-10 ms for 9,435 of them, against 16 ms for the
    landing itself on an H200). If a parameter did move, that update is
    aborted before anything is committed (an update landing in place leaves
    the engine fenced for the moment) and the sync goes again in full,
    looking at the source anew, inside the same ``send_weights``; it stops
    checking meanwhile until a sync finds nothing moved again. Off: the
    check always comes first.

    ``wire`` picks what the messages look like: ``"fork"`` (the default) for
    a fork server, ``"upstream"`` for an unmodified vLLM 0.32 server (see the
    module docstring). The upstream wire moves CUDA tensors only, sends no
    publication header (so ``verify_publication`` does not apply and
    ``verify_checksums`` is refused), packs tensors back to back
    (``alignment_bytes`` does not apply) and sends one chunk at a time
    (``overlap_chunks`` does not apply), as upstream's trainer does.
    """

    backend: ClassVar[str] = "ipc"
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    alignment_bytes: int = DEFAULT_ALIGNMENT
    process_group: Any = field(default=None, repr=False, compare=False)
    keep_packed_buffer: bool | None = None
    overlap_chunks: bool = True
    check_while_landing: bool = True
    wire: Literal["fork", "upstream"] = "fork"

    def __post_init__(self) -> None:
        if self.wire not in ("fork", "upstream"):
            raise ValueError(
                f"IPCTrainerInitInfo.wire must be 'fork' or 'upstream', got "
                f"{self.wire!r}"
            )
        if self.wire == "upstream" and self.verify_checksums:
            raise ValueError(
                "IPCTrainerInitInfo.verify_checksums needs wire='fork': upstream "
                "0.32's worker has no checksums or receipts"
            )
        if self.packed_buffer_size_bytes <= 0:
            raise ValueError(
                "IPCTrainerInitInfo.packed_buffer_size_bytes must be positive, "
                f"got {self.packed_buffer_size_bytes}"
            )
        if self.timeout_s <= 0:
            raise ValueError(
                f"IPCTrainerInitInfo.timeout_s must be positive, got {self.timeout_s}"
            )
        super().__post_init__()


class IPCTrainerWeightTransferEngine(FullResyncTrainerEngine[IPCTrainerInitInfo]):
    """Trainer side of the ``ipc`` backend; see the module docstring."""

    init_info_cls = IPCTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: IPCTrainerInitInfo | None = None,
        group: TrainerGroup | None = None,
        **options: Any,
    ) -> None:
        """Build from ``init_info``, or from upstream's keyword arguments
        (``packed=``, ``packed_buffer_size_bytes=``) and any other field of
        ``IPCTrainerInitInfo`` given as a keyword; keywords override
        ``init_info``'s fields."""
        super().__init__(client=client, source=source, is_sender=is_sender)
        if init_info is None:
            rank = options.pop("rank", None)
            init_info = IPCTrainerInitInfo(
                rank=rank if rank is not None else (0 if is_sender else 1),
                **options,
            )
        elif options:
            init_info = dataclasses.replace(init_info, **options)
        self.init_info = init_info
        self.rank = init_info.rank
        self.upstream_wire = init_info.wire == "upstream"
        self.group: TrainerGroup = group or make_trainer_group(self.rank)
        self.last_plan: TransferPlan | None = None
        self._plan_cache: tuple[tuple, TransferPlan] | None = None
        self._chunk_fields: list[dict[str, Any]] = []
        # What this engine does, which can be less than asked: the upstream
        # wire and a client without the verification calls send unverified.
        self.verify_publication = init_info.verify_publication and (
            not self.upstream_wire
        )
        self.verify_checksums = init_info.verify_checksums and self.verify_publication
        self._versions = ModelVersions(init_info.model_version)
        # The publication being sent (sender only), and the last one verified.
        self._pub: TrainerPublication | None = None
        # SharedParameters buffers the last successful sync named (workers
        # keep those mapped).
        self._shared_kept: _SegmentsByOwner = weakref.WeakKeyDictionary()
        # The buffer of a source that said nothing moved (``_pinned``) in the
        # sync under way; the last sync that went whole as one message out
        # of it (resent short while nothing moves).
        self._pinned_owner: SharedParameters | None = None
        self._whole: _WholeMessage | None = None
        self._plan_metas: list[ParamMeta] | None = None
        # Whether the last sync found nothing moved in a pinned source (then
        # the next one may check while landing), how many syncs did check
        # while landing, and the helper thread that checks.
        self._nothing_moved = False
        self.checked_while_landing = 0
        self._checker: ThreadPoolExecutor | None = None
        # The metadata list of the last publication and its manifest.
        self._manifest: tuple[list[ParamMeta], Manifest] | None = None
        # Sends each sync's chunks; keeps the packed buffer between syncs.
        self._chunks = ChunkSender(
            client=lambda: self.client,
            group=self.group,
            rank=self.rank,
            is_sender=self.is_sender,
            upstream_wire=self.upstream_wire,
            keep_packed_buffer=init_info.keep_packed_buffer,
            on_sender=self._on_sender,
            attach=self._attach,
            checksum=self._checksum,
            part_checksums=self._part_checksums,
        )

    @property
    def packed(self) -> bool:
        return self.init_info.packed

    @property
    def gathered_into_slots(self) -> int:
        """Sharded tensors (DTensors) whose shards were gathered straight
        into their slot of a packed buffer, over this engine's life."""
        return self._chunks.gathered_into_slots

    @property
    def _kept_buffer(self) -> ExportedBuffer | None:
        """The packed buffer kept between syncs, if any."""
        return self._chunks._kept_buffer

    @property
    def _views(self) -> dict[int, dict[int, torch.Tensor]]:
        """The kept buffer's views of chunks' slots, per chunk index."""
        return self._chunks._views

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
            init_info=init_info,
            group=group,
        )
        if engine.is_sender and engine.verify_publication:
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
        engine._on_sender(
            "init_weight_transfer_engine",
            lambda: client.init_weight_transfer_engine({"packed": init_info.packed}),
        )
        # Every rank follows the sender's choice, which depends on its client.
        flags = group.exchange(
            engine.verify_publication if engine.is_sender else None,
            None,
            "verified publication",
        )
        if False in flags.values():
            engine.verify_publication = engine.verify_checksums = False
        return engine

    # -- send ----------------------------------------------------------------

    # Packing copies out of the trainer's parameters, which usually require
    # grad: with autograd on, every copy into a view of the packed buffer
    # records history on the buffer, which grows with each tensor (measured:
    # 13 s per sync for 9,434 small tensors on CPU, against 0.2 s without).
    @torch.no_grad()
    def send_weights(self, weight_version: str | None = None) -> None:
        """Push the source's current weights; see the module docstring.

        ``weight_version``, if given, becomes the server's weight version once
        every worker's receipt is verified (at finish when verification is
        off).
        """
        assert self.source is not None
        whole = self._whole_to_check_while_landing()
        if whole is not None and self._plan_metas is not None:
            try:
                # The metadata list the plan was made for: the pinned
                # source's own, which its check returns if nothing moved.
                self._sync(whole.plan, self._plan_metas, weight_version, whole)
                return
            except _MovedWhileLanding as e:
                # Aborted before any commit; the sync goes again in full.
                logger.info("ipc: %s", e)
        pinned = _pinned(self.source)
        self._nothing_moved = pinned is not None
        if pinned is not None:
            # Nothing moved since the source last looked: the same metadata
            # list, so the same plan without comparing it name by name.
            self._pinned_owner, metas = pinned
        else:
            metas = list(self.source.metadata())
            # Something moved: the last layout sent is never named again.
            # The look just taken may have found everything in place (an
            # adopted parameter's new storage adopted, say): this sync's
            # message can then carry a new layout id the next one names.
            self._whole = None
            again = _pinned(self.source)
            self._pinned_owner = again[0] if again is not None else None
        plan = self._plan_for(metas, unchanged=pinned is not None)
        self._sync(plan, metas, weight_version)

    def _sync(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        weight_version: str | None,
        checking: _WholeMessage | None = None,
    ) -> None:
        """One update on the server (``trainer.sync``) whose send step is
        every chunk (``checking``: the whole message resent while the source
        is checked, ``_resend_whole``); a packed buffer made for it is freed
        once the workers released it at the finish, or at the abort."""
        self.last_plan = plan
        pub = self._open_publication(metas)
        buffers: list[ExportedBuffer] = []
        try:
            self._run_sync(
                lambda: self._send(plan, metas, buffers, checking),
                group=self.group,
                pub=pub,
                verify=self.verify_publication,
                expected=self._expected_workers,
                weight_version=weight_version,
                abort_as=f"trainer rank {self.rank}",
                on_abort=self._after_abort,
            )
            # Workers keep exactly the persistent buffers this sync used.
            self._shared_kept = self._chunks.committed()
            self._whole = self._chunks.whole_now
        finally:
            self._pub = None
            for buffer in buffers:
                buffer.close()
            release_exported_cuda_memory()

    def _whole_to_check_while_landing(self) -> _WholeMessage | None:
        """The last sync's whole message, when this sync may resend it while
        checking that nothing moved (``check_while_landing``): the last sync
        found nothing moved in the same pinned source, went whole as one
        message, and the workers kept every segment it named mapped. One
        trainer rank only (others pack)."""
        whole = self._whole
        if (
            whole is None
            or not self._nothing_moved
            or not self.init_info.check_while_landing
            or whole.source is not self.source
            or whole.owner is not self._pinned_owner
            or self.group.world_size != 1
            or not self.is_sender
            or self._plan_cache is None
            or self._plan_cache[1] is not whole.plan
            or not _SharedInSync(self._shared_kept).kept(whole.part)
        ):
            return None
        return whole

    def _check_meanwhile(self, whole: _WholeMessage) -> Future[bool]:
        """Check on the helper thread whether the source still says nothing
        moved (``whole_sync.check_meanwhile``)."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="ipc-check")
        return check_meanwhile(self._checker, self.source, self._plan_metas, whole)

    def _send(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        buffers: list[ExportedBuffer],
        checking: _WholeMessage | None,
    ) -> None:
        """The send step of one sync: every chunk, or the whole message."""
        # Shared buffers the workers may still hold mapped from the last sync
        # keep their export; any other is exported anew at its first use.
        self._chunks.begin(self._shared_kept)
        self._shared_kept = weakref.WeakKeyDictionary()
        if checking is not None:
            self._resend_whole(checking, check=self._check_meanwhile(checking))
        else:
            self._send_chunks(plan, metas, buffers)

    def _after_abort(self) -> None:
        """After a failed sync: nothing is resent short, and the next sync
        writes into a new buffer (a worker that timed out may still be
        reading the kept one)."""
        self._whole = None
        self._nothing_moved = False
        self._drop_kept_buffer()

    def _open_publication(self, metas: list[ParamMeta]) -> TrainerPublication | None:
        """Gather every rank's device; the sender opens the publication."""
        if not self.verify_publication:
            return None
        devices = self.group.exchange(_trainer_device(), None, "publication")
        version = self._versions.next()
        if not self.is_sender:
            return None
        cached = self._manifest
        self._pub = TrainerPublication.open(
            backend="ipc",
            model_version=version,
            metas=metas,
            channel="shm",
            checksums=self.verify_checksums,
            trainer_devices=[devices[r] for r in sorted(devices)],
            # The very metadata list of the last sync (a source that says
            # nothing changed): its manifest, not built again.
            manifest=cached[1] if cached is not None and cached[0] is metas else None,
        )
        manifest = self._pub.header.manifest
        self._manifest = (metas, manifest) if manifest is not None else None
        return self._pub

    def _expected_workers(self) -> range | int:
        """The workers whose receipts a publication waits for."""
        return expected_workers(self.client)

    def _plan_for(
        self, metas: list[ParamMeta], unchanged: bool = False
    ) -> TransferPlan:
        """The transfer plan of ``metas``, reused while the metadata is
        unchanged (``unchanged``: the source says ``metas`` is the very list
        it gave before, with nothing changed)."""
        if unchanged and self._plan_metas is metas and self._plan_cache is not None:
            return self._plan_cache[1]
        self._plan_metas = metas
        key = tuple((m.name, m.dtype, tuple(m.shape)) for m in metas)
        if self._plan_cache is None or self._plan_cache[0] != key:
            info = self.init_info
            plan = plan_transfer(
                metas,
                packed=info.packed,
                buffer_cap_bytes=info.packed_buffer_size_bytes,
                # Upstream's worker reads tensors back to back, one chunk at
                # a time from the buffer's start.
                alignment=1 if self.upstream_wire else info.alignment_bytes,
                overlap=info.overlap_chunks and not self.upstream_wire,
            )
            self._plan_cache = (key, plan)
            self._chunk_fields = (
                [
                    _packed_chunk_fields(c, offsets=not self.upstream_wire)
                    for c in plan.chunks
                ]
                if plan.packed
                else []
            )
        return self._plan_cache[1]

    def _on_sender(self, what: str, step: Callable[[], Any]) -> Any:
        """``step()`` on the sender; a failure raises on every rank."""
        return on_sender(self.group, self.is_sender, what, step)

    def _checksum(self, buf: torch.Tensor) -> str | None:
        """The payload checksum of ``buf`` (1-D bytes) when checksums are on."""
        if not self.verify_checksums:
            return None
        if self._pub is not None:
            return self._pub.checksum(buf)
        return payload_checksum(buf)

    def _part_checksums(self, part: SegmentPart) -> list[str | None]:
        """One checksum per segment a message names (None each when
        checksums are off: the segments' bytes are not even sliced, which
        costs per segment, and an adopted trainer has one per tensor)."""
        if not self.verify_checksums:
            return [None] * len(part.segments)
        return [self._checksum(b) for b in part.payloads()]

    def _attach(
        self, message: dict[str, Any], what: str, per_rank: list[list[str | None]]
    ) -> dict[str, Any]:
        """``message`` with the publication header and, when checksums are on,
        one checksum per buffer; every rank must have exported equal bytes."""
        if self._pub is None:
            return message
        if not self._pub.checksums:
            # (No per-buffer work: an adopted trainer names one buffer per
            # tensor.)
            return self._pub.attach(message, checksums=())
        sums: list[str | None] = []
        for i, rank_sums in enumerate(zip(*per_rank, strict=True)):
            if len(set(rank_sums)) > 1:
                raise ValueError(
                    f"trainer ranks exported different bytes for buffer {i} of "
                    f"{what} (checksums {list(rank_sums)}); every rank must send "
                    "the same weights"
                )
            sums.append(rank_sums[0])
        return self._pub.attach(message, checksums=sums)

    def _send_chunks(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        buffers: list[ExportedBuffer],
    ) -> None:
        """Send every chunk (``ChunkSender``), or the last sync's whole
        message again by its layout id while nothing moved; a packed buffer
        freed after the sync goes in ``buffers``."""
        assert self.source is not None
        whole = self._whole
        if (
            plan.packed
            and whole is not None
            and whole.plan is plan
            and whole.source is self.source
            and whole.owner is self._pinned_owner
            and self._chunks.shared_now.kept(whole.part)
        ):
            self._resend_whole(whole)
            return
        self._chunks.send(
            plan,
            _SourceCursor(self.source, metas),
            buffers,
            source=self.source,
            pinned_owner=self._pinned_owner,
            chunk_fields=self._chunk_fields,
        )

    def _resend_whole(
        self, whole: _WholeMessage, check: Future[bool] | None = None
    ) -> None:
        """The last sync's one message again in its short form
        (``whole_sync.resend_whole``)."""
        if resend_whole(whole, self._send_whole_message, check):
            self.checked_while_landing += 1

    def _send_whole_message(self, whole: _WholeMessage) -> None:
        """The short form of ``whole``'s message, sent and waited for."""
        self._chunks.send_whole_message(whole)

    def _drop_kept_buffer(self) -> None:
        self._chunks._drop_kept_buffer()

    def shutdown(self) -> None:
        """Free the packed buffer kept between syncs, if any."""
        self._drop_kept_buffer()
        checker, self._checker = self._checker, None
        if checker is not None:
            checker.shutdown(wait=True)


def _trainer_device() -> str:
    """This trainer rank's device identity (its current GPU, else the process)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return device_identity(torch.device("cuda", torch.cuda.current_device()))
    return device_identity("cpu")
