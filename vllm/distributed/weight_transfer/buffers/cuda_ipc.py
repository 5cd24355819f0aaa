# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CUDA data plane of the ``ipc`` backend: byte buffers shared with CUDA IPC.

The exporter flattens a contiguous CUDA tensor to uint8 and records the
rebuild arguments of ``torch.multiprocessing.reductions.reduce_tensor`` as a
JSON-safe ``CudaIpcHandle`` (binary fields base64-encoded). The importer
rebuilds the flat uint8 tensor on its own device index with
``rebuild_cuda_tensor`` and slices typed views out of it.

Lifetime follows torch's CUDA IPC reference counting: the exporter keeps its
tensor alive until every importer has dropped its rebuilt tensor, then calls
``torch.cuda.ipc_collect()`` so the memory can be reused. Every export takes a
reference counter of its own; an importer that still holds the allocation
from an earlier export gets torch's cached mapping back from
``import_cuda_bytes``, and torch releases the new counter at once. So an
allocation a worker keeps mapped across syncs (a persistent handle) stays
allocated for as long as the worker holds it, whatever the trainer frees.

Devices are identified by physical GPU UUID, which is the same in every
process whatever ``CUDA_VISIBLE_DEVICES`` says.
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

import torch

from vllm.distributed.weight_transfer.buffers.handles import CudaIpcHandle


class ReduceTensorArgs(NamedTuple):
    """The arguments ``reduce_tensor`` returns for a CUDA tensor (and
    ``rebuild_cuda_tensor`` takes), by name."""

    tensor_cls: Any
    size: Any
    stride: Any
    tensor_offset: Any
    storage_cls: Any
    dtype: Any
    device: Any
    storage_handle: Any
    storage_size_bytes: Any
    storage_offset_bytes: Any
    requires_grad: Any
    ref_counter_handle: Any
    ref_counter_offset: Any
    event_handle: Any
    event_sync_required: Any


def rebuild_args(
    handle: CudaIpcHandle,
    *,
    dtype: torch.dtype,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    tensor_offset: int,
    device: int,
) -> ReduceTensorArgs:
    """The arguments that rebuild a tensor over ``handle``'s storage with
    the given dtype, size, stride, element offset and device index."""
    return ReduceTensorArgs(
        torch.Tensor,
        size,
        stride,
        tensor_offset,
        torch.storage.TypedStorage,
        dtype,
        device,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        base64.b64decode(handle.event_handle) if handle.event_handle else None,
        handle.event_sync_required,
    )


def physical_gpu_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def export_cuda_bytes(
    tensor: torch.Tensor, *, persistent: bool = False
) -> CudaIpcHandle:
    """Export a contiguous CUDA tensor's bytes. Keep ``tensor`` alive meanwhile.
    ``persistent`` marks an allocation that outlives the sync (see
    ``CudaIpcHandle``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(
            f"CUDA IPC exports contiguous CUDA tensors, got device={tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    flat = tensor.reshape(-1).view(torch.uint8)
    _, reduced = reduce_tensor(flat)
    args = ReduceTensorArgs(*reduced)
    return CudaIpcHandle(
        nbytes=flat.numel(),
        device=int(args.device),
        storage_handle=base64.b64encode(args.storage_handle).decode("ascii"),
        storage_size_bytes=int(args.storage_size_bytes),
        storage_offset_bytes=int(args.storage_offset_bytes),
        tensor_offset=int(args.tensor_offset),
        ref_counter_handle=base64.b64encode(args.ref_counter_handle).decode("ascii"),
        ref_counter_offset=int(args.ref_counter_offset),
        event_handle=(
            base64.b64encode(args.event_handle).decode("ascii")
            if args.event_handle is not None
            else None
        ),
        event_sync_required=bool(args.event_sync_required),
        persistent=persistent,
    )


def import_cuda_bytes(handle: CudaIpcHandle, device_index: int) -> torch.Tensor:
    """The exporter's bytes as a flat uint8 tensor on ``device_index``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        *rebuild_args(
            handle,
            dtype=torch.uint8,
            size=(handle.nbytes,),
            stride=(1,),
            tensor_offset=handle.tensor_offset,
            device=device_index,
        )
    )
