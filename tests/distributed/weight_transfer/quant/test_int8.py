# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side int8 codes (``int8_codes``): the quantizer's arithmetic and
what ``Int8ChannelCodes`` sends, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.quant.int8 import (
    INT8_HALF_RANGE,
    Int8ChannelCodes,
    Int8TensorCodes,
    quantize_int8_per_channel,
    quantize_int8_per_tensor,
)


def test_codes_and_scales_per_row():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.linspace(0.01, 3.0, 6)[:, None]
    w[2] = 0.0  # a row of zeros still gets a finite, positive scale
    codes, scale = quantize_int8_per_channel(w, torch.float32)
    assert codes.dtype == torch.int8 and codes.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (6, 1)
    assert torch.all(scale > 0) and torch.all(codes[2] == 0)
    amax = w.abs().amax(dim=1, keepdim=True)
    nonzero = amax.squeeze(1) > 0
    assert torch.equal(scale[nonzero], (amax / INT8_HALF_RANGE)[nonzero])
    # Round to nearest: every weight is within half a step of its code (the
    # row's extremes sit exactly half a step out, at -128 and 127).
    assert torch.all((codes.float() * scale - w).abs() <= scale / 2 * (1 + 1e-5))
    # Each row on its own: a TP shard of rows is a slice of the result.
    part_codes, part_scale = quantize_int8_per_channel(w[3:], torch.float32)
    assert torch.equal(part_codes, codes[3:]) and torch.equal(part_scale, scale[3:])


@pytest.mark.parametrize("per", ["channel", "tensor"])
def test_scales_are_divided_exactly_on_every_device(per):
    """``amax / 127.5`` correctly rounded (a float32 quotient of float32
    operands computed in float64 and rounded once is correctly rounded), not
    through the divisor's reciprocal, which torch uses on CUDA for a Python
    number; on CUDA the codes and scales then equal the host's."""
    quantize = (
        quantize_int8_per_channel if per == "channel" else (quantize_int8_per_tensor)
    )
    torch.manual_seed(1)
    w = (torch.randn(512, 256) * 0.02).to(torch.bfloat16)
    codes, scale = quantize(w)
    dims = (1,) if per == "channel" else (0, 1)
    amax = w.float().abs().amax(dim=dims, keepdim=per == "channel").reshape(scale.shape)
    assert torch.equal(scale, (amax.double() / INT8_HALF_RANGE).float())
    if torch.cuda.is_available():
        on_device = quantize(w.cuda())
        assert torch.equal(on_device[0].cpu(), codes)
        assert torch.equal(on_device[1].cpu(), scale)


def test_the_weight_is_cast_to_the_engine_dtype_first():
    w = torch.tensor([[1.0 + 2**-10, -1.0]])  # not a bfloat16 value
    codes, scale = quantize_int8_per_channel(w, torch.bfloat16)
    expected = w.to(torch.bfloat16).float()
    assert torch.equal(scale, expected.abs().amax(dim=1, keepdim=True) / 127.5)
    assert codes.tolist() == [[127, -127]]


def test_only_2d_weights_are_quantized():
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8_per_channel(torch.ones(4))


def test_the_source_sends_codes_then_scales_in_checkpoint_names():
    net = torch.nn.Module()
    net.q_proj = torch.nn.Linear(8, 4, bias=False)
    net.norm = torch.nn.LayerNorm(8)
    source = Int8ChannelCodes(ModuleSource(net), dtype=torch.float32)
    metas = {m.name: (m.dtype, tuple(m.shape)) for m in source.metadata()}
    assert metas == {
        "q_proj.weight": (torch.int8, (4, 8)),
        "q_proj.weight_scale": (torch.float32, (4, 1)),
        "norm.weight": (torch.float32, (8,)),
        "norm.bias": (torch.float32, (8,)),
    }
    sent = dict(iter(source))
    assert list(sent) == list(metas)
    codes, scale = quantize_int8_per_channel(net.q_proj.weight, torch.float32)
    assert torch.equal(sent["q_proj.weight"], codes)
    assert torch.equal(sent["q_proj.weight_scale"], scale)
    assert torch.equal(sent["norm.weight"], net.norm.weight.detach())


def test_per_tensor_codes_share_one_scale():
    torch.manual_seed(1)
    w = torch.randn(5, 12)
    codes, scale = quantize_int8_per_tensor(w, torch.float32)
    assert codes.dtype == torch.int8 and scale.shape == (1,)
    assert torch.equal(scale, w.abs().amax().reshape(1) / INT8_HALF_RANGE)
    assert torch.equal(codes, torch.round(w / scale).clamp(-128, 127).to(torch.int8))
    net = torch.nn.Module()
    net.up_proj = torch.nn.Linear(12, 5, bias=False)
    metas = {
        m.name: tuple(m.shape) for m in Int8TensorCodes(ModuleSource(net)).metadata()
    }
    assert metas == {"up_proj.weight": (5, 12), "up_proj.weight_scale": (1,)}


def test_static_activation_parameters_follow_their_layer_codes(tmp_path):
    from safetensors.torch import save_file

    from vllm.distributed.weight_transfer.quant.int8 import read_static_activations

    net = torch.nn.Module()
    net.q_proj = torch.nn.Linear(8, 4, bias=False)
    net.o_proj = torch.nn.Linear(4, 8, bias=False)
    net.norm = torch.nn.LayerNorm(8)
    save_file(
        {
            "q_proj.input_scale": torch.tensor([0.02]),
            "q_proj.input_zero_point": torch.tensor([3], dtype=torch.int8),
            "q_proj.weight": torch.zeros(4, 8, dtype=torch.int8),
        },
        str(tmp_path / "model.safetensors"),
    )
    params = read_static_activations(tmp_path)
    assert set(params) == {"q_proj.input_scale", "q_proj.input_zero_point"}
    source = Int8ChannelCodes(
        ModuleSource(net), dtype=torch.float32, static_activations=params
    )
    names = [m.name for m in source.metadata()]
    assert names == [
        "q_proj.weight",
        "q_proj.weight_scale",
        "q_proj.input_scale",
        "q_proj.input_zero_point",
        "o_proj.weight",
        "o_proj.weight_scale",
        "norm.weight",
        "norm.bias",
    ]
    sent = dict(iter(source))
    assert list(sent) == names
    assert torch.equal(sent["q_proj.input_scale"], torch.tensor([0.02]))
    assert sent["q_proj.input_zero_point"].dtype == torch.int8
    meta = {m.name: (m.dtype, tuple(m.shape)) for m in source.metadata()}
    assert meta["q_proj.input_zero_point"] == (torch.int8, (1,))


def test_static_activation_parameters_without_codes_are_refused():
    net = torch.nn.Module()
    net.q_proj = torch.nn.Linear(8, 4, bias=False)
    stray = {"k_proj.input_scale": torch.tensor([0.1])}
    with pytest.raises(ValueError, match=r"k_proj\.input_scale"):
        Int8ChannelCodes(ModuleSource(net), static_activations=stray).metadata()
    with pytest.raises(ValueError, match="not a static activation parameter"):
        Int8ChannelCodes(
            ModuleSource(net), static_activations={"q_proj.weight": torch.ones(1)}
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_cuda_quantizer_equals_the_host(dtype):
    """On CUDA one fused Triton kernel per row (``row_quantizer``) quantizes;
    its codes and scales equal the host's torch operations bit for bit: a
    row of zeros, ties that round half to even, rows wider than a power of
    two and Qwen3-8B-wide rows."""
    pytest.importorskip("triton")
    from vllm.distributed.weight_transfer.quant import int8 as int8_codes

    assert int8_codes._fused_rows() is not None
    g = torch.Generator().manual_seed(2)
    ties = torch.tensor([[127.5, 0.5, 1.5, 2.5, -0.5, -1.5, -127.5, 3.0]])
    weights = [
        torch.zeros(3, 64),
        ties,
        torch.randn(5, 4097, generator=g),
        torch.randn(64, 12288, generator=g) * 0.02,
    ]
    for w in weights:
        host = quantize_int8_per_channel(w, dtype)
        fused = quantize_int8_per_channel(w.cuda(), dtype)
        assert torch.equal(fused[1].cpu(), host[1]), w.shape
        assert torch.equal(fused[0].cpu(), host[0]), w.shape
