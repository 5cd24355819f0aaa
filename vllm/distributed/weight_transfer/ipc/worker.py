# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of the ``ipc`` backend: ``IPCWeightTransferEngine`` maps the
buffers a colocated trainer shares and lands their tensors in the served model
(the trainer side is ``ipc_trainer``; the backend as a whole is described in
``ipc_engine``).

The update lifecycle (start, abort, failure, fencing, finish) is
``worker_lifecycle.LayerwiseWorkerEngine``, shared with ``sharded_rdt``; this
module moves and lands the bytes. One update: ``start_weight_update`` opens a
``LayerwiseReloadSession``; each
``update_weights`` checks the message (``ipc_wire``) and, with verified
publication, its header and every tensor against the manifest, maps this
worker's buffers once (``ipc_dataplane.BufferImporter``) and hands the tensors
to the session; ``finish_weight_update`` completes every layer, writes the
receipt and releases the mappings. A failure closes the session with the
resident weights back in place, or fences the worker when a weight was
already touched; ``{"abort": reason}`` from the trainer does the same.
A registered message kind's handler (a LoRA adapter push) reads the tensors
its message carries through ``carried_tensors``: a mapping of their own,
released when the handler is done with them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.buffers.dataplane import (
    BufferImporter,
    sync_device,
)
from vllm.distributed.weight_transfer.ipc.chunk_programs import (
    BoundChunk,
    ChunkPrograms,
    chunk_in_mapping,
)
from vllm.distributed.weight_transfer.ipc.layout_memo import LayoutMemo, layout_fact
from vllm.distributed.weight_transfer.ipc.reads import (
    MessageReads,
    indexed_buffers,
    read_message,
)
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.landing.checkpoint_structure import (
    DTYPE_KIND_RULE,
    Shapes,
    check_manifest_dtypes,
    check_manifest_shapes,
    checkpoint_dtype_kinds,
    checkpoint_shapes,
    module_dtype_kinds,
    wrong_dtype_kinds,
)
from vllm.distributed.weight_transfer.landing.codes import CodesLanding
from vllm.distributed.weight_transfer.landing.layerwise import (
    LayerwiseReloadSession,
)
from vllm.distributed.weight_transfer.landing.planned import LandingPlan
from vllm.distributed.weight_transfer.plan.ops import dtype_from_name
from vllm.distributed.weight_transfer.quant.values import (
    checked_views,
    refuse_bad_values,
)
from vllm.distributed.weight_transfer.verification import (
    ChecksumMismatch,
    WeightState,
    WholeTensors,
    WorkerPublication,
    describe_error,
    device_identity,
)
from vllm.distributed.weight_transfer.worker.handlers import ReadTensors
from vllm.distributed.weight_transfer.worker.lifecycle import (
    LayerwiseWorkerEngine,
    global_worker_rank,
)
from vllm.distributed.weight_transfer.worker.staged import StagedUpdate
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["IPCWeightTransferEngine"]


class IPCWeightTransferEngine(
    LayerwiseWorkerEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]
):
    """Worker side of the ``ipc`` backend; see the module docstring."""

    backend_name = "ipc"
    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def _on_init(self) -> None:
        self.packed = False
        self._importer: BufferImporter | None = None
        # Device keys this worker read in the current or last update
        # (diagnostics: which trainer rank's buffers fed this worker).
        self.last_update_keys: set[str] = set()
        # Dtype kinds by tensor name, read on first use (``_kinds``).
        self._dtype_kinds: dict[str, str] | None = None
        # ``landing="planned"``: the plan, the trainer layout it was baked
        # for, and the plan the open update uses (None: everything reloads).
        self.landing_plan: LandingPlan | None = None
        self._landing_layout: tuple[Any, ...] | None = None
        self._planned: LandingPlan | None = None
        # Trainer-side FP8 codes (``codes_landing``): the landing of the last
        # trainer layout that held codes, with that layout, and the landing
        # the open update uses (None: no codes).
        self._codes_kept: tuple[tuple[Any, ...], CodesLanding | None] | None = None
        self._codes: CodesLanding | None = None
        # Why the layout in ``_landing_layout`` could not be planned, if so.
        self.landing_refused: str | None = None
        # Planned landings of chunks the worker keeps mapped, bound once
        # (``chunk_programs``); for ``landing_plan``.
        self.chunk_programs: ChunkPrograms | None = None
        # Earlier messages whose checked views a message with the same
        # layout reuses (``parse_update_info``); it learns a message's layout
        # only once the message landed and its update committed.
        self.layouts = LayoutMemo()
        # The buffers the last message read (``read_message``); dropped as
        # soon as any mapping is released, which it would hold.
        self._last_reads: MessageReads | None = None
        # The last manifest that passed the checkpoint's shape and dtype
        # checks, the last manifest with the trainer layout read from it
        # (``_layout_of``), and the last message views that passed the dtype
        # check: a trainer whose layout does not change sends the same
        # manifest (the parsed object is reused, ``Manifest.from_dict``) and
        # the same views (``LayoutMemo``) at every sync, and none needs
        # checking again.
        self._checked_manifest: Any = None
        self._manifest_layout: tuple[Any, tuple[Any, ...]] | None = None
        self._checked_views: Any = None

    def _make_publication(self) -> WorkerPublication:
        # Built on first use: naming the device queries it (a GPU's UUID), and
        # constructing the engine must not touch the device.
        return WorkerPublication(
            backend="ipc",
            worker_rank=global_worker_rank(self.vllm_config),
            worker_device=device_identity(self.device),
        )

    # -- parsing ---------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> IPCWeightTransferInitInfo:
        return IPCWeightTransferInitInfo.from_dict(init_dict)

    def parse_update_info(
        self, update_dict: dict[str, Any]
    ) -> IPCWeightTransferUpdateInfo:
        # A chunk with the layout it had at an earlier sync (the same tensors
        # at the same offsets of one buffer) reuses that message's views.
        return self.layouts.parse(update_dict)

    # -- lifecycle hooks -------------------------------------------------------

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        self.packed = init_info.packed

    def _on_start(self) -> None:
        self.layouts.discard()
        self.last_update_keys = set()
        self._planned = None
        self._codes = None

    def _on_new_publication(self) -> None:
        """Reject a manifest the served checkpoint contradicts, before loading."""
        header = self.pub.header
        assert header is not None and self.pub.checker is not None
        manifest = self.pub.checker.manifest
        session = self._session
        # Trainer-side FP8 codes land live, straight in the served tensors.
        self._codes = self._codes_landing_for(self._layout_of(manifest))
        if manifest is not self._checked_manifest:
            shapes: Shapes | None = checkpoint_shapes(self.model_config)
            if shapes is not None:
                check_manifest_shapes(manifest, shapes, header.publication_id)
            check_manifest_dtypes(manifest, self._update_kinds(), header.publication_id)
            self._checked_manifest = manifest
        if getattr(self.config, "landing", "reload") == "planned":
            # Staged or not: a staged update lands the planned names at the
            # commit, with the same plan.
            self._planned = self._landing_plan_for(manifest)
        if isinstance(session, StagedUpdate):
            # Staged: the worker's slices of the planned names and of the FP8
            # codes, every other tensor whole (the reload slices it at the
            # commit).
            planned, codes = self._planned, self._codes
            direct: frozenset[str] = frozenset()
            nbytes = 0
            if planned is not None:
                direct |= planned.direct_names
                nbytes += planned.direct_bytes
            if codes is not None:
                direct |= codes.names
                nbytes += codes.nbytes
            nbytes += sum(e.nbytes for e in manifest.entries if e.name not in direct)
            session.expect(nbytes, f"publication {header.publication_id}")

    def _on_update_closed(self) -> None:
        # Workers release their mappings when an update ends, so the trainer
        # can free or reuse its buffers; a segment holding the trainer's own
        # parameters (persistent) that this update read stays mapped for the
        # next one.
        self._close_mappings(keep_persistent=True)

    def _on_update_failed(self, reason: str) -> None:
        self.layouts.discard()
        self._close_mappings()

    def finish_weight_update(self) -> None:
        # Only an update that commits here teaches the layout memo: one
        # aborted, failed or closed quietly after a failure leaves it as it
        # was (``LayoutMemo``).
        commits = not self._aborted and self.pub.fence.state == WeightState.UPDATING
        try:
            super().finish_weight_update()
        except BaseException:
            self.layouts.discard()
            raise
        if commits:
            self.layouts.commit()
        else:
            self.layouts.discard()

    def shutdown(self) -> None:
        super().shutdown()
        self._close_mappings()

    def _close_mappings(self, keep_persistent: bool = False) -> None:
        """Release the mappings (``BufferImporter.close``), dropping first the
        bound programs that read them."""
        importer = self._importer
        if importer is None:
            return
        if self.chunk_programs is not None:
            self.chunk_programs.forget(importer.releasing(keep_persistent))
        importer.close(keep_persistent=keep_persistent)
        last = self._last_reads
        if last is not None and last.generation != importer.generation:
            self._last_reads = None

    # -- receiving ---------------------------------------------------------------

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        session = self._session_for("ipc update_weights")
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
        if update_info.layout_views is not self._checked_views:
            wrong = wrong_dtype_kinds(
                ((v.name, v.dtype) for v in views), self._update_kinds()
            )
            if wrong:
                raise ValueError(
                    f"update_info declares {len(wrong)} tensor(s) with a dtype the "
                    f"served model cannot take: {'; '.join(wrong[:8])}; "
                    f"{DTYPE_KIND_RULE}; nothing was loaded"
                )
            self._checked_views = update_info.layout_views
        whole = self._whole_tensors(update_info)
        self.pub.admit_whole(whole)
        importer = self._get_importer()
        reads = read_message(update_info, importer, self._last_reads)
        # Kept for the next message when it reads kept buffers only.
        self._last_reads = reads if reads.kept else None
        self.last_update_keys.update(reads.device_keys)
        buffers = reads.buffers
        if self.pub.checks_payloads:
            n = len(buffers)
            spans = layout_fact(update_info, ("spans", n), lambda vs: _spans(vs, n))
            for i, (start, end) in enumerate(spans):
                self.pub.check_buffer(i, buffers[i][start:end])
        bound = self._bound_chunk(session, update_info, reads)
        if bound is not None:
            covered = bound.names
            views = layout_fact(
                update_info,
                ("not bound", covered),
                lambda vs: [v for v in vs if v.name not in covered],
            )
        weights = _typed_views(buffers, views)
        landed_check = self._landed_to_check(update_info, buffers, bound)
        if check_direct := self._direct_to_check:
            landed_check += [w for w in weights if w[0] in check_direct]
        # Scales and float8 codes hold what a quantizer gives, or nothing lands.
        checked = layout_fact(update_info, "quantized values", checked_views)
        refuse_bad_values(_typed_views(buffers, checked), "update_info")
        self._mark_landed()
        with self._phase("load"):
            self._land(session, weights, importer, bound)
        del weights
        sync_device(self.device)
        if landed_check:
            self._check_landed(landed_check)
        del buffers, landed_check
        self.pub.landed_whole(whole, layout_fact(update_info, "nbytes", _total_nbytes))
        self.layouts.landed(update_info)
        if not update_info.packed:
            # One-shot buffers: nothing refers to them any more.
            self._close_mappings()

    @property
    def _direct_to_check(self) -> frozenset[str]:
        """The planned names whose landing ``_check_landed`` reads back: every
        direct name when payload checksums are on and the update lands live
        (a staged update lands at the commit); none otherwise."""
        planned, codes = self._planned, self._codes
        if (
            (planned is None and codes is None)
            or not self.pub.checks_payloads
            or not isinstance(self._session, LayerwiseReloadSession)
        ):
            return frozenset()
        if codes is None:
            assert planned is not None
            return planned.direct_names
        if planned is None:
            return codes.names
        return planned.direct_names | codes.names

    def _landed_to_check(
        self,
        update_info: IPCWeightTransferUpdateInfo,
        buffers: list[torch.Tensor],
        bound: BoundChunk | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The trainer's tensors, as mapped, of the names ``bound``'s program
        lands, when ``_direct_to_check`` holds them."""
        if bound is None or not self._direct_to_check:
            return []
        covered = bound.names
        return _typed_views(
            buffers,
            layout_fact(
                update_info,
                ("bound", covered),
                lambda vs: [v for v in vs if v.name in covered],
            ),
        )

    def _check_landed(self, landed: list[tuple[str, torch.Tensor]]) -> None:
        """With payload checksums on, the planned landing is read back: every
        served region a planned copy wrote must equal, bit for bit, the
        trainer's slice it came from (the payload checksum proves the bytes
        read; this proves where they went). A difference fails the update,
        which fences: the bytes are in the served tensors."""
        with self._phase("checksum"):
            flags = torch.stack(
                [self._direct_landing_of(n).landed_differs(n, t) for n, t in landed]
            )
            bad = flags.tolist()
        wrong = [n for (n, _), b in zip(landed, bad, strict=True) if b]
        if wrong:
            raise ChecksumMismatch(
                f"the planned landing wrote bytes that differ from the trainer's "
                f"for {len(wrong)} tensor(s) ({', '.join(wrong[:4])}"
                f"{' and more' if len(wrong) > 4 else ''}): the served tensors, "
                "read back after landing, do not hold the slices the plan takes"
            )

    def _direct_landing_of(self, name: str) -> CodesLanding | LandingPlan:
        """The direct landing (codes, or the planned landing) that lands
        ``name`` in the open update."""
        codes = self._codes
        if codes is not None and name in codes.names:
            return codes
        assert self._planned is not None
        return self._planned

    def _phase(self, name: str) -> AbstractContextManager[Any]:
        """Times the block as phase ``name`` of the publication's sync record
        (nothing when there is none)."""
        record = self.pub.record
        return record.phase(name) if record is not None else nullcontext()

    def _whole_tensors(
        self, update_info: IPCWeightTransferUpdateInfo
    ) -> WholeTensors | None:
        """The message's tensors checked against the publication's manifest,
        kept with the message layout while the manifest is the same object
        (None when the publication checks nothing)."""
        checker = self.pub.checker
        if checker is None:
            return None
        manifest = checker.manifest
        return layout_fact(
            update_info,
            WholeTensors,
            checker.whole_tensors,
            still=lambda kept: kept.manifest is manifest,
        )

    def _land(
        self,
        session: Any,
        weights: list[tuple[str, torch.Tensor]],
        importer: BufferImporter,
        bound: BoundChunk | None = None,
    ) -> None:
        """The chunk's bound program (``bound``: the planned names it covers,
        which ``weights`` leaves out), then the other planned names straight
        into the served tensors (staged: at the commit), trainer-side FP8
        codes straight into the served codes, the rest through the session
        (the layerwise reload, or staging)."""
        codes = self._codes
        if codes is not None:
            mine = [w for w in weights if w[0] in codes.names]
            if mine and isinstance(session, StagedUpdate):
                session.load_planned(codes, mine)
            elif mine:
                assert isinstance(session, LayerwiseReloadSession)
                session.land_planned(codes, mine)
            weights = [w for w in weights if w[0] not in codes.names]
        planned = self._planned
        if bound is not None:
            assert planned is not None and isinstance(session, LayerwiseReloadSession)
            session.land_bound(planned, bound.names, bound)
        if planned is not None:
            direct = planned.direct_names
            mine = [w for w in weights if w[0] in direct]
            if mine and isinstance(session, StagedUpdate):
                session.load_planned(planned, mine)
            elif mine:
                assert isinstance(session, LayerwiseReloadSession)
                session.land_planned(planned, mine)
            weights = [w for w in weights if w[0] not in direct]
        if weights:
            # (The mappings' addresses only then: an adopted trainer's
            # thousands of storages would cost a look each, every sync.)
            session.load(weights, foreign_storages=importer.storage_ptrs())

    def _bound_chunk(
        self,
        session: Any,
        update_info: IPCWeightTransferUpdateInfo,
        reads: MessageReads,
    ) -> BoundChunk | None:
        """The chunk's planned landing as a program bound once, when it can
        be: planned landing on, an update landing live (not staged), and a
        packed message. Buffers that stay mapped across syncs (a trainer's
        ``SharedParameters``, in one segment or several, or the packed buffer
        it keeps) have their program reused while the mappings and the
        chunk's layout in them are the ones it was bound to. A packed buffer
        mapped anew every sync (the trainer frees it) on a GPU runs the
        program bound for the layout at its first chunk, from the new buffer
        (``ChunkPrograms.anywhere``)."""
        planned = self._planned
        if (
            planned is None
            or not isinstance(session, LayerwiseReloadSession)
            or not update_info.packed
            or update_info.upstream_wire
        ):
            return None
        handles, buffers = reads.handles, reads.buffers
        kept = all(h.persistent for h in handles)
        if not kept and (len(handles) != 1 or not buffers[0].is_cuda):
            return None
        programs = self.chunk_programs
        if programs is None or programs.plan is not planned.plan:
            programs = self.chunk_programs = ChunkPrograms(
                planned.plan, planned.served, planned.direct_names
            )
        key, sources = chunk_in_mapping(reads.mapped, buffers, update_info)
        if not kept:
            layout = key[1]
            return programs.anywhere(layout, buffers[0], update_info.names, sources)
        return programs.bound(key, reads.mapped.addresses, update_info.names, sources)

    def _landing_plan_for(self, manifest: Any) -> LandingPlan | None:
        """The planned landing for the trainer layout ``manifest`` lists,
        baked on first use and again when the layout or a served tensor
        changed; None (every layer reloads) when the model's loaders cannot
        be planned for it, which is logged once per layout."""
        layout = self._layout_of(manifest)
        if layout == self._landing_layout and self.landing_refused is not None:
            return None
        plan = self.landing_plan
        if plan is not None and layout == self._landing_layout and plan.still_bound():
            return plan
        codes = self._codes.names if self._codes is not None else frozenset()
        metas = [
            ParamMeta(name, dtype_from_name(dtype), shape)
            for name, dtype, shape in layout
            if name not in codes
        ]
        self.landing_plan, self._landing_layout = None, layout
        try:
            plan = LandingPlan.bake(
                self.model,
                metas,
                worker=f"ipc worker {global_worker_rank(self.vllm_config)}",
                vllm_config=self.vllm_config,
            )
        except Exception as e:
            # The bake puts the model back as it was; the reload needs no plan.
            self.landing_refused = describe_error(e)
            logger.warning(
                "landing='planned' cannot plan this model's loaders (%s); every "
                "layer of updates with this trainer layout goes through the "
                "layerwise reload",
                self.landing_refused,
            )
            return None
        self.landing_plan, self.landing_refused = plan, None
        return plan

    def _layout_of(self, manifest: Any) -> tuple[Any, ...]:
        """``(name, dtype, shape)`` of each of ``manifest``'s entries, read
        once per manifest object."""
        kept = self._manifest_layout
        if kept is not None and kept[0] is manifest:
            return kept[1]
        layout = tuple((e.name, e.dtype, e.shape) for e in manifest.entries)
        self._manifest_layout = (manifest, layout)
        return layout

    def _codes_landing_for(self, layout: tuple[Any, ...]) -> CodesLanding | None:
        """Where ``layout``'s trainer-side FP8 codes land (None when it holds
        none), planned on first use and again when the layout or a served
        tensor changed; ``CodesRefused`` when this engine cannot take them."""
        kept = self._codes_kept
        if (
            kept is not None
            and (kept[0] is layout or kept[0] == layout)
            and (kept[1] is None or kept[1].still_bound())
        ):
            return kept[1]
        self._codes_kept = None
        landing = CodesLanding.plan(
            self.model,
            layout,
            worker=f"ipc worker {global_worker_rank(self.vllm_config)}",
            vllm_config=self.vllm_config,
        )
        self._codes_kept = (layout, landing)
        return landing

    # -- internals -------------------------------------------------------------

    def _update_kinds(self) -> dict[str, str]:
        """``_kinds`` without the names the open update sends as FP8 codes
        (``codes_landing`` checks those)."""
        codes = self._codes
        if codes is None:
            return self._kinds()
        return {n: k for n, k in self._kinds().items() if n not in codes.names}

    def _kinds(self) -> dict[str, str]:
        """Dtype kinds of the served checkpoint's tensors (or, without a
        local checkpoint, of the model's parameters), read once."""
        if self._dtype_kinds is None:
            kinds = checkpoint_dtype_kinds(self.model_config)
            self._dtype_kinds = (
                kinds if kinds is not None else module_dtype_kinds(self.model)
            )
        return self._dtype_kinds

    def carried_tensors(self, message: dict[str, Any]) -> _CarriedIPC:
        return _CarriedIPC(IPCWeightTransferUpdateInfo.from_dict(message), self.device)

    def _get_importer(self) -> BufferImporter:
        if self._importer is None:
            self._importer = BufferImporter(self.device, _local_rank(), writable=False)
        return self._importer


class _CarriedIPC:
    """The tensors of a message a registered kind's handler reads itself
    (``carried_tensors``): its buffers are mapped through an importer of
    their own, released when the read ends, so the mappings kept for
    base-weight syncs stay as they are."""

    def __init__(self, info: IPCWeightTransferUpdateInfo, device: torch.device):
        self._info = info
        self._device = device
        self._buffered = indexed_buffers(info)
        self.upstream_wire = info.upstream_wire
        self.buffer_count = len(self._buffered)

    @contextmanager
    def read(self, what: str) -> Iterator[ReadTensors]:
        importer = BufferImporter(self._device, _local_rank(), writable=False)
        try:
            buffers = [
                importer.open(importer.select(hmap, f"{what} ipc_handles{suffix}")[1])
                for suffix, hmap in self._buffered
            ]
            views = self._info.views()
            ends = [end for _, end in _spans(views, len(buffers))]
            yield ReadTensors(
                payloads=[b[:end] for b, end in zip(buffers, ends, strict=True)],
                tensors=lambda: _typed_views(buffers, views),
            )
        finally:
            importer.close()


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


def _total_nbytes(views: list[Any]) -> int:
    return sum(view.nbytes for view in views)


def _typed_views(
    buffers: list[torch.Tensor], views: list[Any]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each view: its bytes in its mapped buffer, typed
    and shaped (copied first when its offset does not suit its dtype)."""
    out = []
    for view in views:
        raw = buffers[view.buffer][view.offset : view.offset + view.nbytes]
        if view.offset % view.dtype.itemsize:
            # Upstream packs without padding; a dtype view needs alignment.
            raw = raw.clone()
        out.append((view.name, raw.view(view.dtype).view(view.shape)))
    return out


def _local_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().local_rank
    except (AssertionError, ImportError):
        return 0
