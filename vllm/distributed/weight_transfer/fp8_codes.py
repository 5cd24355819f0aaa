# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side FP8 quantization: send float8 codes and their scales instead of
full-precision linear weights, half the bytes.

An engine started with ``quantization="fp8_per_channel"`` serves each linear
layer as float8 (e4m3) codes with one float32 scale per output row, which it
computes from the full-precision weights it loads. ``Fp8ChannelCodes(source)``
computes the same codes and scales on the trainer, with the same arithmetic,
so the engine can take them as they are (``codes_landing``) instead of
quantizing:

* the weight is first cast to the dtype the engine loads it in (bfloat16 by
  default), as the engine's loader casts it;
* ``amax`` is the largest magnitude in each row;
* ``scale = max(amax / 448, 1 / (448 * 512))`` in float32, 448 being the
  largest e4m3 value; the division is by a tensor, so it is a true division
  (a Python number would become a multiplication by its rounded reciprocal);
* ``codes = clamp(weight / scale, -448, 448)`` rounded to e4m3.

Each row's codes and scale depend on that row alone, so tensor-parallel
shards are rows (or column blocks of rows) of the full tensor's result: a
row-parallel engine shares the row's ``amax`` across its ranks, which gives
the scale of the whole row computed here.

Names follow FP8 checkpoints quantized per channel: ``<layer>.weight`` holds
the codes (shape of the weight, ``torch.float8_e4m3fn``) and
``<layer>.weight_scale`` the scales (``[rows, 1]``, float32). Every other
tensor passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

import torch

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

FP8_CODES = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
# The largest finite e4m3 magnitude, and the smallest scale vLLM allows (a row
# of zeros still gets a finite, positive scale).
FP8_MAX = float(torch.finfo(FP8_CODES).max)
MIN_SCALE_DIVISOR = FP8_MAX * 512


def scale_name(codes_name: str) -> str:
    """``<layer>.weight`` -> ``<layer>.weight_scale``."""
    return codes_name + "_scale"


def codes_name_of(scale: str) -> str | None:
    """``<layer>.weight_scale`` -> ``<layer>.weight``; None for other names."""
    return scale.removesuffix("_scale") if scale.endswith(".weight_scale") else None


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """The default choice of tensors to quantize: two-dimensional
    ``*_proj.weight`` tensors outside MoE experts, which is every linear layer
    of Llama- and Qwen-style decoder blocks that ``fp8_per_channel``
    quantizes on vLLM CPU. Embeddings, norms and the LM head stay in full
    precision, as the engine serves them."""
    return len(shape) == 2 and name.endswith("_proj.weight") and ".experts." not in name


@torch.no_grad()
def quantize_fp8_per_channel(
    weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D ``weight``: float8 e4m3 codes of its shape
    and one float32 scale per row (``[rows, 1]``), computed as the module
    docstring says after casting ``weight`` to ``dtype``."""
    if weight.dim() != 2:
        raise ValueError(
            f"per-channel FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}"
        )
    w = weight.detach().to(dtype)
    low, high = w.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(low.abs(), high.abs()).to(SCALE_DTYPE)
    fp8_max = torch.tensor(FP8_MAX, dtype=SCALE_DTYPE, device=w.device)
    scale = (amax / fp8_max).clamp_min(1.0 / MIN_SCALE_DIVISOR)
    codes = torch.empty(w.shape, dtype=FP8_CODES, device=w.device)
    # Row blocks bound the float32 temporary to about 64 MB.
    step = max(1, (16 << 20) // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        rows = slice(start, start + step)
        quotient = w[rows] / scale[rows]
        codes[rows] = quotient.clamp_(-FP8_MAX, FP8_MAX).to(FP8_CODES)
    return codes, scale


class Fp8ChannelCodes(WeightSource):
    """``source``'s weights with each tensor ``quantized(name, shape)`` picks
    sent as per-channel FP8 codes and scales (module docstring), for an engine
    started with ``quantization="fp8_per_channel"``.

    ``dtype`` is the dtype the engine loads weights in before quantizing (its
    ``dtype=``). Codes are half the bytes of bfloat16; the engine lands them
    straight into its served float8 tensors and serves what it would have
    computed from the full-precision weights, bit for bit."""

    def __init__(
        self,
        source: WeightSource,
        *,
        dtype: torch.dtype = torch.bfloat16,
        quantized: Callable[[str, tuple[int, ...]], bool] = is_linear_weight,
    ) -> None:
        self.source = source
        self.dtype = dtype
        self.quantized = quantized
        self._picked: set[str] | None = None

    def _picks(self) -> set[str]:
        if self._picked is None:
            self._picked = {
                m.name
                for m in self.source.metadata()
                if m.dtype.is_floating_point and self.quantized(m.name, tuple(m.shape))
            }
        return self._picked

    def metadata(self) -> list[ParamMeta]:
        picked = self._picks()
        out: list[ParamMeta] = []
        for meta in self.source.metadata():
            if meta.name in picked:
                out.append(ParamMeta(meta.name, FP8_CODES, tuple(meta.shape)))
                out.append(
                    ParamMeta(scale_name(meta.name), SCALE_DTYPE, (meta.shape[0], 1))
                )
            else:
                out.append(meta)
        return out

    def held_names(self) -> Collection[str] | None:
        held = self.source.held_names()
        if held is None:
            return None
        picked = self._picks()
        return [*held, *(scale_name(n) for n in held if n in picked)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        picked = self._picks()
        for name, tensor in self.source:
            if name in picked:
                codes, scale = quantize_fp8_per_channel(tensor, self.dtype)
                yield name, codes
                yield scale_name(name), scale
            else:
                yield name, tensor
