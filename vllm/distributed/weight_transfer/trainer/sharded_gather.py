# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Full values of sharded trainer parameters (DTensors, as FSDP2 holds them),
gathered straight into the place a sync sends them from.

``materialize_full_tensor`` gathers a DTensor into a new tensor
(``full_tensor()``), which a packing sender then copies into its buffer: one
all-gather and one extra copy of every byte, plus an allocation, per sync.
``gather_full_into(out, tensor)`` writes the full value into ``out`` (the
tensor's slot in the buffer) instead. For the layout FSDP2 uses, a 1-D mesh
sharding dimension 0 in equal parts, that is one ``all_gather_into_tensor``
whose output is the slot: the shards arrive in rank order, which is the
row order of the full tensor. Any other layout (uneven rows, other
placements, several mesh dimensions) falls back to ``full_tensor()`` and a
copy. Every rank of the mesh must call it for the same tensors in the same
order, as for ``full_tensor()``.
"""

from __future__ import annotations

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds only a shard of its value (a DTensor)."""
    return callable(getattr(tensor, "full_tensor", None))


def gather_full_into(out: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Write the full value of ``tensor`` (a DTensor, or a plain tensor) into
    ``out``, a tensor of its global shape and dtype. Returns True when the
    shards were gathered straight into ``out`` (no full tensor allocated),
    False when it took ``full_tensor()`` and a copy (or ``tensor`` was not
    sharded)."""
    if not is_sharded(tensor):
        out.copy_(tensor)
        return False
    if _gathers_in_place(out, tensor):
        import torch.distributed as dist

        local = tensor.to_local()  # type: ignore[attr-defined]
        if not local.is_contiguous():
            local = local.contiguous()
        group = tensor.device_mesh.get_group()  # type: ignore[attr-defined]
        # (``all_gather_single`` is the newer torch name of the same call.)
        gather = getattr(dist, "all_gather_single", None) or (
            dist.all_gather_into_tensor
        )
        gather(out.view(-1), local.view(-1), group=group)
        return True
    out.copy_(tensor.full_tensor())  # type: ignore[attr-defined]
    return False


def _gathers_in_place(out: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s shards, gathered in rank order, are ``out``'s
    bytes: one mesh dimension, sharded on dimension 0 in equal row blocks,
    ``out`` contiguous on the shards' device, same dtype."""
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    placements = tensor.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or tuple(placements) != (Shard(0),):
        return False
    rows = tensor.shape[0] if tensor.dim() else 0
    local = tensor.to_local()  # type: ignore[attr-defined]
    return (
        rows > 0
        and rows % mesh.size() == 0
        and local.shape[0] == rows // mesh.size()
        and out.is_contiguous()
        and out.dtype == local.dtype
        and out.device == local.device
        and tuple(out.shape) == tuple(tensor.shape)
    )
