# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``ShadowLayers`` on small torch models (no engine): layers processed by
vLLM's own CPU linear method in their shadows serve, after the commit, exactly
what the served layer serves when it is loaded and processed in place; nothing
of the served model changes before the commit; names of layers that cannot be
processed apart stay with the reload, and a loader routed to one of them
raises instead of writing."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.landing.completeness import (
    IncompleteUpdateError,
)
from vllm.distributed.weight_transfer.worker.shadows import ShadowLayers

from ..ipc.worker_rig import TinyNet


class Linear(torch.nn.Module):
    """A linear layer run by vLLM's unquantized linear method, as vLLM's
    linear layers are (on CPU: a packed GEMM handle built at processing)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in), False)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class Unknown(torch.nn.Module):
    """A layer with a quantization method the shadows do not know."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4), False)
        self.quant_method = object()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Linear(8, 16)
        self.b = Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.odd = Unknown()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.a(x)))

    load_weights = TinyNet.load_weights


def served_net(seed: int) -> Net:
    """A net as vLLM serves it: recorded for reloading, then processed."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    torch.manual_seed(seed)
    net = Net()
    record_metadata_for_reloading(net)
    with torch.no_grad():
        for layer in (net.a, net.b):
            layer.quant_method.process_weights_after_loading(layer)
    return net


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


X = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))


def test_the_commit_serves_what_processing_the_served_layers_serves():
    served, weights = served_net(0), checkpoint(1)
    before = served(X)
    handles = (served.a.cpu_linear, served.b.cpu_linear)
    shadows = ShadowLayers(served)
    names = [n for n in weights if shadows.takes(n)]
    assert names == ["a.weight", "b.weight", "norm.weight", "norm.bias"]
    shadows.load([(n, weights[n]) for n in names])
    assert shadows.layers_processed == 3
    # Nothing served changed: the same handles, the same output.
    assert (served.a.cpu_linear, served.b.cpu_linear) == handles
    torch.testing.assert_close(served(X), before, rtol=0, atol=0)
    shadows.check()
    shadows.commit()

    expected = served_net(0)
    expected.norm.load_state_dict(
        {"weight": weights["norm.weight"], "bias": weights["norm.bias"]}
    )
    with torch.no_grad():
        for name in ("a", "b"):
            layer = getattr(expected, name)
            layer.weight = torch.nn.Parameter(weights[f"{name}.weight"], False)
            layer.quant_method.process_weights_after_loading(layer)
    torch.testing.assert_close(served(X), expected(X), rtol=0, atol=0)
    assert served.a.cpu_linear is not handles[0]


def test_a_layer_missing_a_tensor_is_refused_at_check_with_nothing_served_changed():
    served, weights = served_net(0), checkpoint(1)
    before = served(X)
    shadows = ShadowLayers(served)
    shadows.load(
        [("a.weight", weights["a.weight"]), ("norm.weight", weights["norm.weight"])]
    )
    with pytest.raises(IncompleteUpdateError, match="norm.bias"):
        shadows.check()
    torch.testing.assert_close(served(X), before, rtol=0, atol=0)


def test_unknown_layers_and_scales_stay_with_the_reload_and_never_load_in_a_shadow():
    served = served_net(0)
    shadows = ShadowLayers(served)
    assert not shadows.takes("odd.weight")
    assert not shadows.takes("a.k_scale")
    kept = served.odd.weight.detach().clone()
    with pytest.raises(RuntimeError, match="cannot load into a shadow layer"):
        shadows.load([("odd.weight", torch.zeros(4, 4))])
    assert torch.equal(served.odd.weight, kept)
