# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One weight update landed through vLLM's layerwise reload, for any backend that
receives checkpoint-format tensors (``ipc``, ``sharded_rdt``).

Lifecycle, driven by the worker engine:

1. ``start()`` (from ``start_weight_update``): every layer's kernel tensors are
   kept aside and the layer is rebuilt on the meta device with buffering weight
   loaders (``initialize_layerwise_reload``).
2. ``load(weights, foreign_storages)`` (from ``update_weights``, any number of
   times): ``model.load_weights``; a layer is materialized, loaded, processed
   (fusing, quantization, repacking) and copied back into its kernel tensors as
   soon as all its weights have arrived. Weights of a layer that is still
   incomplete stay buffered; the buffered ones that alias ``foreign_storages``
   (memory the sender will reuse, such as a packed transfer buffer) are copied,
   so once ``load`` returns the session holds no reference into them.
3. ``finish()`` (from ``finish_weight_update``): layers that got no weights go
   back to their kernel tensors, the rest are processed
   (``finalize_layerwise_reload``).
   ``abort()`` (on any failure): every layer that did not complete goes back to
   its resident kernel tensors unchanged, so the model keeps serving; layers
   completed before the failure keep their new weights.

Processing fix applied during a session: on a weight update, vLLM's unquantized
MoE method skips the experts' layer-level setup it runs at first load
(``FusedMoEExperts.process_weights_after_loading``), so CPU experts would keep
plain-layout weights where their kernel expects the prepacked layout. While a
session is open, the MoE layers whose experts need that setup (``_RESETUP_EXPERTS``)
run it again on the freshly loaded layer, exactly as at first load, before the
result is copied into the kernel tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)


def _resetup_experts_classes() -> tuple[type, ...]:
    """Experts whose layer-level setup must run again after every reload."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:
        return ()
    return (CPUUnquantizedExperts,)


def _fused_experts(module: torch.nn.Module) -> tuple[Any, Any] | None:
    quant_method = getattr(module, "quant_method", None)
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    return quant_method, experts


class LayerwiseReloadSession:
    """Land one weight update into ``model``; see the module docstring."""

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self._hooked: list[Any] = []
        self._open = False

    @property
    def is_open(self) -> bool:
        return self._open

    def start(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            initialize_layerwise_reload,
        )

        if self._open:
            raise RuntimeError("this layerwise reload session is already open")
        initialize_layerwise_reload(self.model)
        self._open = True
        self._hook_experts_resetup()

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        foreign_storages: set[int] | None = None,
    ) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if not self._open:
            raise RuntimeError("load() needs an open session; call start() first")
        with torch.no_grad(), disable_mtp_completeness_check():
            self.model.load_weights(weights=weights)  # type: ignore[operator]
        if foreign_storages:
            self._copy_pending(foreign_storages)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._open:
            raise RuntimeError("finish() needs an open session")
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            self.abort()
            raise
        self._close()

    def abort(self) -> None:
        """Put every layer that did not complete back on its kernel tensors."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _place_kernel_tensors,
        )

        if not self._open:
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
        for quant_method in self._hooked:
            quant_method.__dict__.pop("process_weights_after_loading", None)
        self._hooked.clear()
        self._open = False

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
