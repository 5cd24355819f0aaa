# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Planned landing (``WeightTransferConfig.landing="planned"``): checkpoint
tensors whose every byte lands in a layer that vLLM's post-load processing
leaves alone are copied straight into the served tensors, once per byte.

The layerwise reload every update otherwise takes rebuilds each layer it
touches: it moves the layer to the meta device, materializes empty
checkpoint-format tensors, lets the model's loaders copy into them, runs the
layer's post-load processing and copies the result into the kernel tensors.
For a layer whose processing is the identity (its kernel tensors *are* its
checkpoint-format tensors), all of that collapses into the loaders' copies.

``LandingPlan.bake`` decides, once per engine and trainer layout:

1. the sharded_rdt planner (``bake_worker_plan``) dry-runs the model's own
   ``load_weights`` over the trainer's names, shapes and dtypes and records
   which slice of which tensor each loader copies into which region of which
   parameter, for this worker's TP rank;
2. each module the plan writes is proven, not assumed, to keep its bytes:
   ``cpu_linear.post_load_keeps_bytes`` runs its processing on a copy filled
   with marker values and checks that nothing else was built from them (a
   module with no post-load processing keeps them trivially); attention
   layers whose processing vLLM defers to the end of a reload, and fused MoE
   layers (whose experts' kernel prepares its own layout, outside the
   layer's processing), never qualify;
3. a checkpoint name is *direct* when every module it writes qualifies, and a
   module is direct when every name that writes it is. Everything else (MoE
   experts vLLM CPU repacks, packed linear layers, quantized layers) is left
   to the layerwise reload, in the same update;
4. each direct copy is bound to a view of the live tensor it writes.

``LandingPlan.land(name, tensor)`` then replays the recorded slices of
``tensor`` into those views: exactly the copies the model's loaders would
make, with nothing materialized, processed or copied back. ``check_whole``
refuses a finish whose names cover only part of a direct module's tensors, as
the layerwise reload refuses a partly loaded layer.

The views are bound to the tensor objects that serve; ``still_bound`` tells
the engine to bake again when any of them was replaced.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.landing.bound_places import RecordsPlaces
from vllm.distributed.weight_transfer.landing.completeness import (
    IncompleteUpdateError,
    first_few,
    partly_written,
)
from vllm.distributed.weight_transfer.landing.regions import region_view
from vllm.distributed.weight_transfer.plan.ops import (
    SliceSpec,
    bit_pattern,
    replay_slice,
)
from vllm.distributed.weight_transfer.plan.worker_plan import SliceCopy, WorkerPlan
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["LandingPlan", "bit_pattern"]


@dataclass(frozen=True)
class _Bound:
    """One planned copy bound to the live tensor it writes."""

    copy: SliceCopy
    view: torch.Tensor

    @property
    def spec(self) -> SliceSpec:
        return self.copy.slice


@dataclass
class LandingPlan(RecordsPlaces):
    """Which checkpoint names land straight in served tensors, and how; see
    the module docstring. Build it with ``bake``."""

    plan: WorkerPlan
    # Direct names: the copies of each, bound to live views.
    copies: dict[str, list[_Bound]]
    # Direct modules: the names that write each one.
    writers: dict[str, frozenset[str]]
    # Modules left to the layerwise reload, with the reason.
    reloaded: dict[str, str]
    # (module, parameter name, tensor) of every bound view.
    _targets: list[tuple[torch.nn.Module, str, torch.Tensor]]
    # The served tensors the direct copies write, by region qualname (what a
    # bound copy program writes: ``chunk_programs``).
    served: dict[str, torch.Tensor]
    # The last set of received names ``check_whole`` passed (it is a pure
    # function of the names, and a sync usually sends the same ones).
    _passed_whole: set[str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @cached_property
    def direct_names(self) -> frozenset[str]:
        return frozenset(self.copies)

    @cached_property
    def direct_bytes(self) -> int:
        return sum(b.spec.nbytes for bound in self.copies.values() for b in bound)

    @classmethod
    def bake(
        cls,
        model: torch.nn.Module,
        metas: Sequence[ParamMeta],
        *,
        worker: str,
        vllm_config: Any | None,
    ) -> LandingPlan:
        """Plan ``metas`` (the trainer's names, dtypes and shapes, in its
        order) for ``model``, under ``vllm_config`` (made current, as at
        load); run it while no update is landing."""
        from vllm.distributed.weight_transfer.plan.bake import (
            bake_worker_plan,
        )

        plan = bake_worker_plan(
            model, metas, worker=worker, vllm_config=vllm_config, allow_partial=True
        )
        return cls.of_plan(model, plan, vllm_config=vllm_config)

    @classmethod
    def of_plan(
        cls, model: torch.nn.Module, plan: WorkerPlan, *, vllm_config: Any | None
    ) -> LandingPlan:
        """Steps 2-4 of the module docstring for a plan already baked for
        ``model`` (``sharded_rdt`` bakes its own at init)."""
        worker = plan.worker
        writers: dict[str, set[str]] = {}
        writes: dict[str, set[str]] = {}
        for copy in plan.copies:
            writers.setdefault(copy.region.module, set()).add(copy.slice.source)
            writes.setdefault(copy.slice.source, set()).add(copy.region.module)
        reloaded = _modules_that_reload(model, writers, vllm_config)
        for partial in plan.partial_modules:
            reloaded.setdefault(
                partial.module,
                f"the trainer's names cover {partial.covered} of its "
                f"{partial.expected} elements",
            )
        # A name that writes a reloaded module goes through the reload, and
        # then so does every module it writes: a module gets all its bytes
        # one way or the other.
        changed = True
        while changed:
            changed = False
            for name, modules in writes.items():
                if modules & reloaded.keys():
                    for module in modules - reloaded.keys():
                        reloaded[module] = f"{name} also writes a reloaded module"
                        changed = True
        direct_modules = writers.keys() - reloaded.keys()
        copies: dict[str, list[_Bound]] = {}
        targets: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        served: dict[str, torch.Tensor] = {}
        for copy in plan.copies:
            region = copy.region
            if region.module not in direct_modules:
                continue
            view = region_view(model, region)
            copies.setdefault(copy.slice.source, []).append(_Bound(copy, view))
            if region.qualname not in served:
                owner = model.get_submodule(region.module)
                tensor = getattr(owner, region.param)
                served[region.qualname] = tensor
                targets.append((owner, region.param, tensor))
        landing = cls(
            plan=plan,
            copies=copies,
            writers={m: frozenset(writers[m]) for m in direct_modules},
            reloaded=reloaded,
            _targets=targets,
            served=served,
        )
        landing.record_places(targets)
        logger.info(
            "planned landing for %s: %d of %d checkpoint tensors (%d bytes) land "
            "straight in %d served module(s); %d module(s) go through the "
            "layerwise reload%s",
            worker,
            len(copies),
            len(writes),
            landing.direct_bytes,
            len(direct_modules),
            len(reloaded),
            _some_reasons(reloaded),
        )
        return landing

    def bound_copies(self) -> dict[SliceCopy, torch.Tensor]:
        """Every direct copy of the plan, bound to the view of the served
        tensor it writes (what ``sharded_rdt_reload.ChunkLander`` takes as
        ``direct``)."""
        return {b.copy: b.view for bound in self.copies.values() for b in bound}

    def still_bound(self) -> bool:
        """Whether every bound view still belongs to the tensor that serves:
        each target is still what ``getattr(module, name)`` returns, and its
        memory is still the memory the views were cut from (a tensor whose
        storage was swapped keeps its identity, not its address)."""
        params, shadows, keys, tensors, others = self._held
        return (
            all(map(operator.is_, map(dict.get, params, keys), tensors))
            and not any(map(operator.contains, shadows, keys))
            and all(getattr(m, p, None) is t for m, p, t in others)
            and self.places_unchanged(self._targets)
        )

    @cached_property
    def _held(self) -> tuple[list, list, list, list, list]:
        """The targets a module holds as parameters, as parallel lists (its
        ``_parameters``, its instance ``__dict__``, which would shadow them,
        the names, the tensors) for ``still_bound`` to check in C-level maps;
        and the other targets (buffers, attributes), checked by ``getattr``."""
        params, shadows, keys, tensors, others = [], [], [], [], []
        for module, name, tensor in self._targets:
            if module._parameters.get(name) is tensor and not hasattr(
                type(module), name
            ):
                params.append(module._parameters)
                shadows.append(module.__dict__)
                keys.append(name)
                tensors.append(tensor)
            else:
                others.append((module, name, tensor))
        return params, shadows, keys, tensors, others

    @torch.no_grad()
    def land(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the planned slices of ``tensor`` (checkpoint name ``name``)
        into the served tensors."""
        for bound in self.copies[name]:
            bound.view.copy_(replay_slice(tensor, bound.spec))

    @torch.no_grad()
    def landed_differs(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A 0-dim bool tensor on the served tensors' device, true when any
        served region a planned copy of ``name`` wrote differs, bit for bit,
        from the slice of ``tensor`` (the trainer's tensor of that name) the
        plan takes for it, cast as the landing casts: the landing read back.
        A tensor, not a bool, so a caller checking many names waits for the
        device once."""
        flags = []
        for bound in self.copies[name]:
            want = replay_slice(tensor, bound.spec)
            if want.dtype != bound.view.dtype:
                want = want.to(bound.view.dtype)
            flags.append(torch.ne(bit_pattern(bound.view), bit_pattern(want)).any())
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()

    def slices(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The planned slices of ``tensor``, in the order ``land_slices``
        takes them: all of it this worker keeps (its TP shard), as views
        where the loader's ops are views."""
        return [replay_slice(tensor, bound.spec) for bound in self.copies[name]]

    @torch.no_grad()
    def land_slices(self, name: str, slices: Sequence[torch.Tensor]) -> None:
        """Copy slices taken by ``slices`` (or copies of them) into the
        served tensors."""
        for bound, piece in zip(self.copies[name], slices, strict=True):
            bound.view.copy_(piece)

    def check_whole(self, received: Iterable[str]) -> None:
        """``IncompleteUpdateError`` when ``received`` writes part of a direct
        module: the module would serve old and new bytes together."""
        got = set(received)
        if got == self._passed_whole:
            return
        lacking = partly_written(self.writers, got)
        if lacking:
            raise IncompleteUpdateError(
                f"the update writes {len(lacking)} layer(s) without all of their "
                f"tensors: {first_few(lacking, 4, '; ')}. An update must carry "
                "every tensor of "
                "each layer it touches (send them at their current values where "
                "they did not change)"
            )
        self._passed_whole = got


def _modules_that_reload(
    model: torch.nn.Module, writers: dict[str, set[str]], vllm_config: Any
) -> dict[str, str]:
    """The written modules whose bytes cannot land directly, with the reason."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.landing.cpu_linear import (
        post_load_keeps_bytes,
    )
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    reloaded: dict[str, str] = {}
    config_context: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext()
        if vllm_config is None
        else set_current_vllm_config(vllm_config)
    )
    with config_context:
        for name in writers:
            module = model.get_submodule(name)
            if is_deferred_attention_layer(module):
                reloaded[name] = "vLLM processes it at the end of a reload"
            elif isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase):
                # Its kernel's layout is prepared by the experts' own setup,
                # which a reload runs again (``layerwise_session``) but the
                # layer's processing alone does not show.
                reloaded[name] = "fused MoE experts (their kernel prepares a layout)"
            elif not post_load_keeps_bytes(module):
                reloaded[name] = "its post-load processing changes the bytes"
    return reloaded


def _some_reasons(reloaded: dict[str, str]) -> str:
    if not reloaded:
        return ""
    shown = list(reloaded.items())[:3]
    return " (" + "; ".join(f"{m}: {r}" for m, r in shown) + ", ...)"
