# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The served tensor a plan's ``Region`` names, as a strided view of the
model's parameter or buffer, checked against the plan's dtype and extent."""

from __future__ import annotations

import torch

from vllm.distributed.weight_transfer.plan.ops import dtype_name
from vllm.distributed.weight_transfer.plan.worker_plan import Region


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
