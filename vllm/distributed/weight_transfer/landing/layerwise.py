# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One weight update landed through vLLM's layerwise reload, for any backend that
receives checkpoint-format tensors (``ipc``, ``sharded_rdt``).

Lifecycle, driven by the worker engine:

1. ``start()`` (from ``start_weight_update``): opens the session and leaves the
   model untouched, so generation that runs before the first weights arrive
   uses the served weights.
2. ``begin_landing()`` (at the first weights; ``load`` calls it): every layer's
   kernel tensors are kept aside and the layer is rebuilt on the meta device
   with buffering weight loaders (``initialize_layerwise_reload``). From here
   until the session closes, a forward pass of the model cannot run on the
   meta layers: a forward pre-hook aborts the session first (below).
3. ``load(weights, foreign_storages)`` (from ``update_weights``, any number of
   times): a name already received in this session is refused before it
   loads; then ``model.load_weights``; a layer is materialized, loaded, processed
   (fusing, quantization, repacking) and copied back into its kernel tensors as
   soon as all its weights have arrived. Weights of a layer that is still
   incomplete stay buffered; the buffered ones that alias ``foreign_storages``
   (memory the sender will reuse, such as a packed transfer buffer) are copied,
   so once ``load`` returns the session holds no reference into them.
4. ``finish()`` (from ``finish_weight_update``): the names received must cover
   every fused group they touch (``update_completeness``), and every layer
   that received a weight must have received all its parameters (a linear
   layer's bias alone would leave its weight uninitialized); otherwise the
   session aborts and ``IncompleteUpdateError`` names what is missing. Then
   layers that got no weights go back to their kernel tensors, the rest are
   processed (``finalize_layerwise_reload``). vLLM's "Failed to load weights"
   warning for each layer left out is dropped (counted at debug level): the
   fork's updates leave layers to a plan, a shadow or unchanged by design,
   and check completeness themselves.
   ``abort(reason)`` (on any failure): every layer that did not complete goes
   back to its resident kernel tensors unchanged, so the model keeps serving;
   layers completed before the failure keep their new weights.

A forward pass while layers are on the meta device (generation was not paused
for the update) aborts the session with a reason that says so, then runs on the
restored layers; ``on_abort(reason, landed)`` tells the worker engine, which
fences the engine when weights had landed. ``aborted_reason`` keeps the reason
for the trainer's next call.

Deadline: ``timeout_s`` bounds the gap between two calls of one update
(``WeightTransferConfig.update_timeout_s``). ``load`` and ``finish`` check it
first; past it the session aborts as above and the call raises
``TimeoutError`` with the reason. The check runs at the next call because a
worker runs one call at a time: no other thread touches the model.

Processing fixes applied during a session. First, on a weight update, vLLM's unquantized
MoE method skips the experts' layer-level setup it runs at first load
(``FusedMoEExperts.process_weights_after_loading``), so CPU experts would keep
plain-layout weights where their kernel expects the prepacked layout. While a
session is open, the MoE layers whose experts need that setup (``_RESETUP_EXPERTS``)
run it again on the freshly loaded layer, exactly as at first load, before the
result is copied into the kernel tensors. Second, vLLM CPU's int8 scaled-MM
kernel (compressed-tensors W8A8 checkpoints) builds a oneDNN handle that keeps
the address of the weight scale it was built over; vLLM's reload drops that
tensor once its values are copied into the kernel tensors, so the handle would
read freed memory (the engine served token 0 after a no-op push, with no
error). Such a layer keeps the tensors its processing made for as long as the
handle built over them (``_hook_handles_over_processed_tensors``). Third, the
same kernel leaves ``weight`` registered as None after processing, which
vLLM's reload does not keep aside: a layer it put back unprocessed (an aborted
update, or a layer the update did not touch) had no ``weight`` and its next
forward stopped the engine. The session puts such names back as None when it
closes (``_note_empty_slots``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from vllm.distributed.weight_transfer.landing.completeness import (
    FusedGroups,
    layers_lacking,
)
from vllm.distributed.weight_transfer.landing.update_calls import (
    CalledSession,
    UpdateCalls,
)
from vllm.logger import init_logger


class DirectLanding(Protocol):
    """What writes checkpoint tensors straight into served tensors
    (``planned_landing.LandingPlan``, ``codes_landing.CodesLanding``)."""

    def land(self, name: str, tensor: torch.Tensor) -> None: ...

    def check_whole(self, received: Iterable[str]) -> None: ...


logger = init_logger(__name__)


def load_with_model_loaders(
    model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]
) -> None:
    """``model.load_weights(weights)`` as an update runs it: without autograd
    and without vLLM's check that an MTP checkpoint is whole (an update may
    carry part of a model)."""
    from vllm.model_executor.model_loader.mtp_validation import (
        disable_mtp_completeness_check,
    )

    with torch.no_grad(), disable_mtp_completeness_check():
        model.load_weights(weights=weights)  # type: ignore[operator]


class _UntouchedLayers(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warnings and counts
    them: in an update that lands only some layers through the reload (the
    others planned, shadowed or unchanged), every other layer would warn,
    though it keeps its weights by design and completeness is checked here."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().endswith(": Failed to load weights"):
            self.kept += 1
            return False
        return True


@contextlib.contextmanager
def _quiet_untouched_layers() -> Iterator[None]:
    reload_logger = logging.getLogger(
        "vllm.model_executor.model_loader.reload.layerwise"
    )
    untouched = _UntouchedLayers()
    reload_logger.addFilter(untouched)
    try:
        yield
    finally:
        reload_logger.removeFilter(untouched)
        if untouched.kept:
            logger.debug(
                "%d layer(s) not in this update kept their weights", untouched.kept
            )


def _resetup_experts_classes() -> tuple[type, ...]:
    """Experts whose layer-level setup must run again after every reload."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:
        return ()
    return (CPUUnquantizedExperts,)


# Where a layer keeps the processed tensors its kernel's handle reads.
_HANDLE_TENSORS = "_weight_transfer_handle_tensors"


def _handle_over_processed_tensors_classes() -> tuple[type, ...]:
    """Kernels whose processing builds a handle that reads the layer's
    processed tensors through raw pointers, not references: vLLM CPU's int8
    scaled-MM (its oneDNN handle keeps the weight scale's address)."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
            CPUInt8ScaledMMLinearKernel,
        )
    except ImportError:
        return ()
    return (CPUInt8ScaledMMLinearKernel,)


class UnreloadableLayersError(RuntimeError):
    """The served model has layers that vLLM cannot process a second time
    without corrupting the worker's memory; raised before anything lands."""


def unreloadable_layers(model: torch.nn.Module) -> list[str]:
    """Layers served by vLLM CPU's int8 scaled-MM kernel with static
    activation quantization (a compressed-tensors W8A8 checkpoint with
    ``"dynamic": false`` activations). Measured on vLLM CPU 0.32: after one
    reload of such a layer, the first forward pass aborts the worker with a
    heap corruption (``corrupted size vs. prev_size``, ``double free or
    corruption``), with vLLM's own ``reload_weights`` as with the fork's
    updates, so the engine stops; with dynamic activations the same kernel
    reloads correctly (``_hook_handles_over_processed_tensors``)."""
    classes = _handle_over_processed_tensors_classes()
    if not classes:
        return []
    return [
        name
        for name, module in model.named_modules()
        if isinstance(
            kernel := getattr(getattr(module, "scheme", None), "kernel", None), classes
        )
        and getattr(getattr(kernel, "config", None), "is_static_input_scheme", False)
    ]


def refuse_unreloadable_layers(layers: list[str]) -> None:
    """Raise ``UnreloadableLayersError`` naming ``layers`` (from
    ``unreloadable_layers``) when there are any: called before an update
    hands its first weight to the model, so the refusal changes nothing."""
    if layers:
        raise UnreloadableLayersError(
            f"this engine serves {len(layers)} layer(s) (first: {layers[0]}) "
            "through vLLM CPU's int8 scaled-MM kernel with static activation "
            "scales, which vLLM cannot process again without corrupting the "
            "worker's memory (its own reload_weights stops the engine the same "
            "way); nothing was changed. Serve a checkpoint with dynamic "
            'activations (input_activations "dynamic": true) to update its '
            "weights"
        )


def _fused_experts(module: torch.nn.Module) -> tuple[Any, Any] | None:
    quant_method = getattr(module, "quant_method", None)
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    return quant_method, experts


class SharedScalarLoads:
    """A fused layer (``qkv_proj`` from ``q_proj``, ``k_proj``, ``v_proj``)
    may hold one value for all of its shards: a static activation scale
    (``input_scale``, and ``input_zero_point`` when asymmetric) is one
    element, and each shard's checkpoint tensor is loaded into it in turn.
    vLLM's layerwise reload counts every such load towards the layer's
    elements, so the layer was processed before its last shard's scale
    arrived, and that load then failed on the processed layer. Within one
    update the first shard's value is loaded and the other shards' are
    checked against it and left out: equal values change nothing (the shards
    of a fused layer read the same input, so calibration gives them the same
    scale), and different values are refused (``ValueError``), since the
    layer can serve only one."""

    def __init__(self, model: torch.nn.Module) -> None:
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        self._fused_name_of = {
            member: fused
            for fused, members in mapping.items()
            if len(members) > 1
            for member in members
        }
        self._model = model
        # fused parameter name -> (checkpoint name loaded, its value)
        self._loaded: dict[str, tuple[str, torch.Tensor]] = {}

    def once_each(
        self, weights: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """``weights`` without the shard values already loaded (above)."""
        if not self._fused_name_of:
            return weights
        kept: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            target = self._shared_scalar(name)
            if target is None:
                kept.append((name, tensor))
                continue
            first = self._loaded.get(target)
            if first is None:
                self._loaded[target] = (name, tensor.detach().cpu().clone())
                kept.append((name, tensor))
                continue
            first_name, value = first
            if not torch.equal(tensor.detach().cpu().to(value.dtype), value):
                raise ValueError(
                    f"{name} = {tensor.flatten().tolist()} differs from "
                    f"{first_name} = {value.flatten().tolist()}: vLLM fuses them "
                    f"into {target}, which holds one value for all shards; send "
                    "the same value for every shard of the layer"
                )
        return kept

    def _shared_scalar(self, name: str) -> str | None:
        """The fused layer's one-element parameter ``name`` loads into, or
        None when it loads elsewhere."""
        module_path, _, leaf = name.rpartition(".")
        parent, _, member = module_path.rpartition(".")
        fused = self._fused_name_of.get(member)
        if fused is None:
            return None
        fused_path = f"{parent}.{fused}" if parent else fused
        try:
            module = self._model.get_submodule(fused_path)
        except AttributeError:
            return None
        value = getattr(module, leaf, None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return None
        return f"{fused_path}.{leaf}"


class LayerwiseReloadSession(CalledSession):
    """Land one weight update into ``model``; see the module docstring."""

    session_noun = "layerwise reload session"

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        on_abort: Callable[[str, bool], None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.on_abort = on_abort
        # The deadline between calls, the names received, the abort reason.
        self._calls = UpdateCalls(timeout_s)
        self._hooked: list[Any] = []
        # (layer, parameter names, buffer names) registered as None: see
        # ``_note_empty_slots``.
        self._empty_slots: list[tuple[torch.nn.Module, list[str], list[str]]] = []
        self._shared_scalars: SharedScalarLoads | None = None
        self._open = False
        self._landing = False
        self._forward_guard: Any = None
        # The direct landings that wrote served tensors in this update.
        self._direct: list[DirectLanding] = []
        # Whether copies outside any DirectLanding wrote served tensors
        # (``writing_served``).
        self._wrote_served = False

    @property
    def landing(self) -> bool:
        """Whether layers have been moved aside for this update."""
        return self._landing

    def _abort_overdue(self, reason: str) -> None:
        """Abort, then tell ``on_abort`` whether the update had touched the
        model."""
        landed = self.touched_model
        self.abort(reason)
        if self.on_abort is not None:
            self.on_abort(reason, landed)

    @property
    def touched_model(self) -> bool:
        """Whether this update moved layers aside or wrote served tensors."""
        return self._landing or bool(self._direct) or self._wrote_served

    def writing_served(self) -> None:
        """Copies bound to served tensors outside any ``DirectLanding``
        (``sharded_rdt_reload.ChunkLander``'s direct copies) are about to
        run: from here until the session closes, a forward pass aborts it,
        and an abort counts the model as touched (idempotent)."""
        if not self._open:
            raise RuntimeError(self.closed_message("landing"))
        self._wrote_served = True
        self._guard_forward()

    def begin_landing(self) -> None:
        """Move the layers aside for loading (idempotent)."""
        from vllm.model_executor.model_loader.reload import (
            initialize_layerwise_reload,
        )

        if not self._open:
            raise RuntimeError(self.closed_message("landing"))
        if self._landing:
            return
        self._note_empty_slots()
        initialize_layerwise_reload(self.model)
        self._landing = True
        self._hook_experts_resetup()
        self._hook_handles_over_processed_tensors()
        self._guard_forward()

    def land_planned(
        self, landing: DirectLanding, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy ``weights`` (names ``landing`` lands) straight into the
        served tensors (``planned_landing``, ``codes_landing``), under the
        same deadline, duplicate-name and forward-pass checks as ``load``."""
        weights = list(weights)

        def land() -> None:
            for name, tensor in weights:
                landing.land(name, tensor)

        self.land_bound(landing, [name for name, _ in weights], land, "land_planned()")

    def land_bound(
        self,
        landing: DirectLanding,
        names: Iterable[str],
        run: Callable[[], None],
        what: str = "land_bound()",
    ) -> None:
        """Run ``run``, which lands exactly the planned bytes of ``names``
        (direct names of ``landing``: a bound program of ``chunk_programs``,
        or staged slices at a commit), under the same deadline,
        duplicate-name and forward-pass checks as ``load``."""
        fresh = self._admit_names(list(names), what)
        self._guard_forward()
        if not any(d is landing for d in self._direct):
            self._direct.append(landing)
        self._calls.received |= fresh
        with torch.no_grad():
            run()

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        foreign_storages: set[int] | None = None,
    ) -> None:
        weights, fresh = self._admit(weights, "load()")
        self.begin_landing()
        self._calls.received |= fresh
        if self._shared_scalars is None:
            self._shared_scalars = SharedScalarLoads(self.model)
        weights = self._shared_scalars.once_each(weights)
        load_with_model_loaders(self.model, weights)
        if foreign_storages:
            self._copy_pending(foreign_storages)

    def _admit(
        self, weights: Iterable[tuple[str, torch.Tensor]], what: str
    ) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
        """``weights`` as a list, and their names, once the session is open,
        within its deadline, and none of the names received before; else the
        call ``what`` raises before anything lands."""
        weights = list(weights)
        return weights, self._admit_names([name for name, _ in weights], what)

    def _admit_names(self, names: list[str], what: str) -> set[str]:
        """The fresh ones among ``names``, once the session is open, within its
        deadline, and none of them received before; else ``what`` raises
        before anything lands."""
        if not self._open:
            raise RuntimeError(self.closed_message(what))
        self.check_deadline(what)
        return self._calls.new_names(names)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._open:
            raise RuntimeError(self.closed_message("finish()"))
        self.check_deadline("finish()")
        if not self.touched_model:
            self._close()  # nothing arrived: the model was never touched
            return
        try:
            groups = FusedGroups.of(
                self.model, getattr(self.model_config, "hf_config", None)
            )
            groups.check(self._calls.received)
            for direct in self._direct:
                direct.check_whole(self._calls.received)
            if self._landing:
                self._check_layers_whole()
                with _quiet_untouched_layers():
                    finalize_layerwise_reload(self.model, self.model_config)
        except BaseException as e:
            self.abort(f"{type(e).__name__}: {e}")
            raise
        self._close()

    def abort(self, reason: str = "the update was aborted") -> None:
        """Put every layer that did not complete back on its kernel tensors."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _place_kernel_tensors,
        )

        if not self._open:
            return
        self._calls.aborted_reason = reason
        if not self._landing:
            self._close()
            return
        restored = 0
        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load():
                continue
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer, info)
                restored += 1
            info.reset()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload
        self._close()
        logger.warning(
            "Weight update aborted; %d layer(s) restored to their previous weights",
            restored,
        )

    # -- internals ---------------------------------------------------------

    def _close(self) -> None:
        self._restore_empty_slots()
        self._shared_scalars = None
        for quant_method in self._hooked:
            quant_method.__dict__.pop("process_weights_after_loading", None)
        self._hooked.clear()
        if self._forward_guard is not None:
            self._forward_guard.remove()
            self._forward_guard = None
        self._open = False
        self._landing = False
        self._direct = []
        self._wrote_served = False
        self._calls.received = set()

    def _guard_forward(self) -> None:
        """Until the session closes, a forward pass aborts it (idempotent)."""
        if self._forward_guard is None:
            self._forward_guard = self.model.register_forward_pre_hook(
                self._forward_while_landing
            )

    def _forward_while_landing(self, module: Any, args: Any) -> None:
        """Forward pre-hook installed while layers sit on the meta device."""
        reason = (
            "the engine ran a forward pass while the weight update was landing "
            "(generation was not paused); pause generation before "
            "start_weight_update"
        )
        logger.error("Aborting the open weight update: %s", reason)
        self.abort(reason)
        if self.on_abort is not None:
            self.on_abort(reason, True)

    def _check_layers_whole(self) -> None:
        """``IncompleteUpdateError`` if a layer this update touched lacks a
        parameter: vLLM would rebuild it with that parameter's memory
        uninitialized (an update of a linear layer's bias alone)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

        lacking: list[str] = []
        layers = 0
        for prefix, layer in self.model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or info.load_numel <= 0:
                continue  # untouched: it keeps its kernel tensors
            loaded = {name for name, _ in info.loaded_weights}
            missing = [
                f"{prefix}.{name}" if prefix else name
                for name, param in layer._parameters.items()
                if param is not None
                and name not in SKIP_LOAD_TENSORS
                and name not in loaded
            ]
            layers += bool(missing)
            lacking += missing
        if lacking:
            raise layers_lacking(lacking, layers)

    def _hook_experts_resetup(self) -> None:
        classes = _resetup_experts_classes()
        if not classes:
            return
        for module in self.model.modules():
            found = _fused_experts(module)
            if found is None or not isinstance(found[1], classes):
                continue
            quant_method, _ = found
            if "process_weights_after_loading" in quant_method.__dict__:
                continue  # shared quant method, already hooked
            original = quant_method.process_weights_after_loading

            def process_then_resetup(layer, _qm=quant_method, _orig=original):
                _orig(layer)
                _qm.moe_kernel.fused_experts.process_weights_after_loading(layer)

            quant_method.process_weights_after_loading = process_then_resetup
            self._hooked.append(quant_method)

    def _hook_handles_over_processed_tensors(self) -> None:
        """vLLM's reload processes a layer on tensors of its own, copies the
        results into the served tensors and drops its own. A handle built
        during that processing over raw pointers would then read freed
        memory: a reloaded vLLM CPU int8 W8A8 layer computed ``inf`` and
        the engine served token 0 with no error. For such layers the
        processed tensors stay with the layer, as long as the handle built
        over them (until the layer is processed again)."""
        classes = _handle_over_processed_tensors_classes()
        if not classes:
            return
        for module in self.model.modules():
            kernel = getattr(getattr(module, "scheme", None), "kernel", None)
            quant_method = getattr(module, "quant_method", None)
            if not isinstance(kernel, classes) or quant_method is None:
                continue
            if "process_weights_after_loading" in quant_method.__dict__:
                continue  # shared quant method, already hooked
            original = quant_method.process_weights_after_loading

            def process_then_keep(layer, _orig=original):
                _orig(layer)
                layer.__dict__[_HANDLE_TENSORS] = dict(
                    layer.named_parameters(recurse=False)
                )

            quant_method.process_weights_after_loading = process_then_keep
            self._hooked.append(quant_method)

    def _note_empty_slots(self) -> None:
        """Some kernels leave a parameter registered as None once they have
        processed a layer (vLLM CPU's int8 W8A8 kernel keeps its weight in a
        oneDNN handle and sets ``weight`` to None; dynamic activation schemes
        register ``input_scale`` as None) and read it back by name when they
        run. vLLM's reload keeps aside only the tensors that are set, so a
        layer it puts back unprocessed (the update aborted, or the layer got
        no weights) lost those names, and its next forward raised
        ``AttributeError``, which stopped the engine. The names are noted
        here, before the layers move aside, and put back as None when the
        session closes (``_restore_empty_slots``)."""
        self._empty_slots = []
        for layer in self.model.modules():
            params = [n for n, p in layer._parameters.items() if p is None]
            buffers = [n for n, b in layer._buffers.items() if b is None]
            if params or buffers:
                self._empty_slots.append((layer, params, buffers))

    def _restore_empty_slots(self) -> None:
        """Register as None again every name ``_note_empty_slots`` noted that
        the layer no longer has (a layer processed anew sets its own)."""
        for layer, params, buffers in self._empty_slots:
            for name in params:
                if not hasattr(layer, name):
                    layer.register_parameter(name, None)
            for name in buffers:
                if not hasattr(layer, name):
                    layer.register_buffer(name, None)
        self._empty_slots = []

    def _copy_pending(self, foreign_storages: set[int]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        copied = 0
        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.loaded_weights:
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if (
                        isinstance(value, torch.Tensor)
                        and value.numel()
                        and value.device.type != "meta"
                        and value.untyped_storage().data_ptr() in foreign_storages
                    ):
                        bound.arguments[key] = value.clone()
                        copied += 1
        if copied:
            logger.debug("Copied %d buffered weight(s) out of the transfer", copied)
