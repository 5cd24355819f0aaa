# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``layerwise_session.SharedScalarLoads``: a fused layer's one-element
parameter (a static activation scale) is loaded once per update, not once per
shard, so vLLM's layerwise reload does not process the layer before its last
shard arrives; shards that disagree are refused. No engine."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.landing.layerwise import SharedScalarLoads


class _Fused(torch.nn.Module):
    def __init__(self, scale_numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 4))
        self.input_scale = torch.nn.Parameter(torch.zeros(scale_numel))


class _Model(torch.nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        attn = torch.nn.Module()
        attn.qkv_proj = _Fused(scale_numel=1)
        mlp = torch.nn.Module()
        mlp.gate_up_proj = _Fused(scale_numel=2)  # one scale per shard
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        self.layers = torch.nn.ModuleList([layer])


def _w(value: float) -> torch.Tensor:
    return torch.tensor([value])


def test_one_element_fused_parameters_load_once_per_update():
    loads = SharedScalarLoads(_Model())
    first = [
        ("layers.0.self_attn.q_proj.weight", torch.ones(2, 4)),
        ("layers.0.self_attn.q_proj.input_scale", _w(0.5)),
        ("layers.0.self_attn.k_proj.input_scale", _w(0.5)),
    ]
    kept = loads.once_each(first)
    assert [n for n, _ in kept] == [
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.q_proj.input_scale",
    ]
    # A later call of the same update: the value is still checked, not loaded.
    assert loads.once_each([("layers.0.self_attn.v_proj.input_scale", _w(0.5))]) == []
    # A parameter with one element per shard loads every shard.
    per_shard = [
        ("layers.0.mlp.gate_proj.input_scale", _w(0.1)),
        ("layers.0.mlp.up_proj.input_scale", _w(0.2)),
    ]
    assert [n for n, _ in loads.once_each(per_shard)] == [n for n, _ in per_shard]


def test_shards_that_disagree_are_refused():
    loads = SharedScalarLoads(_Model())
    loads.once_each([("layers.0.self_attn.q_proj.input_scale", _w(0.5))])
    with pytest.raises(ValueError, match=r"v_proj\.input_scale = \[0\.25\] differs"):
        loads.once_each([("layers.0.self_attn.v_proj.input_scale", _w(0.25))])


def test_a_model_without_fused_layers_loads_everything():
    model = torch.nn.Linear(2, 2)
    weights = [("weight", torch.ones(2, 2)), ("bias", torch.ones(2))]
    assert SharedScalarLoads(model).once_each(weights) == weights
