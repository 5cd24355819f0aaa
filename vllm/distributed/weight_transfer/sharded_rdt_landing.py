# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Land replayed slices in a worker's model: the receiving end of a plan.

A `Region` names a strided window of a checkpoint-format parameter. During a
weight update those parameters are the ones layerwise reload materializes for
each module; `region_view` finds the window and `land_copies` writes each slice
into it with ``copy_``, the same call the model's loader would have made.
`land_group` does this for one gather group inside a layerwise reload and hands
each completed module to vLLM's per-layer processing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm.distributed.weight_transfer.sharded_rdt_ops import dtype_name
from vllm.distributed.weight_transfer.sharded_rdt_plan import (
    GatherGroup,
    Region,
    SliceCopy,
)


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


@torch.no_grad()
def land_group(
    model: torch.nn.Module, group: GatherGroup, slices: Iterable[torch.Tensor]
) -> None:
    """Land one gather group's slices during a layerwise reload.

    Call between `initialize_layerwise_reload` (start of a weight update) and
    `finalize_layerwise_reload` (its end), with ``slices`` in the order of
    ``group.copies``. Each module the group writes into is materialized in
    checkpoint format on first touch; each module in ``group.completes`` then
    goes through vLLM's own per-layer processing, which repacks it into the
    kernel format and copies the result into the resident tensors.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _layerwise_process,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    def reloading_module(name: str) -> torch.nn.Module:
        module = model.get_submodule(name)
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            raise RuntimeError(
                f"module {name!r} is not being reloaded; call "
                "initialize_layerwise_reload (start_weight_update) before landing"
            )
        if is_deferred_attention_layer(module):
            raise NotImplementedError(
                f"module {name!r} is an attention layer with checkpoint tensors "
                "(e.g. KV-cache scales); landing those needs the finalize-time "
                "attention path, which sharded_rdt does not drive yet"
            )
        return module

    pairs = list(zip(group.copies, slices, strict=True))
    for module_name in dict.fromkeys(copy.region.module for copy, _ in pairs):
        module = reloading_module(module_name)
        materialize_layer(module, LAYERWISE_INFO[module])
    land_copies(model, pairs)
    for module_name in group.completes:
        module = reloading_module(module_name)
        _layerwise_process(module, LAYERWISE_INFO[module])
