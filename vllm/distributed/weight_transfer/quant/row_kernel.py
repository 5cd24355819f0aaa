# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One fused CUDA kernel (Triton) for the trainer-side per-row quantizers
(``fp8_codes`` and ``int8_codes``): one program per row reads the row once,
finds its largest magnitude, and writes the row's codes and its float32
scale.

For a row ``w`` (loaded in its dtype, then float32):

* ``scale = max(amax / divisor, min_scale)``;
* ``codes = clamp(w / scale, low, high)``, rounded half to even first when
  the codes are integers (int8), and converted to the codes' dtype (float8
  rounds to nearest when it converts).

Both divisions are correctly rounded (``div_rn``), as torch divides by a
tensor on every device, so the codes and scales equal the same quantizer's
torch operations bit for bit (``test_fp8_codes.py`` and
``test_int8_codes.py`` check that on a GPU). A row must fit one program
(``MAX_COLS``); callers fall back to torch operations for wider rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Rows wider than this take the torch operations (a program holds a whole
# row).
MAX_COLS = 1 << 16

RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fits(w: torch.Tensor) -> bool:
    """Whether the fused kernel can quantize ``w`` (on CUDA, 2-D, rows no
    wider than ``MAX_COLS``, indexable with 32-bit offsets)."""
    return (
        w.is_cuda and w.dim() == 2 and 0 < w.shape[1] <= MAX_COLS and w.numel() < 2**31
    )


def quantize_rows(
    weight: torch.Tensor,
    dtype: torch.dtype,
    kind: str,
    fused: Callable[[], RowQuantizer | None],
    torch_ops: RowQuantizer,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a 2-D ``weight`` cast to ``dtype``, one scale
    per row: through the fused kernel (``fused()``, None without Triton)
    when it ``fits``, else through ``torch_ops``; ``kind`` names the codes
    in the refusal of any other shape."""
    if weight.dim() != 2:
        raise ValueError(
            f"per-channel {kind} quantizes 2-D weights; got shape {tuple(weight.shape)}"
        )
    w = weight.detach().to(dtype)
    rows = fused() if fits(w) else None
    if rows is not None:
        return rows(w.contiguous())
    return torch_ops(w)


@functools.cache
def fused_row_quantizer(
    codes_dtype: torch.dtype,
    divisor: float,
    low: float,
    high: float,
    min_scale: float,
    integer: bool,
) -> RowQuantizer | None:
    """The fused per-row quantizer for these constants (module docstring),
    or None without Triton."""
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
    except ImportError:
        return None

    @triton.jit
    def quantize_row(
        w_ptr,
        codes_ptr,
        scale_ptr,
        cols,
        divisor,
        low,
        high,
        min_scale,
        INTEGER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < cols
        w = tl.load(w_ptr + row * cols + offsets, mask=inside, other=0.0)
        w = w.to(tl.float32)
        amax = tl.max(tl.abs(w), axis=0)
        # div_rn: correctly rounded, as torch divides (``/`` may lower to an
        # approximate division).
        scale = tl.maximum(tl.math.div_rn(amax, divisor), min_scale)
        quotient = tl.math.div_rn(w, scale)
        if INTEGER:
            quotient = libdevice.rint(quotient)  # half to even, as torch.round
        codes = tl.minimum(tl.maximum(quotient, low), high)
        tl.store(
            codes_ptr + row * cols + offsets,
            codes.to(codes_ptr.dtype.element_ty),
            mask=inside,
        )
        tl.store(scale_ptr + row, scale)

    def run(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = w.shape
        codes = torch.empty(w.shape, dtype=codes_dtype, device=w.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=w.device)
        if rows:
            kernel: Any = quantize_row
            kernel[(rows,)](
                w,
                codes,
                scale,
                cols,
                divisor,
                low,
                high,
                min_scale,
                INTEGER=integer,
                BLOCK=triton.next_power_of_2(cols),
                num_warps=8,
            )
        return codes, scale

    return run
