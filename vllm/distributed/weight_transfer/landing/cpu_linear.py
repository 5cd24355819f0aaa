# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``WeightTransferConfig.cpu_linear="plain"``: unquantized linear layers on
vLLM CPU keep their weight tensors and run ``torch.nn.functional.linear``.

vLLM CPU processes every unquantized linear layer after loading
(``dispatch_cpu_unquantized_gemm``): it repacks the weight into a oneDNN,
sgl-kernel or zentorch handle and, for linear layers, drops the plain tensor.
The served bytes then live inside an opaque handle, so a weight update has to
rebuild the tensor, reload it and build a new handle for every layer (most of
a CPU sync's time), and nothing can write new weights into the served tensors
in place.

With ``cpu_linear="plain"`` the fork's general plugin (entry point
``weight_transfer_cpu_linear``, installed with the fork) routes that dispatch,
for two-dimensional weights, to vLLM's own fallback: the layer keeps
``layer.weight`` and computes ``F.linear(x, weight, bias)``. Its post-load
processing leaves the bytes as loaded (``post_load_keeps_bytes`` checks it on
a layer), which is what a sync needs to land straight into served tensors.
Other weights (MoE experts, convolutions) take vLLM's path unchanged, and so
does everything when the setting is ``"packed"`` (the default) or no engine
config is current.

The cost is generation speed: oneDNN's packed GEMM against torch's linear on
the same weights; ``benchmarks/weight_transfer/bench_cpu_linear.py`` measures
both, and the sync time, in one run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

_INSTALLED = "_weight_transfer_cpu_linear"


def plain_linear_requested() -> bool:
    """Whether the engine config being loaded asks for plain CPU linear."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return getattr(transfer, "cpu_linear", "packed") == "plain"


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def plain_dispatch(original: Callable) -> Callable:
    """``original`` (vLLM's CPU GEMM dispatch), except that with
    ``cpu_linear="plain"`` a two-dimensional weight stays a plain tensor."""

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and not weight.is_meta
            and plain_linear_requested()
        ):
            # What vLLM's own fallback installs: weight stays, torch's linear.
            setattr(layer, "cpu_linear", _plain_linear)  # noqa: B010
            return
        original(layer, remove_weight)

    setattr(dispatch, _INSTALLED, True)
    dispatch.__doc__ = original.__doc__
    return dispatch


def install() -> None:
    """The plugin: wrap vLLM's CPU GEMM dispatch once (its callers import it
    from ``vllm.model_executor.layers.utils`` when they run)."""
    from vllm.model_executor.layers import utils

    current = utils.dispatch_cpu_unquantized_gemm
    if getattr(current, _INSTALLED, False):
        return
    utils.dispatch_cpu_unquantized_gemm = plain_dispatch(current)


def post_load_keeps_bytes(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s post-load processing leaves its parameters' bytes
    exactly as loaded, tried on a copy of the layer: each parameter is filled
    with a marker pattern, the layer's quantization method processes the
    copy, and every parameter must still be the same tensor holding the same
    bytes. A layer holding an empty parameter (its bytes were moved into a
    kernel handle when it was loaded) does not. Run it under the engine's
    config (``set_current_vllm_config``), as loading does; ``layer`` itself is
    not touched. A layer that vLLM does not process after loading at all (no
    quantization method, no processing of its own, e.g. a norm) keeps its
    bytes by construction."""
    method = getattr(layer, "quant_method", None)
    if not callable(getattr(method, "process_weights_after_loading", None)):
        own = getattr(layer, "process_weights_after_loading", None)
        return method is None and not callable(own) and bool(layer._parameters)
    if any(p.numel() == 0 for p in layer.parameters(recurse=False)):
        # Processing already moved the bytes elsewhere (a packed kernel
        # handle): no parameter holds what a sync would write.
        return False
    # A shallow copy with parameters of its own (plain ``Parameter`` clones:
    # vLLM's parameter classes do not deep-copy).
    probe = copy.copy(layer)
    probe.__dict__ = dict(layer.__dict__)
    probe._parameters = {
        name: None if p is None else torch.nn.Parameter(p.detach().clone(), False)
        for name, p in layer._parameters.items()
    }
    probe._buffers = dict(layer._buffers)
    method = getattr(probe, "quant_method")  # noqa: B009 (typed as a Module)
    before = dict(probe.named_parameters(recurse=False))
    if not before:
        return False
    state = _other_state(probe)
    with torch.no_grad():
        for i, p in enumerate(before.values()):
            _fill_marker(p, seed=i)
        markers = {n: _bytes(p).clone() for n, p in before.items()}
        method.process_weights_after_loading(probe)
    after = dict(probe.named_parameters(recurse=False))
    kept = after.keys() == before.keys() and all(
        after[n] is before[n]
        and after[n].dtype == before[n].dtype
        and torch.equal(_bytes(after[n]), markers[n])
        for n in before
    )
    # Processing must not have built anything from the bytes either (a kernel
    # handle that keeps its own copy while the parameter stays, as vLLM CPU
    # does for a packed LM head): apart from the plain linear this module
    # installs, every attribute and buffer is what it was.
    now = _other_state(probe)
    if now.get("cpu_linear") is _plain_linear:
        now.pop("cpu_linear")
        state.pop("cpu_linear", None)
    return (
        kept and now.keys() == state.keys() and all(now[k] is state[k] for k in state)
    )


def _other_state(module: torch.nn.Module) -> dict[str, Any]:
    """A module's attributes and buffers, by identity, apart from its
    parameters and submodules."""
    state = {
        k: v
        for k, v in module.__dict__.items()
        if k not in ("_parameters", "_buffers", "_modules")
    }
    state.update({f"buffer:{k}": v for k, v in module._buffers.items()})
    return state


def _fill_marker(p: torch.Tensor, seed: int) -> None:
    """Small integers (exact in every float format vLLM serves unquantized)
    that differ between neighbours and repeat only every 4093 elements; built
    at about the speed of a copy, since the probe runs on every layer."""
    period = torch.arange(_MARKER_PERIOD, dtype=torch.float32)
    period = (period * 7 + seed).remainder(251) - 125
    n = p.numel()
    values = period.repeat(-(-n // _MARKER_PERIOD))[:n]
    p.copy_(values.view(p.shape))


_MARKER_PERIOD = 4093  # a prime


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)
