# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bake a worker's sharded_rdt plan by dry-running the model's own weight loaders.

Only vLLM's model-specific loaders know which bytes of a checkpoint tensor a
worker keeps (tensor-parallel slicing, QKV and gate/up fusion, expert placement).
`bake_worker_plan` asks them once, at engine init:

1. `checkpoint_format_session` moves every parameter to the meta device in the
   checkpoint format, through vLLM's layerwise-reload machinery
   (`initialize_layerwise_reload`), and remembers the resident tensors.
2. Each parameter's original weight loader (not the layerwise wrapper, which would
   buffer and later materialize) is wrapped so the recorder knows which
   ``(module, parameter)`` the loader is filling.
3. ``model.load_weights`` runs over one `LazyWeight` per checkpoint name. Every
   ``copy_`` a loader ends in is recorded as a `SliceCopy`: the source name and
   view-op chain, and the destination region (offset, shape, stride, dtype).
   Any other write a loader makes to a parameter (a post-transform, a fill)
   ends the bake with `UnplannableLoaderError`.
4. The session puts the resident tensors, loaders and layerwise state back exactly
   as they were; nothing resident is written.
5. `build_plan` groups the copies; modules only partly covered and names no loader
   copied are listed in the plan.

The bake runs under the engine's `VllmConfig` (`set_current_vllm_config`), since
some loaders and layers read it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.plan.lazy import (
    CopyRecorder,
    LazyWeight,
    UnplannableLoaderError,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    ParamCoverage,
    PartialModule,
    SliceCopy,
    WorkerPlan,
    build_plan,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

_MISSING = object()


class IncompletePlanError(RuntimeError):
    """Some modules would be only partly filled by the planned copies."""

    def __init__(self, plan: WorkerPlan):
        self.plan = plan
        listing = "; ".join(p.describe() for p in plan.partial_modules)
        super().__init__(
            f"sharded_rdt plan for {plan.worker} covers only part of "
            f"{len(plan.partial_modules)} module(s): {listing}. Check that the "
            "trainer's metadata lists every checkpoint tensor of these modules, or "
            "use a backend that sends whole tensors."
        )


@dataclass
class _TensorState:
    """What the session must put back for one parameter or buffer slot."""

    kind: str  # "param" or "buffer"
    tensor: torch.Tensor | None
    loader: Any  # the instance's own ``weight_loader`` attribute, or _MISSING


@dataclass
class _ModuleState:
    slots: dict[str, _TensorState]
    non_persistent: set[str]


def _snapshot_module(module: torch.nn.Module) -> _ModuleState:
    slots: dict[str, _TensorState] = {}
    for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
        for name, tensor in table.items():
            loader = _MISSING if tensor is None else vars(tensor).get("weight_loader")
            slots[name] = _TensorState(
                kind=kind,
                tensor=tensor,
                loader=_MISSING if loader is None else loader,
            )
    return _ModuleState(slots, set(module._non_persistent_buffers_set))


def _restore_module(module: torch.nn.Module, state: _ModuleState) -> None:
    for name in list(module._parameters) + list(module._buffers):
        if name not in state.slots:
            delattr(module, name)
    for name, slot in state.slots.items():
        table = module._parameters if slot.kind == "param" else module._buffers
        other = module._buffers if slot.kind == "param" else module._parameters
        other.pop(name, None)
        table[name] = slot.tensor  # type: ignore[assignment]
        if slot.tensor is None:
            continue
        if slot.loader is _MISSING:
            vars(slot.tensor).pop("weight_loader", None)
        else:
            slot.tensor.weight_loader = slot.loader  # type: ignore[attr-defined]
    module._non_persistent_buffers_set.clear()
    module._non_persistent_buffers_set.update(state.non_persistent)


@contextlib.contextmanager
def checkpoint_format_session(model: torch.nn.Module) -> Iterator[None]:
    """Inside: the model's parameters are meta tensors in checkpoint format, with
    their weight loaders attached (layerwise-wrapped). On exit, every module gets
    back its resident parameter and buffer objects, their loaders and values, the
    buffer persistence flags, and its layerwise-reload state; also on error.

    Refuses to start while a layerwise reload (a weight update) is in progress,
    since it would discard that reload's state.
    """
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        initialize_layerwise_reload,
    )

    modules = list(model.modules())
    busy = [
        type(m).__name__
        for m in modules
        if (info := LAYERWISE_INFO.get(m)) is not None and info.can_load()
    ]
    if busy:
        raise RuntimeError(
            f"cannot dry-run the loaders while a weight update is in progress "
            f"({len(busy)} modules mid-reload, first {busy[0]}); bake the plan "
            "at init_weight_transfer_engine, before start_weight_update"
        )
    states = {m: _snapshot_module(m) for m in modules}
    model_attrs = {
        attr: vars(model).get(attr, _MISSING)
        for attr in ("_do_torchao_reload", "_original_do_torchao_reload")
    }
    # Tensors the layerwise machinery leaves resident (biases, expert maps) stay
    # reachable to loaders; keep their values so a stray in-place write is undone.
    resident_values: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        initialize_layerwise_reload(model)
        for module in modules:
            for tensor in list(module._parameters.values()) + list(
                module._buffers.values()
            ):
                if tensor is not None and not tensor.is_meta:
                    resident_values.append((tensor, tensor.detach().clone()))
        yield
    finally:
        with torch.no_grad():
            for tensor, value in resident_values:
                if not torch.equal(tensor, value):
                    tensor.copy_(value)
        for module in modules:
            info = LAYERWISE_INFO.get(module)
            if info is not None:
                info.reset()
            _restore_module(module, states[module])
        for attr, value in model_attrs.items():
            if value is _MISSING:
                vars(model).pop(attr, None)
            else:
                setattr(model, attr, value)


def _install_recording_loaders(model: torch.nn.Module, recorder: CopyRecorder) -> None:
    """Point every parameter's ``weight_loader`` at its original loader, wrapped to
    tell ``recorder`` which parameter is being filled. Tensors created by the
    session are discarded on exit, so nothing here needs undoing; tensors the
    session keeps resident get their loaders back from its snapshot."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
    )

    for module_name, module in model.named_modules():
        for kind_table in (module._parameters, module._buffers):
            for name, tensor in kind_table.items():
                if tensor is None:
                    continue
                original = _get_original_loader(tensor)
                tensor.weight_loader = _attributing_loader(
                    original, recorder, (module_name, name, tensor)
                )


# In-place methods that change no element values.
_NON_WRITING_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


class _LoaderWriteGuard(TorchFunctionMode):
    """Refuses writes a plan cannot reproduce, made while a loader runs.

    A plan lands only slices of checkpoint tensors. A loader that also writes
    values from anywhere else (``param.copy_(fn(param))`` post-transforms,
    ``fill_`` of padding rows, in-place arithmetic) would be silently dropped by
    the plan, so such writes end the bake instead. Writes to empty regions,
    such as filling absent padding, change nothing and pass.
    """

    def __init__(self, recorder: CopyRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.target is not None and args:
            dest = args[0]
            name = getattr(func, "__name__", "")
            writes = func is torch.Tensor.copy_ or (
                name.endswith("_")
                and not name.startswith("_")
                and name not in _NON_WRITING_INPLACE
            )
            if (
                writes
                and isinstance(dest, torch.Tensor)
                and not isinstance(dest, LazyWeight)
                and dest.numel() > 0
            ):
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if not (func is torch.Tensor.copy_ and isinstance(src, LazyWeight)):
                    raise UnplannableLoaderError(
                        f"the weight loader writes values that are not a slice of "
                        f"a checkpoint tensor (Tensor.{name} into "
                        f"{tuple(dest.shape)} elements) while "
                        f"{self.recorder.describe_target()}; a sharded_rdt plan "
                        "only moves checkpoint slices. Load this model with a "
                        "backend that sends whole tensors."
                    )
        return func(*args, **kwargs)


def _attributing_loader(
    loader: Callable[..., Any],
    recorder: CopyRecorder,
    target: tuple[str, str, torch.Tensor],
) -> Callable[..., Any]:
    # functools.wraps keeps ``__wrapped__``, so loaders whose callers inspect the
    # signature (MoE ``return_success``) still see the original parameters.
    @functools.wraps(loader)
    def recording_loader(*args: Any, **kwargs: Any) -> Any:
        outer = (recorder.target, recorder.source)
        recorder.target = target
        recorder.source = next(
            (a.source for a in (*args, *kwargs.values()) if isinstance(a, LazyWeight)),
            None,
        )
        try:
            return loader(*args, **kwargs)
        finally:
            recorder.target, recorder.source = outer

    return recording_loader


def _coverage(
    model: torch.nn.Module, copies: Sequence[SliceCopy]
) -> list[PartialModule]:
    """Modules whose distinct recorded regions cover some but not all of the
    elements the layerwise machinery expects their loaders to fill."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import (
        get_layer_tensors,
        get_tensor_load_numel,
    )

    covered: dict[tuple[str, str], int] = {}
    seen: set[Any] = set()
    for copy in copies:
        if copy.region in seen:
            continue
        seen.add(copy.region)
        key = (copy.region.module, copy.region.param)
        covered[key] = covered.get(key, 0) + copy.region.numel

    partial: list[PartialModule] = []
    touched = {module for module, _ in covered}
    for module_name, module in model.named_modules():
        if module_name not in touched:
            continue
        params = tuple(
            ParamCoverage(
                param=name,
                covered=covered.get((module_name, name), 0),
                expected=get_tensor_load_numel(tensor),
            )
            for name, tensor in get_layer_tensors(module).items()
            if name not in SKIP_LOAD_TENSORS
        )
        total_covered = sum(p.covered for p in params)
        total_expected = sum(p.expected for p in params)
        if total_covered < total_expected:
            partial.append(
                PartialModule(
                    module=module_name,
                    covered=total_covered,
                    expected=total_expected,
                    params=params,
                )
            )
    return partial


def bake_worker_plan(
    model: torch.nn.Module,
    weights: Sequence[ParamMeta],
    *,
    worker: str,
    vllm_config: Any | None = None,
    device: torch.device | str | None = None,
    allow_partial: bool = False,
) -> WorkerPlan:
    """Dry-run ``model.load_weights`` over ``weights`` and return the plan.

    ``weights`` is the producer's metadata (name, dtype, full shape) in its
    order; the order fixes the gather groups. ``vllm_config`` is made current
    for the dry run. ``device`` is what the lazy tensors report as their device
    (the model's device by default). Raises `UnplannableLoaderError` when a loader
    does something other than views and a copy, and `IncompletePlanError` when a
    module is only partly covered unless ``allow_partial``.
    """
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    started = time.perf_counter()
    recorder = CopyRecorder()
    config_context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if vllm_config is not None:
        from vllm.config import set_current_vllm_config

        config_context = set_current_vllm_config(vllm_config)
    with config_context, torch.no_grad(), checkpoint_format_session(model):
        _install_recording_loaders(model, recorder)
        guard = _LoaderWriteGuard(recorder)
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
        load_weights = model.load_weights  # type: ignore[assignment]
        with guard:
            load_weights(_lazy_item(meta, device, recorder) for meta in weights)
        partial = _coverage(model, recorder.copies)
    plan = build_plan(
        worker=worker,
        names=[meta.name for meta in weights],
        copies=recorder.copies,
        partial_modules=partial,
    )
    logger.info(
        "sharded_rdt plan for %s: %d copies from %d of %d checkpoint tensors, "
        "%d bytes, baked in %.3f s (digest %s)",
        worker,
        len(plan.copies),
        len(weights) - len(plan.unused_names),
        len(weights),
        plan.nbytes,
        time.perf_counter() - started,
        plan.digest(),
    )
    if plan.partial_modules and not allow_partial:
        raise IncompletePlanError(plan)
    return plan


def _lazy_item(
    meta: ParamMeta, device: torch.device | str, recorder: CopyRecorder
) -> tuple[str, LazyWeight]:
    """``(name, LazyWeight)`` as ``load_weights`` expects its items."""
    return meta.name, LazyWeight(
        meta.name, tuple(meta.shape), meta.dtype, device=device, recorder=recorder
    )
