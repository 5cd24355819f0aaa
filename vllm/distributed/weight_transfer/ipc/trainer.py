# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer side of the ``ipc`` backend: ``IPCTrainerInitInfo`` and
``IPCTrainerWeightTransferEngine``, which shares the source's bytes with the
colocated vLLM workers chunk by chunk (the worker side is ``ipc_worker``; the
backend as a whole is described in ``ipc_engine``).

Protocol of ``send_weights()`` (every trainer rank calls it; the rank with
``init_info.rank == 0`` is the sender)::

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
    sender: client.update_weights({"prepare": id}) ; every worker checks and
            writes its receipt; pub.verify(every receipt) ; all ranks agree
    sender: commit_update(client, weight_version)   ; finish_weight_update
            with generation held for just that call (``full_resync``)

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
import itertools
import uuid
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

import torch

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    TrainerInitInfo,
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
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_CAP_BYTES,
    Chunk,
    TensorSlot,
    TransferPlan,
    plan_transfer,
)
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SegmentOrder,
    SegmentPart,
    SharedParameters,
    SharedParametersSource,
    SharedPlace,
    shared_place,
)
from vllm.distributed.weight_transfer.ipc.upstream_wire import (
    check_upstream_device,
    upstream_unpacked_message,
    upstream_wire_handle,
)
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferUpdateInfo,
    dtype_from_name,
    dtype_name,
    layout_digest,
)
from vllm.distributed.weight_transfer.trainer.group import (
    TrainerGroup,
    make_trainer_group,
    on_sender,
)
from vllm.distributed.weight_transfer.trainer.lifecycle import (
    FullResyncTrainerEngine,
    ModelVersions,
    abort_update,
    commit_update,
)
from vllm.distributed.weight_transfer.trainer.sharded_gather import (
    gather_full_into,
    is_sharded,
)
from vllm.distributed.weight_transfer.trainer.start_update import start_update
from vllm.distributed.weight_transfer.verification import (
    DEFAULT_RECEIPT_TIMEOUT_S,
    Manifest,
    TrainerPublication,
    describe_error,
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
    verify_publication: bool = True
    verify_checksums: bool = False
    model_version: int | None = None
    receipt_timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S
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
    shape = meta.shape
    if tensor.shape != (shape if isinstance(shape, tuple) else tuple(shape)):
        raise ValueError(
            f"WeightSource yielded {name!r} with shape {list(tensor.shape)} but "
            f"metadata() says {list(meta.shape)}"
        )
    return tensor


class _SourceCursor:
    """Walks a source in metadata order, one tensor alive at a time.

    A ``ModuleSource``'s parameters are walked as they are, so a sharded one
    (a DTensor) reaches ``next_unmaterialized`` still sharded, for a packer
    that gathers it straight into its slot; ``next`` gathers it as the
    source's own iteration would (``full_tensor()``), at the same point of
    the walk."""

    def __init__(self, source: WeightSource, metas: list[ParamMeta]) -> None:
        self._it: Iterator[tuple[str, torch.Tensor]] = _unmaterialized(source)
        self._metas = metas
        self._index = 0

    def next(self) -> torch.Tensor:
        tensor = self.next_unmaterialized()
        return materialize_full_tensor(tensor) if is_sharded(tensor) else tensor

    def next_unmaterialized(self) -> torch.Tensor:
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


def _unmaterialized(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``'s items, with a ``ModuleSource``'s DTensors left sharded
    (its iteration would gather each into a new tensor); any other source's
    items as it yields them."""
    module = vars(source).get("_module") if type(source) is ModuleSource else None
    if isinstance(module, torch.nn.Module):
        return iter(module.named_parameters())
    return iter(source)


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
        # Sharded tensors (DTensors) whose shards were gathered straight into
        # their slot of a packed buffer, over this engine's life.
        self.gathered_into_slots = 0
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
        # The packed buffer kept between syncs (see ``keep_packed_buffer``);
        # whether the workers ended the last sync holding it mapped, and
        # whether the sync under way has written into it.
        self._kept_buffer: ExportedBuffer | None = None
        self._kept_mapped = self._kept_used = False
        # Views of chunks' slots in the kept buffer, for the plan they were
        # made for (``_kept_views``).
        self._views_for: TransferPlan | None = None
        self._views: dict[int, dict[int, torch.Tensor]] = {}
        # SharedParameters buffers the last successful sync named (workers
        # keep those mapped), and those the sync under way names.
        self._shared_kept: _SegmentsByOwner = weakref.WeakKeyDictionary()
        self._shared_now = _SharedInSync(self._shared_kept)
        # Chunks in one shared segment waiting to go as one message.
        self._held: _HeldChunks | None = None
        # The buffer of a source that said nothing moved (``_pinned``) in the
        # sync under way; the last sync that went whole as one message out
        # of it (resent short while nothing moves), and the one under way.
        self._pinned_owner: SharedParameters | None = None
        self._whole: _WholeMessage | None = None
        self._whole_now: _WholeMessage | None = None
        self._plan_metas: list[ParamMeta] | None = None
        # Whether the last sync found nothing moved in a pinned source (then
        # the next one may check while landing), how many syncs did check
        # while landing, and the helper thread that checks.
        self._nothing_moved = False
        self.checked_while_landing = 0
        self._checker: ThreadPoolExecutor | None = None
        # The metadata list of the last publication and its manifest.
        self._manifest: tuple[list[ParamMeta], Manifest] | None = None

    @property
    def packed(self) -> bool:
        return self.init_info.packed

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
        """One update on the server: publication, start, every chunk,
        receipts, finish (``checking``: the whole message resent while the
        source is checked, ``_resend_whole``)."""
        self.last_plan = plan
        pub = self._open_publication(metas)
        try:
            with self._publishing(pub, self._expected_workers):
                self._on_sender(
                    "start_weight_update",
                    lambda: start_update(self.client, f"ipc trainer rank {self.rank}"),
                )
                self._send_and_commit(plan, metas, weight_version, checking)
        finally:
            self._pub = None

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
        moved: the same buffer and the very metadata list of the plan."""
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="ipc-check")
        source, metas = self.source, self._plan_metas

        def check() -> bool:
            found = _pinned(source, yielding=True)
            return found is not None and found[0] is whole.owner and found[1] is metas

        return self._checker.submit(check)

    def _send_and_commit(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        weight_version: str | None,
        checking: _WholeMessage | None = None,
    ) -> None:
        """Send every chunk, verify every receipt (when verifying), then
        commit with ``weight_version``; on any failure abort the update on
        the server."""
        buffers: list[ExportedBuffer] = []
        # Shared buffers the workers may still hold mapped from the last sync
        # keep their export; any other is exported anew at its first use.
        self._shared_now = _SharedInSync(self._shared_kept)
        self._shared_kept = weakref.WeakKeyDictionary()
        self._kept_used = False
        self._whole_now = None
        try:
            if checking is not None:
                self._resend_whole(checking, check=self._check_meanwhile(checking))
            else:
                self._send_chunks(plan, metas, buffers)
            if self.verify_publication:
                self._on_sender("verify receipts", self._verify)
            self._on_sender(
                "finish_weight_update",
                lambda: commit_update(self.client, weight_version),
            )
            # Workers keep exactly the persistent buffers this sync used.
            self._shared_kept = self._shared_now.used
            self._kept_mapped = self._kept_used
            self._whole = self._whole_now
        except BaseException as e:
            self._whole = None
            self._nothing_moved = False
            # Also after a failed finish: vLLM's Worker keeps the update open
            # until an engine call raises or a finish returns.
            self._abort_on_server(f"trainer rank {self.rank}: {describe_error(e)}")
            # A worker that timed out may still be reading the kept buffer;
            # the next sync writes into a new one.
            self._drop_kept_buffer()
            raise
        finally:
            # Workers release their mappings at finish; only then is the
            # packed buffer dropped, so CUDA can reclaim it at once.
            for buffer in buffers:
                buffer.close()
            release_exported_cuda_memory()

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

    def _verify(self) -> None:
        """Have every worker prepare, then verify every worker's receipt."""
        pub = self._pub
        assert pub is not None
        self._verify_publication(
            pub, self._expected_workers(), self.init_info.receipt_timeout_s
        )

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

    def _abort_on_server(self, reason: str) -> None:
        """Best effort: leave the server serving its previous weights."""
        if self.is_sender:
            abort_update(self.client, reason)

    def _send_chunks(
        self,
        plan: TransferPlan,
        metas: list[ParamMeta],
        buffers: list[ExportedBuffer],
    ) -> None:
        """Send every chunk; a packed buffer freed after the sync goes in
        ``buffers``."""
        assert self.source is not None
        whole = self._whole
        if (
            plan.packed
            and whole is not None
            and whole.plan is plan
            and whole.source is self.source
            and whole.owner is self._pinned_owner
            and self._shared_now.kept(whole.part)
        ):
            self._resend_whole(whole)
            return
        cursor = _SourceCursor(self.source, metas)
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

    def _settle(self, in_flight: _UpdateInFlight) -> None:
        """Wait for the update call in flight; every rank learns its outcome."""
        what = in_flight.what
        if what is None:
            return
        try:
            self._on_sender(what, in_flight.wait)
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
                checksums = self._part_checksums(part)
            elif buffer is not None and buffer.tensor is not None:
                start, end = chunk.span
                checksums = [self._checksum(buffer.tensor[start:end])]
        except Exception as e:
            error = describe_error(e)
            if self.group.world_size == 1:
                raise
        fields = self._chunk_fields[chunk.index]
        handle: Any = None
        if part is not None:
            device = part.owner.device
            fields = {**fields, **part.fields()}
            self._shared_now.use(part)
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
            message = self._attach(
                {**fields, "ipc_handles": merged},
                f"chunk {chunk.index}",
                [c for _, _, c in given],
            )
            in_flight.start(what, lambda: self.client.update_weights(message))
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
        checksums = self._part_checksums(part)
        self._shared_now.use(part)
        key = device_key(held.owner.device, self.rank)
        what = f"chunks {held.first}-{held.last}"
        fields: dict[str, Any] = {
            **held.fields,
            **part.fields(),
            "ipc_handles": {key: part.handles()},
        }
        plan = self.last_plan
        if (
            held.owner is self._pinned_owner
            and plan is not None
            and held.first == 0
            and held.last == len(plan.chunks) - 1
        ):
            # The whole sync in one message from a source that knows when
            # nothing moved: its layout gets an id, which the next syncs
            # name, with the layout's digest, instead of repeating it
            # (``_resend_whole``).
            layout = uuid.uuid4().hex
            fields["layout"] = layout
            whole = _WholeMessage(
                plan, self.source, held.owner, layout, layout_digest(fields), part
            )
            self._whole_now = whole
        message = self._attach(fields, what, [checksums])
        self._settle(in_flight)
        in_flight.start(
            f"update_weights of {what}", lambda: self.client.update_weights(message)
        )
        if not in_flight.asynchronous:
            self._settle(in_flight)

    def _resend_whole(
        self, whole: _WholeMessage, check: Future[bool] | None = None
    ) -> None:
        """Send the last sync's one message again in its short form: the
        layout's id and the buffer's handle, or the id alone over several
        segments (the workers parsed the layout then and keep the segments
        mapped). Nothing is walked: the source said every tensor is where it
        was (``_pinned``), or ``check`` is saying it meanwhile; when it says
        something moved, this raises ``_MovedWhileLanding`` after the
        message landed, so the update is aborted before its commit."""
        if check is None:
            self._send_whole_message(whole)
            return
        sent: BaseException | None = None
        try:
            self._send_whole_message(whole)
        except BaseException as e:
            # A segment that moved can fail the message itself (one resized
            # in place is refused before its handle is read): the check says
            # which of the two happened.
            sent = e
        if not check.result():
            raise _MovedWhileLanding(
                "a parameter moved since the last sync (the check made while "
                "the workers landed its layout found it), so that update is "
                "aborted before its commit and the sync goes again in full"
            ) from sent
        if sent is not None:
            raise sent
        self.checked_while_landing += 1

    def _send_whole_message(self, whole: _WholeMessage) -> None:
        """The short form of ``whole``'s message, sent and waited for."""
        owner = whole.owner
        # The trainer's last writes may still be queued on the device.
        sync_device(owner.device)
        part = whole.part
        self._shared_now.use(part)
        checksums = self._part_checksums(part)
        short: dict[str, Any] = {"layout": whole.layout, "layout_digest": whole.digest}
        if part.indexes is None:
            short["ipc_handles"] = {device_key(owner.device, self.rank): part.handles()}
        # Over several segments the handles are left out: the workers read
        # the exports the layout's message named, which they still map.
        message = self._attach(short, "the whole sync", [checksums])
        self._whole_now = whole
        self._on_sender(
            "update_weights of the whole sync",
            lambda: self.client.update_weights(message),
        )

    def _packed_buffer(
        self, nbytes: int, device: torch.device, owned: list[ExportedBuffer]
    ) -> ExportedBuffer:
        """This sync's packed buffer: the one already in use or kept when it
        fits, else a new one, which is kept or put in ``owned`` (freed after
        the sync)."""
        if owned:
            return owned[0]
        keep = self.init_info.keep_packed_buffer
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
        self._views_for, self._views = None, {}
        self._kept_mapped = self._kept_used = False
        buffer, self._kept_buffer = self._kept_buffer, None
        if buffer is not None:
            buffer.close()
            release_exported_cuda_memory()

    def shutdown(self) -> None:
        """Free the packed buffer kept between syncs, if any."""
        self._drop_kept_buffer()
        checker, self._checker = self._checker, None
        if checker is not None:
            checker.shutdown(wait=True)

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
                            self._checksum(_bytes_of(tensor)),
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
                self.client.update_weights(
                    self._attach(message, f"chunk {chunk.index}", sums)
                )

            self._on_sender(f"update_weights of chunk {chunk.index}", send)
        finally:
            for buf in exported:
                buf.close()


# Per ``SharedParameters`` buffer, the indexes of its segments.
_SegmentsByOwner = weakref.WeakKeyDictionary[SharedParameters, frozenset[int]]


class _SharedInSync:
    """The ``SharedParameters`` segments one sync's messages name, per
    buffer. A segment the workers did not keep mapped from the previous sync
    (``kept``: the segments that sync named, none after a failed one) is
    exported anew before its first message, so the worker that maps it again
    gets a CUDA reference counter of its own (``SharedParameters.export_anew``).
    Workers keep mappings per segment, so this is tracked per segment: a
    segment left out of one sync (its chunks packed) is exported anew when a
    later sync names it again, even if other segments of its buffer stayed."""

    def __init__(self, kept: _SegmentsByOwner) -> None:
        self._kept = kept
        self.used: _SegmentsByOwner = weakref.WeakKeyDictionary()

    def kept(self, part: SegmentPart) -> bool:
        """Whether the workers ended the last sync holding every segment
        ``part`` names mapped."""
        kept = self._kept.get(part.owner)
        segments = part.segment_set
        return kept is not None and (kept is segments or segments <= kept)

    def use(self, part: SegmentPart) -> None:
        # (Sets, compared by identity first: a whole sync resent by id names
        # the same part, and so the same set, sync after sync.)
        owner, segments = part.owner, part.segment_set
        used = self.used.get(owner)
        if used is not None and (used is segments or segments <= used):
            return
        kept = self._kept.get(owner)
        if kept is not segments:
            new = segments if used is None else segments - used
            for i in new if kept is None else new - kept:
                owner.export_anew(i)
        self.used[owner] = segments if used is None else used | segments


@dataclass(frozen=True)
class _WholeMessage:
    """A sync that went whole as one message out of one ``SharedParameters``
    buffer: the plan and the source it was for, the buffer, the layout id the
    message carried and the message's ``layout_digest``, and what the message
    named of the buffer's segments."""

    plan: TransferPlan
    source: WeightSource | None
    owner: SharedParameters
    layout: str
    digest: str
    part: SegmentPart


def _pinned(
    source: WeightSource | None, yielding: bool = False
) -> tuple[SharedParameters, list[ParamMeta]] | None:
    """The buffer and metadata of a source that says nothing moved since it
    last looked (``SharedParametersSource.pinned``); None for any other."""
    if isinstance(source, SharedParametersSource):
        return source.pinned(yielding)
    return None


class _MovedWhileLanding(RuntimeError):
    """The check made while a whole message landed found a parameter moved
    (``check_while_landing``)."""


class _HeldChunks:
    """Chunks held to travel as one message: all their tensors lie in
    ``owner``'s segments, at increasing offsets within each
    (``IPCTrainerWeightTransferEngine._hold``)."""

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
