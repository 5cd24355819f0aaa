# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What quantized weights must hold before they land: the values vLLM's own
quantizers always produce, checked where a tensor is admitted.

A quantization scale multiplies (or divides) every code of its row, block or
tensor. vLLM's quantizers compute it as the largest magnitude over a positive
constant, clamped to a positive floor, so it is finite and positive; float8
codes are the quantizer's rounding of finite values, so none is NaN (e4m3fn
has no infinity; e5m2 codes are also never infinite). A scale of NaN or
infinity makes every output of the layer NaN; a scale of zero or below
serves other weights than the trainer's, silently. Such values cannot have
come from the quantizers the codes formats are defined by, so they are
refused before anything lands, naming each tensor and the value seen:

* ``*.weight_scale``, ``*.weight_scale_inv``, ``*.input_scale`` in a
  floating dtype: every element finite and greater than zero;
* float8 tensors: no NaN, and no infinity.

Integer codes (int8) hold no value outside their range, so they need no
check. ``fp8_codes.ChannelCodes`` applies the same rules on the trainer to
what it is about to send (a NaN or infinity in a weight gives a NaN scale),
and the workers apply them to every message (``refuse_bad_values``), since
any client can send a message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vllm.distributed.weight_transfer.common.wire_fields import (
    dtype_from_name,
    first_few,
)
from vllm.distributed.weight_transfer.verification import ManifestMismatch

# The names of quantization scales in vLLM's quantized checkpoint formats.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
)


class BadQuantizedValues(ManifestMismatch):
    """Quantization scales or float8 codes holding values no quantizer
    produces; raised before anything lands."""


def is_checked(name: str, dtype: torch.dtype) -> bool:
    """Whether tensor ``name`` of ``dtype`` is a scale or float8 codes whose
    values ``bad_values`` checks."""
    return dtype in FLOAT8_DTYPES or (
        dtype.is_floating_point and name.endswith(SCALE_SUFFIXES)
    )


@torch.no_grad()
def bad_values(name: str, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` (named ``name``) cannot be a quantized weight's scale or
    codes, naming the first bad value and how many there are; None when it
    can, or when it is neither (``is_checked``)."""
    if not is_checked(name, tensor.dtype):
        return None
    if name.endswith(SCALE_SUFFIXES) and tensor.dtype not in FLOAT8_DTYPES:
        values = tensor.detach().reshape(-1).float()
        bad = ~(torch.isfinite(values) & (values > 0))
        kind = "scale"
        rule = "finite and greater than zero"
    else:
        values = tensor.detach().reshape(-1)
        bad = _nonfinite_float8(values)
        kind = "codes" if not name.endswith(SCALE_SUFFIXES) else "scale"
        rule = "finite"
    count = int(bad.sum())
    if not count:
        return None
    first = int(bad.nonzero()[0, 0])
    seen = float(values[first].float())
    return (
        f"{name} ({kind}, {str(tensor.dtype).removeprefix('torch.')} "
        f"{list(tensor.shape)}) holds {seen} at flat index {first} "
        f"({count} bad element(s)); every element must be {rule}"
    )


def _nonfinite_float8(codes: torch.Tensor) -> torch.Tensor:
    """A bool mask of the float8 elements of ``codes`` (flat) that are NaN
    or infinite, read from their bit patterns (``isfinite`` has no float8
    kernel on every device)."""
    bits = codes.view(torch.uint8)
    if codes.dtype in (torch.float8_e4m3fn,):
        # All exponent and mantissa bits set: NaN (the only non-finite value).
        return (bits & 0x7F) == 0x7F
    if codes.dtype in (torch.float8_e5m2,):
        # All exponent bits set: infinity or NaN.
        return (bits & 0x7C) == 0x7C
    # The fnuz formats: 0x80 (negative zero's pattern) is their only NaN.
    return bits == 0x80


def refused_values(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """``bad_values`` of each tensor in ``named`` that has any."""
    return [why for n, t in named if (why := bad_values(n, t)) is not None]


def refuse_bad_values(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """``BadQuantizedValues`` naming every tensor of ``named`` (from ``what``:
    a message, a chunk, a trainer's source) that holds a value no quantizer
    produces; see the module docstring."""
    wrong = refused_values(named)
    if wrong:
        raise BadQuantizedValues(
            f"{what} carries {len(wrong)} quantized tensor(s) with values no "
            f"quantizer produces: {first_few(wrong, 4, '; ')}. Scales must be "
            "finite and positive and float8 codes finite (a NaN or infinity in "
            "a weight gives a NaN scale): send weights without them; nothing "
            "was loaded"
        )


def checked_views(views: Iterable[Any]) -> list[Any]:
    """The views (anything with ``name`` and ``dtype``) of the tensors whose
    values ``bad_values`` checks."""
    return [v for v in views if is_checked(v.name, v.dtype)]


def packed_values(
    slices: Iterable[Any], data: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """``(source name, values)`` of each packed slice (anything with
    ``spec.source``, ``spec.dtype`` (a dtype name), ``spec.shape`` and a byte
    ``offset`` into ``data``, a ``sharded_rdt`` chunk's) whose values
    ``bad_values`` checks, read from the chunk's bytes."""
    out = []
    raw = data.view(torch.uint8).view(-1)
    for piece in slices:
        spec = piece.spec
        dtype = dtype_from_name(spec.dtype)
        if not is_checked(spec.source, dtype):
            continue
        nbytes = spec.nbytes
        if not nbytes:
            continue
        span = raw[piece.offset : piece.offset + nbytes]
        if piece.offset % dtype.itemsize:
            span = span.clone()
        out.append((spec.source, span.view(dtype)))
    return out
