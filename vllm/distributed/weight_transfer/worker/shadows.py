# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A staged update's layers loaded and processed while the engine serves, then
put in place at the commit by copies and attribute swaps.

vLLM processes a layer after loading it (on vLLM CPU, an unquantized linear
layer's weight is repacked into a oneDNN or sgl-kernel handle and the plain
tensor dropped). A staged commit that lands through the layerwise reload runs
that processing for every layer inside the commit, while generation is held.
``ShadowLayers`` moves it out of the commit: each incoming checkpoint tensor is
loaded, by the model's own ``load_weights`` and weight loaders, into a
*shadow* of its layer (a separate module object with tensors of its own), and a
shadow layer is processed by its quantization method as soon as all its
tensors arrived, inside the update call that completed it. The commit then only
copies each processed tensor into the served one (the same memory the served
layer already has, as vLLM's reload does) and sets the attributes processing
changed (the CPU GEMM handle, ``cpu_linear``) on the served layer.

Which layers qualify: those whose processing is known to touch nothing but the
layer itself: no quantization method and no processing of their own (norms,
parameterless modules), and vLLM's unquantized linear and embedding methods,
each with the checkpoint format vLLM recorded at load
(``record_metadata_for_reloading``). A checkpoint name is taken when the
module its dotted path reaches in the model, with everything below that
module, qualifies (``takes``); attention layers below it do not disqualify it
(they have no weights of their own, and names ending in ``scale`` are never
taken). The other names (MoE experts, quantized layers, scales) stay with the
caller, which lands them through the reload at the commit. A loader routed to
a module that does not qualify raises instead of writing: the shadow of such a
module holds meta tensors only. Every shadow tensor is the shadow's own (meta
until its layer's first load, then allocated), so nothing of the served model
can be written before the commit.

What it holds: each shadow layer's tensors from its layer's first loaded
tensor until the commit, in their processed form (``bytes_held``: the
worker's shard of each layer it takes, since vLLM's loaders slice while they
load). Nothing is shared with the served layers except objects processing
only reads (configs, the quantization method). A layer processed in its
shadow is checked against the served one before the commit (``check``: every
tensor it received, the same names, shapes and dtypes), so the commit's copies
cannot fail half way for a reason known in advance.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from vllm.distributed.weight_transfer.landing.completeness import (
    first_few,
    layers_lacking,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Module bookkeeping that a shadow replaces with its own, never swapped back.
_OWN_STATE = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
)
# The name vLLM's layerwise reload gives the loaders it wraps.
_RELOAD_WRAPPER = "online_process_loader"


def _methods_processed_alone() -> tuple[type, ...]:
    """Quantization methods whose processing changes only the layer given."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    return (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


def _loadable_numel(tensors: dict[str, torch.Tensor]) -> int:
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    return sum(
        get_tensor_load_numel(t)
        for name, t in tensors.items()
        if name not in SKIP_LOAD_TENSORS
    )


def _own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {
        n: t for n, t in module._parameters.items() if t is not None
    }
    tensors.update((n, t) for n, t in module._buffers.items() if t is not None)
    return tensors


def processed_alone(module: torch.nn.Module) -> bool:
    """Whether ``module`` (itself, not its children) can be loaded and
    processed on a shadow with nothing but the shadow changing."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    tensors = _own_tensors(module)
    if tensors.keys() & SKIP_LOAD_TENSORS:
        return False  # state no checkpoint carries (expert maps)
    method = getattr(module, "quant_method", None)
    if method is not None:
        return type(method) in _methods_processed_alone()
    if is_deferred_attention_layer(module):
        # Processed with the model config after all other layers; qualifies
        # only when there is nothing to load into it.
        return _loadable_numel(tensors) == 0
    return not callable(getattr(module, "process_weights_after_loading", None))


def _passes(module: torch.nn.Module) -> bool:
    """Whether a checkpoint name reaching a module above ``module`` may load
    into shadows as far as ``module`` is concerned: it is processed alone, or
    it is an attention layer (processed at the commit; its scales never load
    into a shadow, ``takes``)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return is_deferred_attention_layer(module) or processed_alone(module)


def _recorded(module: torch.nn.Module) -> bool:
    """Whether vLLM recorded ``module``'s checkpoint format at load (needed to
    rebuild it), or it has no tensors to rebuild."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return not _own_tensors(module) or module in LAYERWISE_INFO


def _unwrapped(loader: Callable) -> Callable:
    """``loader`` without the layerwise reload's buffering wrappers."""
    while getattr(loader, "__name__", None) == _RELOAD_WRAPPER:
        loader = loader.__wrapped__  # type: ignore[attr-defined]
    return loader


@dataclass
class _Layer:
    """One shadow layer and what it received."""

    live: torch.nn.Module
    shadow: torch.nn.Module
    path: str
    device: torch.device
    total: int = 0
    loaded: int = 0
    names: set[str] = field(default_factory=set)
    materialized: bool = False
    processed: bool = False


class ShadowLayers:
    """Shadows of ``model``'s qualifying layers; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._root: torch.nn.Module | None = None
        self._layers: dict[int, _Layer] = {}  # id(shadow) -> layer
        self._qualifies: dict[int, bool] = {}  # id(live) -> whole subtree
        self._takes: dict[str, bool] = {}
        self._checked: list[Callable[[], None]] | None = None
        # The served tensors the checked commit copies into, with the layer
        # and name holding each (``still_bound``).
        self._served: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
        # Bytes of the shadow tensors allocated so far.
        self.bytes_held = 0

    # -- routing --------------------------------------------------------------

    def takes(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` loads into shadow layers."""
        known = self._takes.get(name)
        if known is None and name.endswith("scale"):
            # Quantization and KV-cache scales: their layers process at the
            # commit (attention layers, quantized layers).
            known = self._takes[name] = False
        if known is None:
            module = self.model
            for part in name.split(".")[:-1]:
                child = module._modules.get(part)
                if child is None:
                    break
                module = child
            known = self._takes[name] = self._subtree_qualifies(module)
        return known

    def _subtree_qualifies(self, module: torch.nn.Module) -> bool:
        known = self._qualifies.get(id(module))
        if known is None:
            known = (
                _recorded(module)
                and _passes(module)
                and all(
                    self._subtree_qualifies(child)
                    for child in module._modules.values()
                    if child is not None
                )
            )
            self._qualifies[id(module)] = known
        return known

    # -- loading --------------------------------------------------------------

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``weights`` (names ``takes`` accepts) into the shadows with the
        model's own ``load_weights``; every shadow layer they complete is
        processed before this returns. The tensors are not kept."""
        from vllm.distributed.weight_transfer.landing.layerwise import (
            load_with_model_loaders,
        )

        if self._checked is not None:
            raise RuntimeError("the shadow layers were already checked for the commit")
        load_with_model_loaders(self._shadow_model(), weights)

    def _shadow_model(self) -> torch.nn.Module:
        if self._root is None:
            self._root = self._copy(self.model, "", {})
        return self._root

    def _copy(
        self, live: torch.nn.Module, path: str, memo: dict[int, torch.nn.Module]
    ) -> torch.nn.Module:
        """A shadow of ``live`` and of every module below it (a module reached
        twice gets one shadow)."""
        if id(live) in memo:
            return memo[id(live)]
        shadow = object.__new__(type(live))
        shadow.__dict__.update(live.__dict__)
        shadow._parameters = {}
        shadow._buffers = {}
        shadow._non_persistent_buffers_set = set(live._non_persistent_buffers_set)
        shadow._modules = {}
        memo[id(live)] = shadow
        self._give_tensors(live, shadow, path)
        for name, child in live._modules.items():
            shadow._modules[name] = (
                None
                if child is None
                else self._copy(child, f"{path}.{name}" if path else name, memo)
            )
        return shadow

    def _give_tensors(
        self, live: torch.nn.Module, shadow: torch.nn.Module, path: str
    ) -> None:
        """Meta tensors in the checkpoint format (what vLLM recorded at load)
        for a qualifying module, each loading through ``_loader``; meta
        copies that refuse any load for the others."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import (
            SKIP_TENSORS,
            to_meta_tensor,
        )

        tensors = _own_tensors(live)
        if not tensors:
            return
        info = LAYERWISE_INFO.get(live)
        if not processed_alone(live) or info is None:
            for name, tensor in tensors.items():
                meta = to_meta_tensor(tensor)
                _set_loader(meta, _refusing_loader(path or "the model"))
                self._register(shadow, name, meta, name in live._buffers)
            return
        layer = _Layer(live, shadow, path, torch.device(info.restore_device))
        self._layers[id(shadow)] = layer
        params, buffers = info.restore_metadata
        recorded = {**params, **buffers}
        for name, tensor in tensors.items():
            if name not in recorded and name in SKIP_TENSORS:
                # vLLM never moves these to meta (a bias): the served one has
                # the checkpoint's format.
                recorded[name] = tensor
        transient = live._non_persistent_buffers_set
        for name, recorded_tensor in recorded.items():
            if name in transient:
                # Computed at construction, not loaded (a rotary cache): the
                # shadow starts from the served values.
                self._register(shadow, name, tensors[name].clone(), True)
                continue
            meta = to_meta_tensor(recorded_tensor)
            original = _bound_to(shadow, _unwrapped(_loader_of(meta)), live)
            _rebind(meta, live, shadow)
            _set_loader(meta, self._loader(layer, name, original))
            is_buffer = name in buffers or name in live._buffers
            self._register(shadow, name, meta, is_buffer)
        layer.total = _loadable_numel(
            {
                name: t
                for name, t in _own_tensors(shadow).items()
                if name not in transient
            }
        )

    @staticmethod
    def _register(
        module: torch.nn.Module, name: str, tensor: torch.Tensor, buffer: bool
    ) -> None:
        table: dict[str, Any] = module._buffers if buffer else module._parameters
        table[name] = tensor

    def _loader(self, layer: _Layer, name: str, original: Callable) -> Callable:
        """The weight loader of shadow tensor ``name``: the layer's tensors are
        allocated at its first load, ``original`` writes into the shadow
        tensor, and the load that completes the layer processes it."""
        from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

        signature = inspect.signature(original)
        if "param" not in signature.parameters:
            raise RuntimeError(
                f"{layer.path}.{name}: its weight loader takes no 'param' "
                "argument, so it cannot load into a shadow layer"
            )

        def shadow_loader(*args: Any, **kwargs: Any) -> Any:
            if layer.processed:
                raise RuntimeError(
                    f"{layer.path}.{name} was loaded again after its layer was "
                    "processed"
                )
            self._materialize(layer)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            bound.arguments["param"] = _own_tensors(layer.shadow)[name]
            numel, result = get_numel_loaded(original, bound)
            layer.loaded += numel
            layer.names.add(name)
            if layer.loaded >= layer.total:
                self._process(layer)
            return result

        shadow_loader.__name__ = "shadow_loader"
        return shadow_loader

    def _materialize(self, layer: _Layer) -> None:
        from vllm.model_executor.model_loader.reload.meta import (
            materialize_meta_tensor,
        )

        if layer.materialized:
            return
        shadow = layer.shadow
        with layer.device:
            tables: tuple[dict[str, Any], ...] = (shadow._parameters, shadow._buffers)
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is not None and tensor.is_meta:
                        table[name] = materialize_meta_tensor(tensor)
                        self.bytes_held += table[name].nbytes
        layer.materialized = True

    @staticmethod
    def _process(layer: _Layer) -> None:
        shadow: Any = layer.shadow
        shadow.__dict__.pop("_already_called_process_weights_after_loading", None)
        method = getattr(shadow, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(shadow)
        if hasattr(shadow, "update_param_tp_status"):
            shadow.update_param_tp_status()
        layer.processed = True

    # -- the commit -----------------------------------------------------------

    @property
    def layers_processed(self) -> int:
        return sum(layer.processed for layer in self._layers.values())

    def check(self) -> None:
        """Before the commit: every layer that received a tensor received all
        of them and was processed, and each processed tensor fits the served
        one it will be copied into; otherwise raise with what is wrong (the
        served model is untouched either way)."""
        lacking: list[str] = []
        layers = 0
        for layer in self._layers.values():
            if layer.loaded and not layer.processed:
                names = _own_tensors(layer.shadow).keys() - layer.names
                lacking += [f"{layer.path}.{n}" for n in sorted(names)] or [layer.path]
                layers += 1
        if lacking:
            raise layers_lacking(lacking, layers)
        steps: list[Callable[[], None]] = []
        for layer in self._layers.values():
            if layer.processed:
                steps += _swap_steps(layer)
        self._checked = steps
        self._served = [
            (layer.live, _own_tensors(layer.live))
            for layer in self._layers.values()
            if layer.processed
        ]

    def still_bound(self) -> bool:
        """Whether every served tensor of a processed layer is still the one
        its layer held at ``check`` (the commit copies into those objects);
        True before ``check``."""
        for live, served in self._served:
            now = _own_tensors(live)
            if now.keys() != served.keys():
                return False
            if any(now[name] is not tensor for name, tensor in served.items()):
                return False
        return True

    def commit(self) -> None:
        """Copy every processed tensor into its served one and set the
        attributes processing changed on the served layers."""
        if self._checked is None:
            self.check()
        assert self._checked is not None
        with torch.no_grad():
            for step in self._checked:
                step()
        logger.debug("Committed %d shadow layer(s)", self.layers_processed)
        self.close()

    def close(self) -> None:
        """Drop every shadow and what it holds."""
        self._root = None
        self._layers = {}
        self._checked = None
        self._served = []
        self.bytes_held = 0


def _set_loader(tensor: torch.Tensor, loader: Callable) -> None:
    # An attribute, or a property of vLLM's parameter classes.
    setattr(tensor, "weight_loader", loader)  # noqa: B010


def _loader_of(tensor: torch.Tensor) -> Callable:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return getattr(tensor, "weight_loader", default_weight_loader)


def _owned_by(method: object, live: torch.nn.Module) -> bool:
    """Whether ``method`` is bound to ``live`` or to vLLM's placeholder for the
    layer it was recorded from."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    return isinstance(method, MethodType) and (
        method.__self__ is live or method.__self__ is layer_ref_sentinel
    )


def _bound_to(shadow: object, method: Callable, live: torch.nn.Module) -> Callable:
    """``method`` bound to ``shadow`` when it was bound to the served layer."""
    if _owned_by(method, live):
        return method.__func__.__get__(shadow)  # type: ignore[attr-defined]
    return method


def _rebind(tensor: torch.Tensor, live: torch.nn.Module, shadow: object) -> None:
    """Point the methods ``tensor``'s attributes hold that are bound to the
    served layer at ``shadow`` instead."""
    for key, value in list(tensor.__dict__.items()):
        tensor.__dict__[key] = _bound_to(shadow, value, live)


def _refusing_loader(path: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{path} is processed with the served model at the commit; its "
            "tensors cannot load into a shadow layer"
        )

    return refuse


def _swap_steps(layer: _Layer) -> list[Callable[[], None]]:
    """The commit's steps for one processed layer, checked now: a copy per
    served tensor, then the attribute changes."""
    live, shadow = layer.live, layer.shadow
    steps: list[Callable[[], None]] = []
    processed = _own_tensors(shadow)
    transient = live._non_persistent_buffers_set
    for name, served in _own_tensors(live).items():
        new = processed.get(name)
        if name in live._buffers and name in transient and name not in layer.names:
            continue  # computed at construction, never loaded: left as served
        if new is None:
            raise RuntimeError(
                f"{layer.path}.{name}: processing the shadow layer left no such "
                "tensor, so the served one cannot be updated in place"
            )
        if new.shape != served.shape or new.dtype != served.dtype:
            raise RuntimeError(
                f"{layer.path}.{name}: processed to {tuple(new.shape)} "
                f"{new.dtype}, served as {tuple(served.shape)} {served.dtype}"
            )
        steps.append(_copy_step(served, new))
    extra = processed.keys() - _own_tensors(live).keys()
    if extra:
        raise RuntimeError(
            f"{layer.path}: processing the shadow layer made tensors the served "
            f"layer lacks ({first_few(sorted(extra), 4)})"
        )
    changed = {
        key: value
        for key, value in shadow.__dict__.items()
        if key not in _OWN_STATE and live.__dict__.get(key, _MISSING) is not value
    }
    dropped = [
        key
        for key in live.__dict__
        if key not in _OWN_STATE and key not in shadow.__dict__
    ]

    def set_attributes() -> None:
        live.__dict__.update(changed)
        for key in dropped:
            live.__dict__.pop(key, None)

    if changed or dropped:
        steps.append(set_attributes)
    return steps


def _copy_step(served: torch.Tensor, new: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        served.data.copy_(new)

    return copy


_MISSING = object()
