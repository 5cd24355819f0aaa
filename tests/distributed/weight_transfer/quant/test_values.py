# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scales and float8 codes no quantizer produces are refused before they land
(``quantized_values``): by the trainer's codes sources before sending, and by
the worker's check of every message (``refuse_bad_values``, which the ``ipc``
worker runs before the first byte lands). The engine tests
(``tests/entrypoints/rl/weight_transfer/test_quantized_llm.py``) send such a
sync to a real engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.quant.fp8 import (
    Fp8BlockCodes,
    Fp8ChannelCodes,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
)
from vllm.distributed.weight_transfer.quant.int8 import (
    Int8ChannelCodes,
    Int8TensorCodes,
    quantize_int8_per_channel,
    quantize_int8_per_tensor,
)
from vllm.distributed.weight_transfer.quant.values import (
    BadQuantizedValues,
    bad_values,
    checked_views,
    packed_values,
    refuse_bad_values,
)

# Each code kind: its quantizer and the name of its scale.
KINDS: dict[str, tuple[Callable, str]] = {
    "fp8_channel": (quantize_fp8_per_channel, "weight_scale"),
    "fp8_block": (quantize_fp8_per_block, "weight_scale_inv"),
    "int8_channel": (quantize_int8_per_channel, "weight_scale"),
    "int8_tensor": (quantize_int8_per_tensor, "weight_scale"),
}
BAD_SCALES = {
    "nan": float("nan"),
    "inf": float("inf"),
    "zero": 0.0,
    "negative": None,  # the scale negated
}
LAYER = "model.layers.0.self_attn.q_proj"


def _quantized(kind: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    quantize, scale_field = KINDS[kind]
    weight = torch.randn(160, 136, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize(weight)
    return codes, scale, scale_field


@pytest.mark.parametrize("bad", list(BAD_SCALES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_worker_refuses_a_scale_that_is_not_finite_and_positive(kind, bad):
    codes, scale, field = _quantized(kind)
    scale = scale.clone()
    value = BAD_SCALES[bad]
    if value is None:
        scale.neg_()
    else:
        scale.view(-1)[0] = value
    message = [(f"{LAYER}.weight", codes), (f"{LAYER}.{field}", scale)]
    with pytest.raises(BadQuantizedValues, match=rf"q_proj\.{field} \(scale, float32"):
        refuse_bad_values(message, "update_info")
    # The message is refused as a whole; its codes are not at fault.
    assert bad_values(f"{LAYER}.weight", codes) is None


@pytest.mark.parametrize("kind", ["fp8_channel", "fp8_block"])
def test_the_worker_refuses_float8_codes_holding_nan(kind):
    codes, scale, field = _quantized(kind)
    codes = codes.clone()
    codes[3, 5] = float("nan")
    why = bad_values(f"{LAYER}.weight", codes)
    assert why is not None and "q_proj.weight (codes, float8_e4m3fn" in why
    assert f"flat index {3 * codes.shape[1] + 5}" in why and "nan" in why
    with pytest.raises(BadQuantizedValues, match=r"q_proj\.weight \(codes"):
        refuse_bad_values(
            [(f"{LAYER}.weight", codes), (f"{LAYER}.{field}", scale)], "update_info"
        )


def test_float8_e5m2_infinity_is_refused_and_finite_float8_passes():
    codes = torch.tensor([1.0, -2.0, 0.0, 57344.0], dtype=torch.float8_e5m2)
    assert bad_values("w", codes) is None
    codes[1] = float("inf")
    assert "inf" in (bad_values("w", codes) or "")


def test_good_codes_and_full_precision_tensors_pass():
    for kind in KINDS:
        codes, scale, field = _quantized(kind)
        refuse_bad_values(
            [(f"{LAYER}.weight", codes), (f"{LAYER}.{field}", scale)], "update_info"
        )
    # Full-precision weights are not checked: NaN there is the trainer's value.
    nan_weight = torch.full((4, 4), float("nan"))
    assert bad_values(f"{LAYER}.weight", nan_weight) is None
    # Integer tensors named like scales (zero points) are not checked.
    assert bad_values(f"{LAYER}.input_scale", torch.zeros(1, dtype=torch.int8)) is None


def test_static_activation_scales_are_checked():
    why = bad_values(f"{LAYER}.input_scale", torch.tensor([0.0]))
    assert why is not None and "input_scale (scale" in why


def test_checked_views_picks_scales_and_float8_only():
    class View:
        def __init__(self, name: str, dtype: torch.dtype) -> None:
            self.name, self.dtype = name, dtype

    views = [
        View(f"{LAYER}.weight", torch.float8_e4m3fn),
        View(f"{LAYER}.weight_scale", torch.float32),
        View("model.norm.weight", torch.bfloat16),
        View(f"{LAYER}.weight", torch.int8),
    ]
    assert [v for v in checked_views(views)] == views[:2]


SOURCES = {
    "fp8_channel": Fp8ChannelCodes,
    "fp8_block": Fp8BlockCodes,
    "int8_channel": Int8ChannelCodes,
    "int8_tensor": Int8TensorCodes,
}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_trainer_refuses_to_send_codes_of_a_non_finite_weight(kind, value):
    """A NaN or infinity in a weight gives its row (tile, tensor) a NaN scale:
    the codes source refuses it before yielding it, naming the scale."""
    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(136, 160, bias=False)
    with torch.no_grad():
        model.q_proj.weight[7, 3] = value
    source = SOURCES[kind](ModuleSource(model))
    field = KINDS[kind][1]
    with pytest.raises(BadQuantizedValues, match=rf"q_proj\.{field} \(scale"):
        list(source)


def test_the_trainer_refuses_a_bad_static_activation_scale():
    model = torch.nn.Module()
    model.q_proj = torch.nn.Linear(8, 8, bias=False)
    source = Int8ChannelCodes(
        ModuleSource(model),
        static_activations={"q_proj.input_scale": torch.tensor([-1.0])},
    )
    with pytest.raises(BadQuantizedValues, match=r"q_proj\.input_scale \(scale"):
        list(source)


def test_a_sharded_rdt_chunk_is_read_for_its_scales_and_codes():
    """``packed_values`` reads the checked slices of a pulled chunk from its
    bytes (the ``sharded_rdt`` worker refuses them before the chunk lands)."""
    from vllm.distributed.weight_transfer.plan.ops import SliceSpec
    from vllm.distributed.weight_transfer.pull.chunks import PackedSlice

    codes, scale = quantize_fp8_per_channel(torch.randn(8, 16))
    scale = scale.clone()
    scale[2] = -scale[2]
    norm = torch.ones(16)
    data = torch.cat(
        [codes.view(torch.uint8).view(-1), scale.view(torch.uint8).view(-1)]
        + [norm.view(torch.uint8)]
    )
    slices = [
        PackedSlice(SliceSpec(f"{LAYER}.weight", (), (8, 16), "float8_e4m3fn"), 0),
        PackedSlice(SliceSpec(f"{LAYER}.weight_scale", (), (8, 1), "float32"), 128),
        PackedSlice(SliceSpec("model.norm.weight", (), (16,), "float32"), 160),
    ]
    read = dict(packed_values(slices, data))
    assert set(read) == {f"{LAYER}.weight", f"{LAYER}.weight_scale"}
    assert torch.equal(read[f"{LAYER}.weight_scale"], scale.view(-1))
    with pytest.raises(BadQuantizedValues, match=r"weight_scale \(scale.* index 2"):
        refuse_bad_values(read.items(), "chunk seq 0")
