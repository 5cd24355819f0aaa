# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side int8 quantization for engines that serve a pre-quantized int8
checkpoint: send each linear weight as int8 codes with one scale per output
channel, in the checkpoint's own names, a quarter of float32's bytes.

An engine started from a compressed-tensors W8A8 int8 checkpoint (weights
quantized symmetrically per output channel, activations per token at run
time) reads ``<layer>.weight`` as int8 codes and ``<layer>.weight_scale`` as
their float32 scales (``[rows, 1]``); it never quantizes weights itself, so
a sync must carry codes and scales, which land through vLLM's own loaders
and processing as at start-up. ``Int8ChannelCodes(source)`` computes them on
the trainer:

* the weight is cast to the dtype the engine runs in (bfloat16 by default),
  then to float32;
* ``scale = max(amax / 127.5, eps)`` per row, ``amax`` the row's largest
  magnitude and ``eps`` float32's machine epsilon: the symmetric int8 range
  [-128, 127] spans 255 steps, as compressed-tensors' own quantizer counts
  them;
* ``codes = clamp(round(weight / scale), -128, 127)``, rounding half to even.

Each row's codes and scale depend on that row alone, so every tensor-parallel
shard the engine slices is the same as slicing the whole tensor's result.

``Int8TensorCodes`` is the same for checkpoints quantized per tensor
(``"strategy": "tensor"``): one scale per checkpoint tensor (shape ``[1]``),
``amax`` over the whole tensor. The engine takes the scales of the shards it
fuses (``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj``) one per shard and
turns them into per-channel scales when it processes the layer, so every
shard of a fused layer must be in the same update, which the worker checks
(``update_completeness``) before anything is processed.
Checkpoints whose activations are quantized with fixed, calibrated
parameters (``"dynamic": false``: ``<layer>.input_scale``, and
``<layer>.input_zero_point`` when asymmetric) rebuild each layer from those
too, so a sync sends them with every layer's codes:
``Int8ChannelCodes(source, static_activations=read_static_activations(dir))``
keeps the checkpoint's own (``fp8_codes.ChannelCodes``); a layer updated
without them is left unchanged by the engine, which refuses the update
(``IncompleteUpdateError`` names the missing ``input_scale``).
The engine serves exactly what it serves when it loads a checkpoint holding
the same codes and scales (the tests' oracle); how close that is to the
full-precision model is the quantizer's business, not the transfer's.
"""

from __future__ import annotations

import torch

from vllm.distributed.weight_transfer.quant.fp8 import (
    SCALE_DTYPE,
    ChannelCodes,
    read_static_activations,
)
from vllm.distributed.weight_transfer.quant.row_kernel import (
    RowQuantizer,
    fused_row_quantizer,
    quantize_rows,
)

__all__ = [
    "Int8ChannelCodes",
    "Int8TensorCodes",
    "quantize_int8_per_channel",
    "quantize_int8_per_tensor",
    "read_static_activations",
]

INT8_CODES = torch.int8
# Steps of the symmetric int8 range, over two (compressed-tensors' divisor).
INT8_HALF_RANGE = 127.5
_MIN_SCALE = float(torch.finfo(SCALE_DTYPE).eps)


@torch.no_grad()
def quantize_int8_per_channel(
    weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D ``weight``: int8 codes of its shape and one
    float32 scale per row (``[rows, 1]``), as the module docstring says."""
    return quantize_rows(weight, dtype, "int8", _fused_rows, _quantize_with_torch_ops)


def _quantize_with_torch_ops(
    served: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8_per_channel`` of ``served`` (already in the engine's
    dtype) with torch operations."""
    w = served.to(SCALE_DTYPE)
    low, high = w.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(low.abs(), high.abs())
    scale = _scale_of(amax)
    codes = torch.round(w / scale).clamp_(-128, 127).to(INT8_CODES)
    return codes, scale


def _fused_rows() -> RowQuantizer | None:
    """The fused CUDA quantizer for int8 codes (``row_quantizer``), or None
    without Triton."""
    return fused_row_quantizer(
        INT8_CODES, INT8_HALF_RANGE, -128.0, 127.0, _MIN_SCALE, integer=True
    )


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / 127.5, eps)``, correctly rounded on every device: the
    divisor is a tensor, because torch on CUDA divides by a Python number
    through its reciprocal, whose rounding differs in most rows (measured on
    an H200; the host divides exactly either way)."""
    divisor = torch.full_like(amax, INT8_HALF_RANGE)
    return (amax / divisor).clamp_min(_MIN_SCALE)


@torch.no_grad()
def quantize_int8_per_tensor(
    weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D ``weight`` with one float32 scale for the
    whole tensor (shape ``[1]``), otherwise as ``quantize_int8_per_channel``."""
    if weight.dim() != 2:
        raise ValueError(
            f"per-tensor int8 quantizes 2-D weights; got shape {tuple(weight.shape)}"
        )
    w = weight.detach().to(dtype).to(SCALE_DTYPE)
    low, high = w.aminmax()
    amax = torch.maximum(low.abs(), high.abs()).reshape(1)
    scale = _scale_of(amax)
    codes = torch.round(w / scale).clamp_(-128, 127).to(INT8_CODES)
    return codes, scale


class Int8ChannelCodes(ChannelCodes):
    """``source``'s linear weights as per-channel int8 codes and scales in a
    compressed-tensors W8A8 checkpoint's names (module docstring); every other
    tensor (embeddings, norms, the LM head) passes through unchanged."""

    codes_dtype = INT8_CODES

    def quantize(
        self, weight: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_per_channel(weight, dtype)


class Int8TensorCodes(ChannelCodes):
    """``Int8ChannelCodes`` for a checkpoint quantized per tensor: one scale
    per linear weight (module docstring)."""

    codes_dtype = INT8_CODES

    def quantize(
        self, weight: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_per_tensor(weight, dtype)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1,)
