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

On a CUDA device with Triton, one fused kernel quantizes each row (the row
read once, its codes and scale written once, the divisions correctly
rounded, so the result is the same as the torch operations'); elsewhere the
torch operations run in row blocks.

Names follow FP8 checkpoints quantized per channel: ``<layer>.weight`` holds
the codes (shape of the weight, ``torch.float8_e4m3fn``) and
``<layer>.weight_scale`` the scales (``[rows, 1]``, float32). Every other
tensor passes through unchanged.

A weight holding a NaN or an infinity gives its row a NaN scale, which no
engine can serve: the source refuses it before it is sent
(``quantized_values.BadQuantizedValues``, naming the tensor), and so does
every worker that receives such a scale from any client.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.quant.row_kernel import (
    RowQuantizer,
    fused_row_quantizer,
    quantize_rows,
)
from vllm.distributed.weight_transfer.quant.values import (
    is_checked,
    refuse_bad_values,
)

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
    return quantize_rows(weight, dtype, "FP8", _fused_rows, _quantize_with_torch_ops)


def _quantize_with_torch_ops(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_per_channel`` of ``w`` (already in the engine's dtype)
    with torch operations, in row blocks."""
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


def _fused_rows() -> RowQuantizer | None:
    """The fused CUDA quantizer for FP8 codes (``row_quantizer``), or None
    without Triton."""
    return fused_row_quantizer(
        FP8_CODES, FP8_MAX, -FP8_MAX, FP8_MAX, _MIN_SCALE, integer=False
    )


# The smallest scale, as the float32 torch compares with (the Python number
# 1 / (448 * 512) rounded to float32).
_MIN_SCALE = float(torch.tensor(1.0 / MIN_SCALE_DIVISOR, dtype=torch.float32))


class ChannelCodes(WeightSource):
    """``source``'s weights with each tensor ``quantized(name, shape)`` picks
    sent as per-channel codes (``codes_dtype``, the weight's shape) followed by
    their scales (``<name>_scale``, ``[rows, 1]`` float32), from
    ``quantize(weight, dtype)``; every other tensor passes through. Subclasses
    name the scheme (``Fp8ChannelCodes``, ``int8_codes.Int8ChannelCodes``).

    ``dtype`` is the dtype the engine loads weights in (its ``dtype=``); the
    weights are cast to it before they are quantized, as the engine's loader
    would cast them.

    ``static_activations`` holds a checkpoint's static activation parameters
    in its names (``<layer>.input_scale``, and ``<layer>.input_zero_point``
    when activations are asymmetric; ``read_static_activations`` reads them
    from the checkpoint's files). Each is sent unchanged right after the scale
    of its layer's codes: an engine that quantizes activations with fixed
    parameters rebuilds a layer from all of its tensors, so every update of a
    layer's weight carries them too. A name whose layer has no quantized
    weight in ``source`` is refused (``ValueError``) when the metadata is
    first read."""

    codes_dtype: torch.dtype

    def __init__(
        self,
        source: WeightSource,
        *,
        dtype: torch.dtype = torch.bfloat16,
        quantized: Callable[[str, tuple[int, ...]], bool] = is_linear_weight,
        static_activations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.source = source
        self.dtype = dtype
        self.quantized = quantized
        self._picked: set[str] | None = None
        self._activations = _activations_by_weight(static_activations or {})

    def quantize(
        self, weight: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the scale sent with codes of ``shape``: one per row."""
        return (shape[0], 1)

    def scale_name_of(self, codes_name: str) -> str:
        """The checkpoint name of the scale of ``codes_name``."""
        return scale_name(codes_name)

    def _picks(self) -> set[str]:
        if self._picked is None:
            picked = {
                m.name
                for m in self.source.metadata()
                if m.dtype.is_floating_point and self.quantized(m.name, tuple(m.shape))
            }
            stray = sorted(
                name
                for weight, params in self._activations.items()
                if weight not in picked
                for name in params
            )
            if stray:
                raise ValueError(
                    f"static activation parameters for {len(stray)} layer tensor(s) "
                    f"without quantized codes in the source: {', '.join(stray[:8])}"
                    + (" ..." if len(stray) > 8 else "")
                )
            self._picked = picked
        return self._picked

    def metadata(self) -> list[ParamMeta]:
        picked = self._picks()
        out: list[ParamMeta] = []
        for meta in self.source.metadata():
            if meta.name in picked:
                out.append(ParamMeta(meta.name, self.codes_dtype, tuple(meta.shape)))
                out.append(
                    ParamMeta(
                        self.scale_name_of(meta.name),
                        SCALE_DTYPE,
                        self.scale_shape(tuple(meta.shape)),
                    )
                )
                out.extend(
                    ParamMeta(name, t.dtype, tuple(t.shape))
                    for name, t in self._activations.get(meta.name, {}).items()
                )
            else:
                out.append(meta)
        return out

    def held_names(self) -> Collection[str] | None:
        held = self.source.held_names()
        if held is None:
            return None
        picked = self._picks()
        extra = [
            added
            for n in held
            if n in picked
            for added in (self.scale_name_of(n), *self._activations.get(n, {}))
        ]
        return [*held, *extra]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        picked = self._picks()
        what = f"the trainer's {type(self).__name__} source"
        for name, tensor in self.source:
            if name in picked:
                codes, scale = self.quantize(tensor, self.dtype)
                # A finite, positive scale implies finite codes: the scale
                # alone is checked (a NaN or infinity in the row makes it NaN).
                scale_of = self.scale_name_of(name)
                activations = self._activations.get(name, {})
                refuse_bad_values([(scale_of, scale), *activations.items()], what)
                yield name, codes
                yield scale_of, scale
                yield from activations.items()
            else:
                if is_checked(name, tensor.dtype):
                    refuse_bad_values([(name, tensor)], what)
                yield name, tensor


# The parameters a checkpoint quantized with static activations keeps per
# linear layer, next to ``<layer>.weight``.
STATIC_ACTIVATION_SUFFIXES = (".input_scale", ".input_zero_point")


def _activations_by_weight(
    params: Mapping[str, torch.Tensor],
) -> dict[str, dict[str, torch.Tensor]]:
    """``{"<layer>.weight": {"<layer>.input_scale": t, ...}}`` from checkpoint
    names; a name that is not a static activation parameter is refused."""
    by_weight: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in params.items():
        suffix = next((s for s in STATIC_ACTIVATION_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise ValueError(
                f"{name} is not a static activation parameter (names end in "
                f"{' or '.join(STATIC_ACTIVATION_SUFFIXES)})"
            )
        weight = name.removesuffix(suffix) + ".weight"
        by_weight.setdefault(weight, {})[name] = tensor.detach()
    return by_weight


def read_static_activations(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every static activation parameter (``STATIC_ACTIVATION_SUFFIXES``) in
    the ``*.safetensors`` files of a checkpoint folder, by checkpoint name:
    what ``ChannelCodes(static_activations=...)`` sends to keep the
    checkpoint's calibrated activation quantization while the weights change."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(STATIC_ACTIVATION_SUFFIXES):
                    found[name] = f.get_tensor(name)
    return found


class Fp8ChannelCodes(ChannelCodes):
    """Per-channel FP8 codes (module docstring), for an engine started with
    ``quantization="fp8_per_channel"``. Codes are half the bytes of
    bfloat16; the engine lands them straight into its served float8 tensors
    and serves what it would have computed from the full-precision weights,
    bit for bit."""

    codes_dtype = FP8_CODES

    def quantize(
        self, weight: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_channel(weight, dtype)


# Blocks of DeepSeek-style FP8 checkpoints (``weight_block_size``) and of
# vLLM's ``fp8_per_block`` online scheme.
FP8_BLOCK = (128, 128)
# The smallest block magnitude the scale is computed from (an all-zero block
# still gets a finite, positive scale).
BLOCK_MIN_AMAX = 1e-4


@torch.no_grad()
def quantize_fp8_per_block(
    weight: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int] = FP8_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_inv)`` of a 2-D ``weight`` quantized per
    ``block[0] x block[1]`` tile, the last tiles of each dimension cut short:
    float8 e4m3 codes of the weight's shape, and one float32 scale per tile
    (``[ceil(rows / block[0]), ceil(cols / block[1])]``; checkpoints call it
    ``weight_scale_inv`` because the engine multiplies by it).

    The arithmetic is vLLM's online ``fp8_per_block`` quantizer's, so the
    codes equal what an engine quantizing on load computes from the same
    tensor: the weight cast to ``dtype``; ``amax`` per tile in float32, at
    least ``BLOCK_MIN_AMAX``; ``scale = amax / 448`` (a division by a Python
    number); ``codes = weight * (1 / scale)`` in float32, rounded to e4m3."""
    if weight.dim() != 2:
        raise ValueError(
            f"per-block FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}"
        )
    block_rows, block_cols = block
    w = weight.detach().to(dtype)
    rows, cols = w.shape
    tiles_r = -(-rows // block_rows)
    tiles_c = -(-cols // block_cols)
    # Zeros complete the short tiles at the ends: they never raise an amax.
    whole = torch.nn.functional.pad(
        w, (0, tiles_c * block_cols - cols, 0, tiles_r * block_rows - rows)
    )
    tiles = whole.view(tiles_r, block_rows, tiles_c, block_cols)
    amax = tiles.abs().to(SCALE_DTYPE).amax(dim=(1, 3), keepdim=True)
    scale = amax.clamp(BLOCK_MIN_AMAX) / FP8_MAX
    codes = (tiles.to(SCALE_DTYPE) * (1.0 / scale)).to(FP8_CODES)
    codes = codes.view(tiles_r * block_rows, tiles_c * block_cols)[:rows, :cols]
    return codes.contiguous(), scale.view(tiles_r, tiles_c)


class Fp8BlockCodes(ChannelCodes):
    """Block FP8 codes (``quantize_fp8_per_block``) in the names of
    DeepSeek-style FP8 checkpoints (``quant_method: fp8``,
    ``weight_block_size: [128, 128]``): ``<layer>.weight`` holds the codes
    and ``<layer>.weight_scale_inv`` one float32 scale per tile. For engines
    serving such a checkpoint, which never quantize themselves: a sync then
    moves half of bfloat16's bytes, plus one scale per 16,384 weights.

    An engine splits a weight into tensor-parallel shards and fuses shards
    (``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj``) along whole tiles
    only when every boundary falls on a multiple of the block; a tile that
    straddles one would need the amax of both sides. ``tile_aligned`` says
    whether a size splits cleanly; real FP8 checkpoints are laid out so that
    it does (Qwen3-8B at TP 8: 512 query rows, 128 key/value rows per rank)."""

    codes_dtype = FP8_CODES

    def __init__(
        self,
        source: WeightSource,
        *,
        block: tuple[int, int] = FP8_BLOCK,
        **kwargs: Any,
    ) -> None:
        super().__init__(source, **kwargs)
        self.block = block

    def quantize(
        self, weight: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_block(weight, dtype, self.block)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))

    def scale_name_of(self, codes_name: str) -> str:
        return codes_name + "_scale_inv"


def tile_aligned(size: int, parts: int, block: int = FP8_BLOCK[0]) -> bool:
    """Whether ``size`` rows (or columns) split into ``parts`` equal shards
    made of whole ``block`` tiles, so that quantizing each shard gives the
    same codes and scales as slicing the whole tensor's."""
    return size % parts == 0 and (size // parts) % block == 0
