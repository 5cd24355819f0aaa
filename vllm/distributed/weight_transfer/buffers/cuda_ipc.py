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

import torch

from vllm.distributed.weight_transfer.buffers.handles import CudaIpcHandle


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
    _, args = reduce_tensor(flat)
    (
        _tensor_cls,
        _size,
        _stride,
        tensor_offset,
        _storage_cls,
        _dtype,
        device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcHandle(
        nbytes=flat.numel(),
        device=int(device),
        storage_handle=base64.b64encode(storage_handle).decode("ascii"),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        tensor_offset=int(tensor_offset),
        ref_counter_handle=base64.b64encode(ref_counter_handle).decode("ascii"),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=(
            base64.b64encode(event_handle).decode("ascii")
            if event_handle is not None
            else None
        ),
        event_sync_required=bool(event_sync_required),
        persistent=persistent,
    )


def import_cuda_bytes(handle: CudaIpcHandle, device_index: int) -> torch.Tensor:
    """The exporter's bytes as a flat uint8 tensor on ``device_index``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        (handle.nbytes,),
        (1,),
        handle.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        base64.b64decode(handle.event_handle) if handle.event_handle else None,
        handle.event_sync_required,
    )
