# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bake on a small hand-written model with vLLM-style weight loaders.

Fast stand-ins for the contracts the real-model tests check end to end: the
plan, landed by the engine's lander, reproduces load_weights, the model comes
back exactly, and what cannot be planned is reported by name.
"""

from typing import Any

import pytest
import torch
from torch import nn

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.plan.bake import (
    IncompletePlanError,
    bake_worker_plan,
)
from vllm.distributed.weight_transfer.plan.lazy import UnplannableLoaderError
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.sharded_rdt.lander import IN_PLACE
from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import land_chunks
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    initialize_layerwise_reload,
)


def _param(*shape):
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class FusedPair(nn.Module):
    """Two checkpoint tensors ``a`` (2x4) and ``b`` (4x4) packed into one weight,
    keeping only this rank's half of ``b``'s columns, like a TP-sharded QKV."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.weight = _param(4, 4)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard):
        if shard == "a":
            param.data.narrow(0, 0, 2).copy_(loaded[:, :].t().t())
        else:
            mine = loaded.narrow(1, 2 * self.rank, 2).t()
            param.data[2:].copy_(mine.reshape(2, 4))


class Castful(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = _param(3)
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(
            loaded.float()
        )


class Toy(nn.Module):
    def __init__(self, rank: int = 0, castful: bool = False):
        super().__init__()
        self.fused = FusedPair(rank)
        self.norm = nn.Module()
        self.norm.weight = _param(4)  # no weight_loader: default loader
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)
        if castful:
            self.cast = Castful()
        record_metadata_for_reloading(self)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        for name, tensor in weights:
            if name in ("pair.a", "pair.b"):
                self.fused.weight.weight_loader(
                    self.fused.weight, tensor, name.split(".")[1]
                )
            elif name == "norm.weight":
                param: torch.Tensor = self.norm.weight  # type: ignore[assignment]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            elif name == "cast.weight":
                self.cast.weight.weight_loader(self.cast.weight, tensor)
            # "extra.bias" is ignored, as a model ignores e.g. rotary inv_freq


CHECKPOINT = {
    "pair.a": torch.arange(8.0).view(2, 4) + 100,
    "pair.b": torch.arange(16.0).view(4, 4) + 200,
    "norm.weight": torch.tensor([1.5, 2.5, 3.5, 4.5]),
    "extra.bias": torch.ones(7),
}


def _metas(checkpoint):
    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in checkpoint.items()]


def _state(model):
    return {
        name: (tensor, tensor.detach().clone(), vars(tensor).get("weight_loader"))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }


def _assert_same_state(model, before):
    after = _state(model)
    assert before.keys() == after.keys()
    for name, (tensor, value, loader) in before.items():
        assert after[name][0] is tensor, name
        assert torch.equal(after[name][1], value), name
        assert after[name][2] is loader, name


@pytest.mark.parametrize("split", [False, True], ids=["one-chunk", "group-split"])
@pytest.mark.parametrize("rank", [0, 1])
def test_landing_the_replayed_plan_equals_load_weights(rank, split):
    reference = Toy(rank)
    reference.load_weights(CHECKPOINT.items())

    model = Toy(rank)
    plan = bake_worker_plan(model, _metas(CHECKPOINT), worker=f"tp{rank}/2")
    # The engine's landing path (pack_chunk, then ChunkLander); the toy's
    # parameters are real and in place, so neither module step runs.
    # Split: two producers, each holding every other checkpoint tensor, so
    # the gather group arrives as one chunk from each.
    names = list(CHECKPOINT)
    router = RdtRouter(
        2,
        1,
        owner_sets=[[0], [1]],
        name_owner_class=[i % 2 for i in range(len(names))],
        names=names,
        group_lens=[len(names)],
    )
    land_chunks(model, plan, CHECKPOINT, IN_PLACE, router=router if split else None)

    expected = _state(reference)
    for name, (_, value, _) in _state(model).items():
        assert torch.equal(value, expected[name][1]), name
    # Bytes: a (8 floats) + this rank's half of b (8 floats) + norm (4 floats).
    assert plan.nbytes == 4 * (8 + 8 + 4)
    assert plan.unused_names == ("extra.bias",)


def test_bake_restores_the_model_exactly():
    model = Toy()
    model.load_weights(CHECKPOINT.items())
    before = _state(model)
    persistence = set(model._non_persistent_buffers_set)

    bake_worker_plan(model, _metas(CHECKPOINT), worker="tp0/1")

    _assert_same_state(model, before)
    assert "weight_loader" not in vars(model.norm.weight)
    assert model._non_persistent_buffers_set == persistence
    assert not any(LAYERWISE_INFO[m].can_load() for m in model.modules())


def test_two_bakes_give_the_same_digest_and_ranks_differ():
    digests = [
        bake_worker_plan(Toy(rank), _metas(CHECKPOINT), worker="w").digest()
        for rank in (0, 0, 1)
    ]
    assert digests[0] == digests[1] != digests[2]


def test_partly_covered_module_is_reported_by_name():
    checkpoint = {k: v for k, v in CHECKPOINT.items() if k != "pair.b"}
    with pytest.raises(
        IncompletePlanError, match=r"fused: 8/16 elements \(weight 8/16\)"
    ):
        bake_worker_plan(Toy(), _metas(checkpoint), worker="tp0/1")

    plan = bake_worker_plan(
        Toy(), _metas(checkpoint), worker="tp0/1", allow_partial=True
    )
    assert [p.module for p in plan.partial_modules] == ["fused"]
    assert "PARTLY COVERED fused" in plan.dump()


def test_unplannable_loader_raises_at_plan_time_and_restores_the_model():
    model = Toy(castful=True)
    before = _state(model)
    checkpoint = {**CHECKPOINT, "cast.weight": torch.ones(3, dtype=torch.float16)}

    with pytest.raises(UnplannableLoaderError) as err:
        bake_worker_plan(model, _metas(checkpoint), worker="tp0/1")

    assert "'cast.weight'" in str(err.value)
    assert "Tensor.float" in str(err.value)
    assert "loading cast.weight" in str(err.value)
    _assert_same_state(model, before)


def test_bake_refuses_to_run_during_a_weight_update():
    model = Toy()
    initialize_layerwise_reload(model)
    with pytest.raises(RuntimeError, match="weight update is in progress"):
        bake_worker_plan(model, _metas(CHECKPOINT), worker="tp0/1")


class PostTransformed(nn.Module):
    """Loads the checkpoint tensor, then rewrites the parameter from itself, as
    ``composed_weight_loader`` does (e.g. Mamba's ``A = -exp(A_log)``)."""

    def __init__(self):
        super().__init__()
        self.weight = _param(3)

        def loader(param, loaded):
            param.data.copy_(loaded)
            param.data.copy_(-torch.exp(param))

        self.weight.weight_loader = loader


class PaddedFill(nn.Module):
    """Copies the checkpoint rows, then zero-fills the padding rows after them,
    like a vocab-padded embedding."""

    def __init__(self, padded_rows: int):
        super().__init__()
        self.weight = _param(3 + padded_rows, 2)

        def loader(param, loaded):
            param[: loaded.shape[0]].data.copy_(loaded)
            param[loaded.shape[0] :].data.fill_(0)

        self.weight.weight_loader = loader


class Single(nn.Module):
    def __init__(self, child: nn.Module):
        super().__init__()
        self.child = child
        record_metadata_for_reloading(self)

    def load_weights(self, weights):
        param: Any = self.child.weight
        for _, tensor in weights:
            param.weight_loader(param, tensor)


def test_loader_that_rewrites_the_parameter_is_unplannable():
    with pytest.raises(UnplannableLoaderError) as err:
        bake_worker_plan(
            Single(PostTransformed()),
            [ParamMeta("A_log", torch.float32, (3,))],
            worker="tp0/1",
        )
    assert "Tensor.copy_" in str(err.value)
    assert "loading child.weight from 'A_log'" in str(err.value)


def test_padding_fill_is_unplannable_only_when_there_is_padding():
    meta = [ParamMeta("embed", torch.float32, (3, 2))]
    plan = bake_worker_plan(Single(PaddedFill(0)), meta, worker="tp0/1")
    assert plan.nbytes == 24
    with pytest.raises(UnplannableLoaderError, match="Tensor.fill_"):
        bake_worker_plan(Single(PaddedFill(2)), meta, worker="tp0/1")
