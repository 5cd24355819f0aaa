# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Land pulled chunks in a model: the one landing path of sharded_rdt.

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
   CPU MoE expert setup), the result is copied into the kernel tensors and
   the module leaves the reload.

Step 2 is the lander's own work: where each slice sits in the chunk's bytes,
which dtype and shape it is read as, and which region (`region_view`) it is
copied into. Steps 1 and 3 are the lander's `ModuleSteps`. The engine uses
`LayerwiseReloadSteps`, the default; `IN_PLACE` does neither step, for a model
whose checkpoint-format tensors are already real and in place, as in the
planner's replay-versus-``load_weights`` check, which lands with this same
lander.

Modules the plan never touches are left to the session's ``finish()``, which
puts their kernel tensors back unchanged.

Direct copies (``direct``: trainer-side FP8 codes and scales, and with
``landing="planned"`` the copies of every module whose processing keeps its
bytes, ``planned_landing``; each bound to a view of the served tensor it
writes) skip both steps: their bytes are copied into the served view as they
arrive, and their modules are never materialized or processed. The engine
opens the layerwise reload only when the first module must be materialized
(``begin(before_first_module=...)``), so a sync whose copies are all direct
never moves a layer aside.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.distributed.weight_transfer.sharded_rdt_chunks import PullPlan
from vllm.distributed.weight_transfer.sharded_rdt_ops import (
    bit_pattern,
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.sharded_rdt_plan import (
    Region,
    SliceCopy,
    WorkerPlan,
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


class ModuleSteps(Protocol):
    """What happens to a module around the slices landed in it."""

    def materialize(self, module_name: str) -> None:
        """Before the first slice lands in the module in this sync."""

    def process(self, module_name: str) -> None:
        """After the last chunk of the group the plan says completes it."""


class LayerwiseReloadSteps:
    """The engine's steps, inside an open layerwise reload session: give the
    module real checkpoint-format tensors, then run vLLM's per-layer processing
    and copy the result into the kernel tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _info(self, module_name: str):  # -> (module, LayerReloadingInfo)
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        module = self.model.get_submodule(module_name)
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            raise RuntimeError(
                f"{module_name} is not being reloaded; start_weight_update must "
                "run before update_weights"
            )
        return module, info

    def materialize(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        module, info = self._info(module_name)
        materialize_layer(module, info)

    def process(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            _layerwise_process,
        )

        # The module is materialized and filled, and nothing is buffered for
        # it, so vLLM's per-layer step only processes it (quantization,
        # repacking, the session's MoE expert setup) and copies the result into
        # the kernel tensors.
        module, info = self._info(module_name)
        _layerwise_process(module, info)


class _InPlaceSteps:
    def materialize(self, module_name: str) -> None:
        pass

    def process(self, module_name: str) -> None:
        pass


IN_PLACE: ModuleSteps = _InPlaceSteps()
"""Neither step: the checkpoint-format tensors are already real and in place,
and nothing is processed after landing."""


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
    """See the module docstring. ``steps`` defaults to `LayerwiseReloadSteps`
    on ``model``."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: WorkerPlan,
        pulls: PullPlan,
        steps: ModuleSteps | None = None,
        direct: Mapping[SliceCopy, torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.pulls = pulls
        self.steps = LayerwiseReloadSteps(model) if steps is None else steps
        # Copies that land straight in a served tensor, bound to its view
        # (``sharded_rdt_plan.with_direct_copies``): no module step around them.
        self.direct: Mapping[SliceCopy, torch.Tensor] = dict(direct or {})
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
        self._before_first_module: Callable[[], None] | None = None
        self.processed: list[str] = []

    def begin(self, before_first_module: Callable[[], None] | None = None) -> None:
        """Start a sync. ``before_first_module`` runs once, just before the
        first module is materialized (not at all when every copy is
        direct)."""
        self._materialized = set()
        self._before_first_module = before_first_module
        self.processed = []

    @staticmethod
    def _value(landing: _Landing, data: torch.Tensor) -> torch.Tensor:
        """The slice ``landing`` copies, read from its chunk's bytes."""
        spec = landing.copy.slice
        raw = data[landing.offset : landing.offset + spec.nbytes]
        return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)

    @torch.no_grad()
    def land(self, index: int, data: torch.Tensor) -> None:
        """Land chunk ``index`` of the pull plan from its packed bytes."""
        for landing in self._landings[index]:
            served = self.direct.get(landing.copy)
            if served is not None:
                served.copy_(self._value(landing, data))
                continue
            region = landing.copy.region
            if region.module not in self._materialized:
                if self._before_first_module is not None:
                    prepare, self._before_first_module = self._before_first_module, None
                    prepare()
                self.steps.materialize(region.module)
                self._materialized.add(region.module)
            region_view(self.model, region).copy_(self._value(landing, data))
        for module_name in self._completes_after.get(index, ()):
            self.steps.process(module_name)
            self.processed.append(module_name)

    def has_direct(self, index: int) -> bool:
        """Whether chunk ``index`` holds a direct copy."""
        return any(landing.copy in self.direct for landing in self._landings[index])

    @torch.no_grad()
    def direct_differs(self, index: int, data: torch.Tensor) -> torch.Tensor:
        """After chunk ``index`` landed from ``data``: a 0-dim bool tensor,
        true when any served region a direct copy of the chunk wrote differs
        bit for bit from the chunk's bytes for it, cast as the landing casts
        (the landing read back). False for a chunk without direct copies."""
        flags = []
        for landing in self._landings[index]:
            served = self.direct.get(landing.copy)
            if served is None:
                continue
            want = self._value(landing, data)
            if want.dtype != served.dtype:
                want = want.to(served.dtype)
            flags.append(torch.ne(bit_pattern(served), bit_pattern(want)).any())
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()
