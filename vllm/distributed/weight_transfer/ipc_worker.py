# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of the ``ipc`` backend: ``IPCWeightTransferEngine`` maps the
buffers a colocated trainer shares and lands their tensors in the served model
(the trainer side is ``ipc_trainer``; the backend as a whole is described in
``ipc_engine``).

One update: ``start_weight_update`` opens a ``LayerwiseReloadSession``; each
``update_weights`` checks the message (``ipc_wire``) and, with verified
publication, its header and every tensor against the manifest, maps this
worker's buffers once (``ipc_dataplane.BufferImporter``) and hands the tensors
to the session; ``finish_weight_update`` completes every layer, writes the
receipt and releases the mappings. A failure closes the session with the
resident weights back in place, or fences the worker when a weight was
already touched; ``{"abort": reason}`` from the trainer does the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.checkpoint_structure import (
    Shapes,
    check_manifest_dtypes,
    check_manifest_shapes,
    checkpoint_dtype_kinds,
    checkpoint_shapes,
    module_dtype_kinds,
    wrong_dtype_kinds,
)
from vllm.distributed.weight_transfer.fencing import (
    WeightsFencedError,
    WeightState,
    fenced_message,
)
from vllm.distributed.weight_transfer.ipc_dataplane import BufferImporter, sync_device
from vllm.distributed.weight_transfer.ipc_wire import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
    abort_reason,
)
from vllm.distributed.weight_transfer.layerwise_session import (
    LayerwiseReloadSession,
)
from vllm.distributed.weight_transfer.publication import describe_error
from vllm.distributed.weight_transfer.verified_sync import (
    WorkerPublication,
    device_identity,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

__all__ = ["IPCWeightTransferEngine"]


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
        # Dtype kinds by tensor name, read on first use (``_kinds``).
        self._dtype_kinds: dict[str, str] | None = None

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
        try:
            reason = abort_reason(update_info)
        except BaseException as e:  # a malformed abort still closes the update
            self._close_aborted(f"malformed abort message ({describe_error(e)})")
            raise
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
        wrong = wrong_dtype_kinds(((v.name, v.dtype) for v in views), self._kinds())
        if wrong:
            raise ValueError(
                f"update_info declares {len(wrong)} tensor(s) with a dtype the "
                f"served model cannot take: {'; '.join(wrong[:8])}; send each "
                "tensor in a dtype of the same kind (floating point, integer, "
                "bool) as the served checkpoint; nothing was loaded"
            )
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
        sync_device(self.device)
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

    def _kinds(self) -> dict[str, str]:
        """Dtype kinds of the served checkpoint's tensors (or, without a
        local checkpoint, of the model's parameters), read once."""
        if self._dtype_kinds is None:
            kinds = checkpoint_dtype_kinds(self.model_config)
            self._dtype_kinds = (
                kinds if kinds is not None else module_dtype_kinds(self.model)
            )
        return self._dtype_kinds

    def _check_against_checkpoint(self) -> None:
        """Reject a manifest the served checkpoint contradicts, before loading."""
        header = self.pub.header
        assert header is not None and self.pub.checker is not None
        manifest = self.pub.checker.manifest
        shapes: Shapes | None = checkpoint_shapes(self.model_config)
        if shapes is not None:
            check_manifest_shapes(manifest, shapes, header.publication_id)
        check_manifest_dtypes(manifest, self._kinds(), header.publication_id)

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
