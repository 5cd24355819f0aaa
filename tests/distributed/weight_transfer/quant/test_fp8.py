# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side FP8 codes (``fp8_codes``) and the worker's reading of a
layout that carries them (``codes_landing.CodesLanding.codes_entries``).

The engine test (``tests/entrypoints/rl/weight_transfer/test_quantized_llm.py``)
lands the codes in a real vLLM CPU engine; these check the pieces alone."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.landing.codes import CodesLanding, CodesRefused
from vllm.distributed.weight_transfer.quant.fp8 import (
    Fp8ChannelCodes,
    codes_name_of,
    quantize_fp8_per_channel,
    scale_name,
)


def _weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 80, generator=g)
    w[3] = 0.0  # a row of zeros: the smallest scale
    w[5] *= 1e-30  # a row far below the float8 range
    w[7] *= 1e4  # a row far above it
    w[9, 11] = 448.0 * 3  # one large value: its row's codes hit +-448
    return [w, torch.randn(33, 7, generator=g) * 0.02]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trainer_quantizer_equals_the_engines_online_quantizer(dtype):
    """Codes and scales equal, bit for bit, what vLLM's online
    ``fp8_per_channel`` method computes from the same weight in the engine's
    dtype (its own functions, called here)."""
    # vLLM's own functions (absent where only the fork's modules are, as on
    # the GPU machine the device tests run on).
    online = pytest.importorskip("vllm.model_executor.layers.quantization.online.fp8")
    weight_amax = pytest.importorskip(
        "vllm.model_executor.layers.quantization.utils.quant_utils"
    ).weight_amax

    for w in _weights(0):
        codes, scale = quantize_fp8_per_channel(w, dtype)
        served = w.to(dtype)
        want_scale = online._fp8_channel_scale(
            weight_amax(served, dim=-1, keepdim=True)
        )
        want_codes = online._fp8_quant_per_channel(served, want_scale)
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_codes_source_metadata_matches_what_it_yields():
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(16, 24, bias=False))
    model.add_module("norm", torch.nn.LayerNorm(24))
    source = Fp8ChannelCodes(
        ModuleSource(model), quantized=lambda n, s: n.endswith("q_proj.weight")
    )
    yielded = [(n, t.dtype, tuple(t.shape)) for n, t in source]
    declared = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    assert yielded == declared
    assert declared[:2] == [
        ("q_proj.weight", torch.float8_e4m3fn, (24, 16)),
        ("q_proj.weight_scale", torch.float32, (24, 1)),
    ]
    assert [d[0] for d in declared[2:]] == ["norm.weight", "norm.bias"]
    assert source.held_names() is None
    assert scale_name("a.weight") == "a.weight_scale"
    assert codes_name_of("a.weight_scale") == "a.weight"
    assert codes_name_of("a.weight") is None


def _layout(*entries):
    return [(n, d, tuple(s)) for n, d, s in entries]


def test_a_layout_reads_as_codes_only_with_per_row_float32_scales():
    codes = ("l.weight", "float8_e4m3fn", (8, 4))
    assert CodesLanding.codes_entries(
        _layout(codes, ("l.weight_scale", "float32", (8, 1)))
    ) == {"l.weight": codes}
    # One-dimensional per-row scales are per-row scales too.
    assert CodesLanding.codes_entries(
        _layout(codes, ("l.weight_scale", "float32", (8,)))
    )
    # Float8 without a scale is not codes (the dtype check refuses it).
    assert CodesLanding.codes_entries(_layout(codes)) == {}
    assert CodesLanding.codes_entries(_layout(("l.weight", "bfloat16", (8, 4)))) == {}


@pytest.mark.parametrize(
    "entries, match",
    [
        ([("l.weight_scale", "float32", (8, 1))], "comes without float8_e4m3fn codes"),
        (
            [("l.weight", "bfloat16", (8, 4)), ("l.weight_scale", "float32", (8, 1))],
            r"\(they are bfloat16\)",
        ),
        (
            [
                ("l.weight", "float8_e4m3fn", (8, 4)),
                ("l.weight_scale", "float32", (1,)),
            ],
            r"l.weight_scale is float32 \[1\]",
        ),
        (
            [
                ("l.weight", "float8_e4m3fn", (8, 4)),
                ("l.weight_scale", "bfloat16", (8, 1)),
            ],
            r"l.weight_scale is bfloat16 \[8, 1\]",
        ),
    ],
)
def test_scales_that_do_not_fit_their_codes_are_refused(entries, match):
    with pytest.raises(CodesRefused, match=match):
        CodesLanding.codes_entries(_layout(*entries))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_cuda_quantizer_equals_the_torch_operations(dtype):
    """On CUDA the trainer quantizes with one fused Triton kernel per row; its
    codes and scales equal the torch operations' bit for bit (rows of zeros,
    rows below and above the float8 range, saturating values, a row wider
    than a power of two, and Qwen3-8B-wide rows)."""
    pytest.importorskip("triton")
    from vllm.distributed.weight_transfer.quant import fp8 as fp8_codes

    assert fp8_codes._fused_rows() is not None
    g = torch.Generator().manual_seed(1)
    weights = [*_weights(2), torch.randn(64, 12288, generator=g) * 0.02]
    weights.append(torch.randn(5, 4097, generator=g))
    for w in weights:
        w = w.to(dtype).cuda()
        fused = fp8_codes.quantize_fp8_per_channel(w, dtype)
        plain = fp8_codes._quantize_with_torch_ops(w)
        assert torch.equal(fused[1].view(torch.int32), plain[1].view(torch.int32))
        assert torch.equal(fused[0].view(torch.uint8), plain[0].view(torch.uint8))
