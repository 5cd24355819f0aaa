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
    sender: client.start_weight_update()          ; all ranks agree
    for chunk in plan.chunks:
        every rank: materialize the chunk's tensors one at a time (checking
            each against the metadata), copy each into the chunk's buffer,
            drop it; the next tensor is not requested before the chunk is sent
        all ranks exchange handles (a barrier)    ; sender merges them by device
        sender: client.update_weights(chunk info) ; all ranks agree (barrier),
            so no rank reuses a buffer its colocated worker still reads
    sender: client.finish_weight_update()         ; all ranks agree

Packed mode (the default) reuses one buffer per trainer rank for every chunk,
sized from the metadata: the model's aligned size capped at
``packed_buffer_size_bytes``, but at least the largest tensor. Unpacked mode
exports each tensor separately and keeps every exported tensor alive until all
workers have read it (the barrier after its chunk).

The worker lands each chunk through ``LayerwiseReloadSession``
(``layerwise_session``): start -> load per chunk -> finish, so fused and
quantized layers are processed after loading. It maps each buffer once per
update and releases it at finish.

Failures: a malformed update is rejected with ``ValueError`` before any weight
is touched. Any failure inside ``update_weights`` puts every layer that did not
complete back on its resident weights before re-raising, so the server keeps
serving. When the trainer fails after ``start_weight_update`` it sends
``{"abort": reason}`` and then finishes, with the same effect. Waits among
trainer ranks are bounded by ``timeout_s`` (or the caller's group timeout); the
HTTP and Ray clients bound every call to the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
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
from vllm.distributed.weight_transfer.trainer_group import (
    TrainerGroup,
    make_trainer_group,
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
    """

    backend: ClassVar[str] = "ipc"
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    alignment_bytes: int = DEFAULT_ALIGNMENT
    process_group: Any = field(default=None, repr=False, compare=False)

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


class IPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[IPCTrainerInitInfo]):
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

    @classmethod
    def trainer_init(
        cls,
        init_info: IPCTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(
                "the ipc backend needs source= (a WeightSource such as "
                "ModuleSource(model)) at trainer_init"
            )
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
        )
        error = None
        if engine.is_sender:
            try:
                client.init_weight_transfer_engine({"packed": init_info.packed})
            except Exception as e:
                error = f"init_weight_transfer_engine: {e}"
                if group.world_size == 1:
                    raise
        group.exchange(None, error, "init_weight_transfer_engine")
        return engine

    # -- send ----------------------------------------------------------------

    def send_weights(self, weight_version: str | None = None) -> None:
        """Push the source's current weights; see the module docstring.

        ``weight_version``, if given, is stamped on the server at finish.
        """
        assert self.source is not None
        metas = list(self.source.metadata())
        plan = self._plan_for(metas)
        self.last_plan = plan
        error = self._call_server("start_weight_update")
        self.group.exchange(None, error, "start_weight_update")
        buffers: list[ExportedBuffer] = []
        try:
            try:
                self._send_chunks(plan, metas, buffers)
            except BaseException as e:
                self._abort_on_server(f"trainer rank {self.rank}: {e}")
                raise
            if weight_version is None:
                error = self._call_server("finish_weight_update")
            else:
                error = self._call_server("finish_weight_update", weight_version)
            self.group.exchange(None, error, "finish_weight_update")
        finally:
            # Workers release their mappings at finish; only then is the packed
            # buffer dropped, so CUDA can reclaim it at once.
            for buffer in buffers:
                buffer.close()
            release_exported_cuda_memory()

    def _plan_for(self, metas: list[ParamMeta]) -> TransferPlan:
        """The transfer plan of ``metas``, reused while the metadata is unchanged."""
        key = tuple((m.name, m.dtype, tuple(m.shape)) for m in metas)
        if self._plan_cache is None or self._plan_cache[0] != key:
            plan = plan_transfer(
                metas,
                packed=self.packed,
                buffer_cap_bytes=self.packed_buffer_size_bytes,
                alignment=self.alignment_bytes,
            )
            self._plan_cache = (key, plan)
            self._chunk_fields = [_packed_chunk_fields(c) for c in plan.chunks]
        return self._plan_cache[1]

    def _call_server(self, method: str, *args: Any) -> str | None:
        """Run a client call on the sender; return its failure as text so every
        rank learns of it (a single-process trainer raises it directly)."""
        if not self.is_sender:
            return None
        if self.group.world_size == 1:
            getattr(self.client, method)(*args)
            return None
        try:
            getattr(self.client, method)(*args)
        except Exception as e:
            logger.error("ipc weight transfer: %s failed: %s", method, e)
            return f"{method}: {e}"
        return None

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
        """Send every chunk; the packed buffer, once made, is put in ``buffers``."""
        assert self.source is not None
        cursor = _SourceCursor(self.source, metas)
        buffer: ExportedBuffer | None = None
        for chunk in plan.chunks:
            if plan.packed:
                buffer = self._send_packed_chunk(plan, chunk, cursor, buffer, buffers)
            else:
                self._send_unpacked_chunk(chunk, cursor)
        cursor.finish()

    def _send_packed_chunk(
        self,
        plan: TransferPlan,
        chunk: Chunk,
        cursor: _SourceCursor,
        buffer: ExportedBuffer | None,
        owned: list[ExportedBuffer],
    ) -> ExportedBuffer | None:
        error: str | None = None
        device: torch.device | None = None
        # Copies from resident tensors are batched into one fused copy per dtype;
        # any other tensor is copied at once and dropped before the next one is
        # materialized.
        batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        try:
            for slot in chunk.slots:
                tensor = cursor.next()
                if buffer is None:
                    buffer = allocate_buffer(plan.buffer_nbytes, tensor.device)
                    owned.append(buffer)
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
        except Exception as e:
            error = str(e)
            if self.group.world_size == 1:
                raise
        key = device_key(device, self.rank) if device is not None else None
        payload = (key, buffer.handle.to_dict()) if buffer is not None else None
        handles = self.group.exchange(payload, error, f"chunk {chunk.index}")
        error = None
        if self.is_sender:
            merged = dict(p for p in handles.values() if p is not None)
            message = {**self._chunk_fields[chunk.index], "ipc_handles": merged}
            error = self._call_server("update_weights", message)
        self.group.exchange(None, error, f"update_weights of chunk {chunk.index}")
        return buffer

    def _send_unpacked_chunk(self, chunk: Chunk, cursor: _SourceCursor) -> None:
        error: str | None = None
        exported: list[ExportedBuffer] = []
        payload: list[tuple[str, dict]] = []
        try:
            try:
                for _ in chunk.slots:
                    tensor = cursor.next()
                    buf = export_tensor(tensor)
                    exported.append(buf)
                    payload.append(
                        (device_key(tensor.device, self.rank), buf.handle.to_dict())
                    )
                    del tensor
                _sync_device(next((t.device for t in _owned(exported)), None))
            except Exception as e:
                error = str(e)
                if self.group.world_size == 1:
                    raise
            per_rank = self.group.exchange(payload, error, f"chunk {chunk.index}")
            error = None
            if self.is_sender:
                merged: list[dict[str, dict]] = [{} for _ in chunk.slots]
                for rank_payload in per_rank.values():
                    for i, (key, handle) in enumerate(rank_payload):
                        merged[i][key] = handle
                info = IPCWeightTransferUpdateInfo(
                    names=chunk.names,
                    dtype_names=[s.dtype_name for s in chunk.slots],
                    shapes=[list(s.shape) for s in chunk.slots],
                    ipc_handles=merged,
                    tensor_sizes=[s.nbytes for s in chunk.slots],
                )
                error = self._call_server("update_weights", info.to_dict())
            self.group.exchange(None, error, f"update_weights of chunk {chunk.index}")
        finally:
            for buf in exported:
                buf.close()


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
        session = LayerwiseReloadSession(self.model, self.model_config)
        session.start()
        self._session = session

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            reason = abort_reason(update_info)
            if reason is not None:
                logger.warning("Trainer aborted the weight update: %s", reason)
                self._abort()
                return
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._abort()
            raise

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        if self._session is None or not self._session.is_open:
            raise RuntimeError(
                "ipc update_weights needs an open update; call start_weight_update "
                "first"
            )
        if update_info.packed != self.packed:
            form = "one object" if update_info.packed else "a list"
            raise ValueError(
                f"update_info.ipc_handles is {form} (packed={update_info.packed}) "
                f"but init_weight_transfer_engine set packed={self.packed}"
            )
        importer = self._get_importer()
        selected = [
            importer.select(hmap, f"update_info.ipc_handles{suffix}")
            for suffix, hmap in _indexed(update_info)
        ]
        handles = [handle for _, handle in selected]
        self.last_update_keys.update(key for key, _ in selected)
        buffers = [importer.open(h) for h in handles]
        weights = []
        for view in update_info.views():
            raw = buffers[view.buffer][view.offset : view.offset + view.nbytes]
            weights.append((view.name, raw.view(view.dtype).view(view.shape)))
        self._session.load(weights, foreign_storages=importer.storage_ptrs())
        del weights, buffers
        _sync_device(self.device)
        if not update_info.packed:
            importer.close()  # one-shot buffers: nothing refers to them any more

    def finish_weight_update(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None and session.is_open:
                session.finish()
        finally:
            self._release()

    def shutdown(self) -> None:
        self._abort()

    # -- internals -------------------------------------------------------------

    def _get_importer(self) -> BufferImporter:
        if self._importer is None:
            self._importer = BufferImporter(self.device, _local_rank())
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
