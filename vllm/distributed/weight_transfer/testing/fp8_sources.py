# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the FP8 weight-transfer tests share, offline and through ``vllm serve``:
the engine's online scheme (``QUANTIZATION``: float8 codes with one float32
scale per output channel) and a check that it is active, the fused layers of a
Qwen3 block it quantizes (``FUSED_FROM``) and the digests a TP 1 engine's
codes must have for a trainer's model (``codes_digests``), a trainer source
whose scale is bad after the trainer's own check (``BadScale``), and
``codes_or_skip``: sends codes, skipping the test on a CPU whose FP8 kernel
refuses codes by design."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import WeightSource
from vllm.distributed.weight_transfer.quant.fp8 import (
    Fp8ChannelCodes,
    quantize_fp8_per_channel,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import WrappedSource

QUANTIZATION = "fp8_per_channel"
# A linear layer the scheme quantizes and a layer it leaves alone.
QUANTIZED = "model.layers.0.mlp.down_proj.weight"
UNQUANTIZED = "model.norm.weight"
# A weight of the first layer that the scheme quantizes, and its scale.
NAN_WEIGHT = "model.layers.0.self_attn.q_proj.weight"

# The vLLM layers of a Qwen3 decoder block that the scheme quantizes, each
# with the checkpoint tensors its rows come from, in order.
FUSED_FROM = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def assert_quantized(dtypes: dict[str, str]) -> None:
    """``dtypes`` (served name -> dtype, as ``served_weight_dtypes`` reads
    them) show the scheme active: float8 codes for a quantized layer, the
    model's bfloat16 for a layer it leaves alone."""
    assert dtypes[QUANTIZED] == "torch.float8_e4m3fn", dtypes[QUANTIZED]
    assert dtypes[UNQUANTIZED] == "torch.bfloat16", dtypes[UNQUANTIZED]


def codes_or_skip(call: Callable[[], Any]) -> Any:
    """``call()``, which sends FP8 codes (or plans for them: a ``sharded_rdt``
    init). On a CPU whose FP8 kernel repacks codes after loading (vLLM's
    AMX-FP8 kernel), the engine refuses them by design, naming the kernel,
    before anything lands: the test then skips what needs codes to land."""
    import pytest

    try:
        return call()
    except Exception as e:
        if "repacks the codes after loading" in str(e):
            pytest.skip(f"this CPU's FP8 kernel repacks codes, refused by design: {e}")
        raise


def send_codes_or_skip(trainer: Any) -> None:
    """``trainer.send_weights()`` of FP8 codes, through ``codes_or_skip``."""
    codes_or_skip(trainer.send_weights)


def codes_digests(model: Any) -> dict[str, str]:
    """What a TP 1 engine's fp8_codes_state digests must be for the trainer's
    ``model``: each fused layer's codes and scales, quantized on the trainer."""
    params = dict(model.named_parameters())
    digests = {}
    for i in range(model.config.num_hidden_layers):
        for fused, parts in FUSED_FROM.items():
            pieces = [
                quantize_fp8_per_channel(params[f"model.layers.{i}.{p}.weight"])
                for p in parts
            ]
            codes = torch.cat([c.view(torch.uint8) for c, _ in pieces])
            scales = torch.cat([s.reshape(-1) for _, s in pieces]).view(torch.uint8)
            digests[f"model.layers.{i}.{fused}"] = hashlib.sha256(
                codes.numpy().tobytes() + scales.numpy().tobytes()
            ).hexdigest()
    return digests


class BadScale(WrappedSource):
    """``Fp8ChannelCodes`` of ``source`` (any source of the trainer's
    weights: a ``ModuleSource`` for ``ipc``, a ``CheckpointNamesSource`` for
    ``sharded_rdt``) with ``value`` written into the first element of layer
    0's ``q_proj.weight_scale`` (a negative ``value`` negates the whole
    scale) after the trainer's own check: what a client that skips it
    sends."""

    def __init__(self, source: WeightSource, value: float) -> None:
        super().__init__(Fp8ChannelCodes(source))
        self.value = value

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner:
            if name == NAN_WEIGHT + "_scale":
                tensor = tensor.clone()
                if self.value < 0:
                    tensor.neg_()
                else:
                    tensor.view(-1)[0] = self.value
            yield name, tensor
