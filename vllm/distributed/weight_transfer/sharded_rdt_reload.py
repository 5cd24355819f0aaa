# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Land pulled chunks in a model under layerwise reload.

The worker engine opens a `LayerwiseReloadSession` (every layer on the meta
device, its kernel tensors kept aside), then hands each pulled chunk to
`ChunkLander.land`:

1. a module touched for the first time in this sync is materialized (empty
   checkpoint-format tensors, as layerwise reload would before loading);
2. each slice of the chunk is copied into its planned region, the ``copy_``
   the model's weight loader would have made;
3. after the last chunk of a gather group, every module the plan says completes
   there is processed at once by vLLM's per-layer step
   (``process_weights_after_loading``, which inside the session also redoes the
   CPU MoE expert setup), the result is copied into the kept kernel tensors and
   the module leaves the reload.

Modules the plan never touches are left to the session's ``finish()``, which
puts their kernel tensors back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed.weight_transfer.sharded_rdt_chunks import PullPlan
from vllm.distributed.weight_transfer.sharded_rdt_landing import region_view
from vllm.distributed.weight_transfer.sharded_rdt_ops import dtype_from_name
from vllm.distributed.weight_transfer.sharded_rdt_plan import SliceCopy, WorkerPlan


@dataclass(frozen=True)
class _Landing:
    copy: SliceCopy
    offset: int  # byte offset of the copy's slice in its chunk


def deferred_modules(model: torch.nn.Module, plan: WorkerPlan) -> list[str]:
    """Planned modules that layerwise reload only processes at finalize
    (attention layers with loadable scales); landing cannot process them early."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    names = {c.region.module for c in plan.copies}
    return sorted(
        n for n in names if is_deferred_attention_layer(model.get_submodule(n))
    )


class ChunkLander:
    """See the module docstring."""

    def __init__(
        self, model: torch.nn.Module, plan: WorkerPlan, pulls: PullPlan
    ) -> None:
        self.model = model
        self.plan = plan
        self.pulls = pulls
        self._landings: list[list[_Landing]] = []
        self._completes_after: dict[int, tuple[str, ...]] = {}
        groups = {g.index: g for g in plan.groups}
        last_chunk_of_group: dict[int, int] = {}
        for i, chunk in enumerate(pulls.chunks):
            offsets = {p.spec: p.offset for p in chunk.slices}
            group = groups[chunk.group]
            self._landings.append(
                [
                    _Landing(c, offsets[c.slice])
                    for c in group.copies
                    if c.slice in offsets
                ]
            )
            last_chunk_of_group[chunk.group] = i
        for gi, i in last_chunk_of_group.items():
            self._completes_after[i] = groups[gi].completes
        self._materialized: set[str] = set()
        self.processed: list[str] = []

    def begin(self) -> None:
        self._materialized = set()
        self.processed = []

    @torch.no_grad()
    def land(self, index: int, data: torch.Tensor) -> None:
        """Land chunk ``index`` of the pull plan from its packed bytes."""
        for landing in self._landings[index]:
            region = landing.copy.region
            if region.module not in self._materialized:
                self._materialize(region.module)
            spec = landing.copy.slice
            raw = data[landing.offset : landing.offset + spec.nbytes]
            value = raw.view(dtype_from_name(spec.dtype)).view(spec.shape)
            region_view(self.model, region).copy_(value)
        for module_name in self._completes_after.get(index, ()):
            self._process(module_name)

    def _info(self, module_name: str):  # -> LayerReloadingInfo
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        module = self.model.get_submodule(module_name)
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            raise RuntimeError(
                f"{module_name} is not being reloaded; start_weight_update must "
                "run before update_weights"
            )
        return module, info

    def _materialize(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        module, info = self._info(module_name)
        materialize_layer(module, info)
        self._materialized.add(module_name)

    def _process(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            _layerwise_process,
        )

        # The module is materialized and filled, and nothing is buffered for
        # it, so vLLM's per-layer step only processes it (quantization,
        # repacking, the session's MoE expert setup) and copies the result into
        # the kernel tensors.
        module, info = self._info(module_name)
        _layerwise_process(module, info)
        self.processed.append(module_name)
