# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Land replayed slices in a worker's model: the receiving end of a plan.

A `Region` names a strided window of a checkpoint-format parameter. During a
weight update those parameters are the ones layerwise reload materializes for
each module; `region_view` finds the window and `land_copies` writes each slice
into it with ``copy_``, the same call the model's loader would have made.
During an update the engine lands through `sharded_rdt_reload.ChunkLander`,
which uses `region_view` for every slice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm.distributed.weight_transfer.sharded_rdt_ops import dtype_name
from vllm.distributed.weight_transfer.sharded_rdt_plan import Region, SliceCopy


def region_view(model: torch.nn.Module, region: Region) -> torch.Tensor:
    """The view of ``model``'s tensor that ``region`` describes."""
    module = model.get_submodule(region.module)
    tensor = getattr(module, region.param, None)
    if not isinstance(tensor, torch.Tensor):
        raise KeyError(f"{region.qualname} is not a parameter or buffer of the model")
    if tensor.is_meta:
        raise RuntimeError(
            f"{region.qualname} is on the meta device; materialize its module "
            "(layerwise reload) before landing slices in it"
        )
    if dtype_name(tensor.dtype) != region.dtype:
        raise ValueError(
            f"{region.qualname} is {dtype_name(tensor.dtype)} but the plan "
            f"expects {region.dtype}; the plan was baked for another model config"
        )
    last = region.last_element
    if last >= tensor.numel():
        raise ValueError(
            f"region of {region.qualname} ends at element {last} but the tensor "
            f"has {tensor.numel()}; the plan was baked for another model config"
        )
    return tensor.as_strided(
        region.shape, region.stride, tensor.storage_offset() + region.offset
    )


@torch.no_grad()
def land_copies(
    model: torch.nn.Module, copies: Iterable[tuple[SliceCopy, torch.Tensor]]
) -> None:
    """Write each replayed slice into its region, in the given order."""
    for copy, value in copies:
        region_view(model, copy.region).copy_(value)
