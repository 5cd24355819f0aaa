# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream vLLM 0.32's form of ``ipc`` update messages, both sides.

Upstream's handles are ``torch.multiprocessing.reductions.reduce_tensor``
argument tuples (CUDA only), keyed by GPU UUID, with tensors back to back in
a packed buffer. A fork worker reads them (``upstream_handle``, and
``ipc_handles_pickled`` only under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``);
a fork trainer with ``wire="upstream"`` writes them (``upstream_args``,
``upstream_wire_handle``, ``upstream_unpacked_message``), so an unmodified
0.32 server can be updated.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import torch

from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
    ReduceTensorArgs,
    rebuild_args,
)
from vllm.distributed.weight_transfer.buffers.handles import (
    CudaIpcHandle,
    _b64,
    _unb64,
    handle_from_dict,
)
from vllm.distributed.weight_transfer.common.wire_fields import check_int
from vllm.logger import init_logger

logger = init_logger(__name__)

# Length of the argument tuple ``reduce_tensor`` returns for a CUDA tensor.
_REDUCE_ARGS_LEN = len(ReduceTensorArgs._fields)

INSECURE_SERIALIZATION_FLAG = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def insecure_serialization_allowed() -> bool:
    """Upstream's opt-in to unpickling (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    from vllm import envs

    return bool(envs.VLLM_ALLOW_INSECURE_SERIALIZATION)


def is_upstream_handle(value: object) -> bool:
    """Whether ``value`` is a raw upstream handle (a tuple), not a JSON handle."""
    return isinstance(value, tuple)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def upstream_handle(value: object, where: str) -> CudaIpcHandle:
    """The ``CudaIpcHandle`` of the bytes an upstream handle describes.

    Upstream 0.32 sends ``reduce_tensor(t)[1]``, the 15 rebuild arguments of a
    CUDA tensor (or the whole ``(rebuild_fn, args)`` pair); ``t`` is a
    contiguous parameter (unpacked) or the flat uint8 buffer (packed). The
    handle covers ``t``'s bytes, starting at its storage offset.
    """
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and callable(value[0])
        and isinstance(value[1], tuple)
    ):
        value = value[1]
    if not isinstance(value, tuple) or len(value) != _REDUCE_ARGS_LEN:
        got = len(value) if isinstance(value, tuple) else type(value).__name__
        raise ValueError(
            f"{where} must be the {_REDUCE_ARGS_LEN} arguments reduce_tensor "
            f"returns for a CUDA tensor, got {got!r}"
        )
    args = ReduceTensorArgs(*value)
    size, stride, dtype = args.size, args.stride, args.dtype
    storage_handle, ref_counter_handle = args.storage_handle, args.ref_counter_handle
    event_handle = args.event_handle
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: argument 5 (dtype) is {dtype!r}, not a dtype")
    try:
        size = tuple(int(d) for d in size)
        stride = tuple(int(s) for s in stride)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: size and stride must be integers: {e}") from e
    want = _contiguous_strides(size)
    if any(d > 1 and s != w for d, s, w in zip(size, stride, want, strict=False)):
        raise ValueError(
            f"{where} describes a non-contiguous tensor (size {list(size)}, "
            f"stride {list(stride)}); only contiguous tensors can be read"
        )
    for name, blob in (
        ("storage handle", storage_handle),
        ("ref counter handle", ref_counter_handle),
    ):
        if not isinstance(blob, bytes):
            raise ValueError(f"{where}: the {name} must be bytes, got {blob!r:.40}")
    if event_handle is not None and not isinstance(event_handle, bytes):
        raise ValueError(f"{where}: the event handle must be bytes or None")
    itemsize = dtype.itemsize
    try:
        return CudaIpcHandle(
            nbytes=math.prod(size) * itemsize,
            device=check_int(args.device, f"{where} device"),
            storage_handle=_b64(storage_handle),
            storage_size_bytes=check_int(
                args.storage_size_bytes, f"{where} storage size"
            ),
            storage_offset_bytes=check_int(
                args.storage_offset_bytes, f"{where} storage offset"
            ),
            tensor_offset=check_int(args.tensor_offset, f"{where} tensor offset")
            * itemsize,
            ref_counter_handle=_b64(ref_counter_handle),
            ref_counter_offset=check_int(
                args.ref_counter_offset, f"{where} ref counter offset"
            ),
            event_handle=_b64(event_handle) if event_handle is not None else None,
            event_sync_required=bool(args.event_sync_required),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def upstream_args(
    handle: CudaIpcHandle,
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] | None = None,
) -> tuple:
    """``handle`` as upstream's handle: the ``reduce_tensor`` arguments of a
    contiguous ``dtype`` tensor of ``shape`` over the handle's bytes (default:
    flat uint8, the packed buffer). Upstream's unpacked worker loads the
    tensor these arguments rebuild as is, so they carry its dtype and shape."""
    itemsize = dtype.itemsize
    if shape is None:
        if handle.nbytes % itemsize:
            raise ValueError(
                f"a {handle.nbytes}-byte handle is not a whole number of {dtype}"
            )
        shape = (handle.nbytes // itemsize,)
    if math.prod(shape) * itemsize != handle.nbytes:
        raise ValueError(
            f"shape {list(shape)} of {dtype} does not cover the handle's "
            f"{handle.nbytes} bytes"
        )
    if handle.tensor_offset % itemsize:
        raise ValueError(
            f"the handle starts {handle.tensor_offset} bytes into its storage, "
            f"not at a {dtype} element"
        )
    args = rebuild_args(
        handle,
        dtype=dtype,
        size=torch.Size(shape),
        stride=_contiguous_strides(tuple(shape)),
        tensor_offset=handle.tensor_offset // itemsize,
        device=handle.device,
    )
    return tuple(args)


def _unpickle_handles(pickled: object) -> Any:
    if not insecure_serialization_allowed():
        raise ValueError(
            "update_info.ipc_handles_pickled is not accepted: unpickling runs "
            "code chosen by the sender, so this worker refuses it unless the "
            f"server runs with {INSECURE_SERIALIZATION_FLAG}=1 (upstream 0.32's "
            "opt-in). Send `ipc_handles` as JSON handle objects, as "
            "IPCTrainerWeightTransferEngine does, or set the flag to accept "
            "upstream 0.32's HTTP client."
        )
    if not isinstance(pickled, str):
        raise ValueError(
            "update_info.ipc_handles_pickled must be a base64 string, got "
            f"{type(pickled).__name__}"
        )
    return pickle.loads(_unb64(pickled, "update_info.ipc_handles_pickled"))


def _raw_map(d: object, where: str) -> None:
    """Check the shape of one map of upstream handles (not their contents)."""
    if not isinstance(d, dict) or not d:
        raise ValueError(
            f"{where} must be a non-empty map of device keys to handles, got {d!r:.80}"
        )
    for key, handle in d.items():
        if not isinstance(key, str):
            raise ValueError(f"{where} has a non-string device key {key!r}")
        if not is_upstream_handle(handle):
            raise ValueError(
                f"{where}[{key!r}] is a {type(handle).__name__}; one update "
                "carries either JSON handle objects or upstream reduce_tensor "
                "tuples, not both"
            )


def _is_upstream_form(handles: object) -> bool:
    maps = handles if isinstance(handles, list) else [handles]
    return any(
        isinstance(m, dict) and any(is_upstream_handle(h) for h in m.values())
        for m in maps
    )


# ---------------------------------------------------------------------------
# the trainer's side (``IPCTrainerInitInfo.wire="upstream"``)


def check_upstream_device(tensor: torch.Tensor) -> None:
    """The upstream wire carries CUDA IPC handles only."""
    if tensor.device.type != "cuda":
        raise ValueError(
            f"wire='upstream' sends CUDA IPC handles, the only kind upstream "
            f"0.32's worker reads, but the source yielded a tensor on "
            f"{tensor.device}; update a fork server with wire='fork', which "
            "moves CPU tensors through shared memory"
        )


def upstream_wire_handle(
    handle: dict[str, Any],
    key: str,
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] | None = None,
) -> tuple:
    """A rank's exported JSON handle as upstream's ``reduce_tensor``
    arguments of a ``dtype`` tensor of ``shape`` (default: the flat packed
    buffer)."""
    parsed = handle_from_dict(handle, f"the handle for {key}")
    assert isinstance(parsed, CudaIpcHandle)  # check_upstream_device
    return upstream_args(parsed, dtype, shape)


def upstream_unpacked_message(
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    handles: list[dict[str, Any]],
) -> dict[str, Any]:
    """Upstream's update message of an unpacked chunk: one handle map per
    tensor, and no ``tensor_sizes`` (the handles carry them)."""
    return {
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "ipc_handles": handles,
    }
