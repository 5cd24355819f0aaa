# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shared view-op allowlist and the replayer, on real tensors."""

import json

import pytest
import torch

from vllm.distributed.weight_transfer.plan.lazy import CopyRecorder, LazyWeight
from vllm.distributed.weight_transfer.plan.ops import (
    VIEW_OPS,
    SliceSpec,
    Span,
    ViewOp,
    replay,
    replay_slice,
    replay_slices,
)

# Each case applies the same view ops to a lazy weight and to a real tensor.
CHAINS = {
    "narrow": lambda t: t.narrow(0, 2, 3),
    "torch.narrow": lambda t: torch.narrow(t, 1, 1, 4),
    "view": lambda t: t.view(4, 2, 6),
    "view-size": lambda t: t.view(torch.Size([48])),
    "reshape": lambda t: t.t().reshape(-1, 4),
    "getitem-int": lambda t: t[3],
    "getitem-slices": lambda t: t[1:7:2, -3:],
    "getitem-ellipsis-none": lambda t: t[..., None, 2],
    "unsqueeze-squeeze": lambda t: t.unsqueeze(0).squeeze(0).unsqueeze(-1).squeeze(),
    "transpose": lambda t: t.transpose(0, 1),
    "t": lambda t: t.t(),
    "permute": lambda t: t.view(2, 4, 6).permute(2, 0, 1),
    "flatten": lambda t: t.view(2, 4, 6).flatten(1),
    "contiguous": lambda t: t.t().contiguous().view(-1),
    "chunk": lambda t: t.chunk(3, dim=0)[1],
    "torch.chunk": lambda t: torch.chunk(t, 2, 1)[0],
    "unbind": lambda t: t.unbind(1)[4],
    "fused-expert": lambda t: t.unsqueeze(0).unbind()[0].narrow(1, 0, 3),
}


def test_allowlist_is_the_thirteen_view_ops():
    assert set(VIEW_OPS) == {
        "narrow", "view", "reshape", "__getitem__", "unsqueeze", "squeeze",
        "transpose", "t", "permute", "flatten", "contiguous", "chunk", "unbind",
    }  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_of_recorded_chain_equals_direct_ops(case, dtype):
    real = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    lazy = CHAINS[case](LazyWeight("w", real.shape, dtype, recorder=CopyRecorder()))
    expected = CHAINS[case](real)

    out = replay_slice(real, lazy.slice_spec())

    assert out.shape == expected.shape == lazy.shape
    assert out.dtype == dtype
    assert torch.equal(out, expected)


def test_replay_applies_ops_in_order():
    real = torch.arange(24.0).view(4, 6)
    chain = (ViewOp("t"), ViewOp("narrow", (0, 1, 2)), ViewOp("chunk", (2, 1), pick=1))
    assert torch.equal(replay(real, chain), real.t().narrow(0, 1, 2).chunk(2, 1)[1])


@pytest.mark.parametrize(
    "name", ["to", "float", "add", "clone", "__setitem__", "copy_"]
)
def test_op_outside_allowlist_cannot_be_built(name):
    with pytest.raises(ValueError, match=name):
        ViewOp(name)


def test_replayer_refuses_an_op_smuggled_past_validation():
    op = ViewOp("t")
    object.__setattr__(op, "name", "zero_")
    with pytest.raises(ValueError, match="zero_"):
        op.apply(torch.ones(2, 2))


@pytest.mark.parametrize("arg", [torch.tensor([0, 1]), torch.float16, 1.5, True])
def test_op_arguments_are_only_indices(arg):
    with pytest.raises(TypeError):
        ViewOp("__getitem__", (arg,))


def test_multi_output_ops_need_pick_and_others_refuse_it():
    with pytest.raises(ValueError, match="pick"):
        ViewOp("chunk", (2,))
    with pytest.raises(ValueError, match="pick"):
        ViewOp("narrow", (0, 0, 1), pick=0)


def test_slice_spec_round_trips_through_json():
    spec = SliceSpec(
        source="model.layers.0.mlp.experts.1.up_proj.weight",
        chain=(
            ViewOp("__getitem__", ((Span(1, None, 2), Ellipsis, None, 3),)),
            ViewOp("unbind", (), (("dim", 0),), pick=2),
            ViewOp("view", ((4, -1),)),
        ),
        shape=(4, 2),
        dtype="bfloat16",
    )
    assert SliceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert hash(spec) == hash(SliceSpec.from_json(spec.to_json()))


def test_replay_refuses_a_source_of_other_geometry():
    spec = SliceSpec("w", (ViewOp("narrow", (0, 0, 2)),), (2, 4), "float32")
    with pytest.raises(ValueError, match="'w'.*expects float32 \\(2, 4\\)"):
        replay_slice(torch.zeros(6, 5), spec)
    with pytest.raises(ValueError, match="bfloat16"):
        replay_slice(torch.zeros(6, 4, dtype=torch.bfloat16), spec)


def test_replay_slices_names_a_missing_source():
    spec = SliceSpec("missing.weight", (), (2,), "float32")
    with pytest.raises(KeyError, match="missing.weight"):
        list(replay_slices({"w": torch.zeros(2)}, [spec]))
