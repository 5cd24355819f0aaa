# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The zero-storage lazy weight: metadata answers, recording, and refusals."""

import pytest
import torch

from vllm.distributed.weight_transfer.plan.lazy import (
    CopyRecorder,
    LazyWeight,
    UnplannableLoaderError,
)


@pytest.fixture
def recorder():
    rec = CopyRecorder()
    rec.target = ("model.layers.0.mlp", "weight", torch.empty(8, 6, device="meta"))
    return rec


@pytest.fixture
def lazy(recorder):
    return LazyWeight("ckpt.w", (8, 6), torch.bfloat16, recorder=recorder)


def test_answers_metadata_without_storage(lazy):
    assert lazy.shape == (8, 6)
    assert lazy.size() == (8, 6) and lazy.size(1) == 6
    assert lazy.dim() == lazy.ndim == 2
    assert lazy.numel() == 48 and len(lazy) == 8
    assert lazy.dtype == torch.bfloat16 and lazy.element_size() == 2
    assert lazy.device.type == "cpu" and lazy.is_contiguous()
    assert "ckpt.w" in repr(lazy)


def test_view_ops_return_lazy_children_with_the_chain(lazy):
    child = lazy.narrow(0, 2, 4).t()
    assert isinstance(child, LazyWeight)
    assert child.shape == (6, 4) and child.stride() == (1, 6)
    assert [op.name for op in child.chain] == ["narrow", "t"]
    assert lazy.chain == ()


def test_copy_records_slice_and_destination_region(lazy, recorder):
    param = recorder.target[2]
    param.narrow(0, 4, 2).copy_(lazy[3:5])
    (copy,) = recorder.copies
    assert copy.slice.source == "ckpt.w" and copy.slice.shape == (2, 6)
    assert copy.slice.dtype == "bfloat16"
    assert copy.region.module == "model.layers.0.mlp" and copy.region.param == "weight"
    assert (copy.region.offset, copy.region.shape, copy.region.stride) == (
        24,
        (2, 6),
        (6, 1),
    )
    assert copy.region.dtype == "float32"


UNSUPPORTED = {
    "Tensor.float": lambda w: w.float(),
    "Tensor.to": lambda w: w.to(torch.float32),
    "Tensor.item": lambda w: w[0, 0].item(),
    "Tensor.data": lambda w: w.data,
    "Tensor.add": lambda w: w + 1,
    "Tensor.mul": lambda w: w * 2,
    "Tensor.add_": lambda w: w.add_(1),
    "Tensor.__getitem__": lambda w: w[torch.ones(8, dtype=torch.bool)],
    "Tensor.view": lambda w: w.view(torch.int16),
    "torch.cat": lambda w: torch.cat([w, w]),
    "Tensor.clone": lambda w: w.clone(),
    "Tensor.sum": lambda w: w.sum(),
    "destination of copy_": lambda w: w.copy_(torch.zeros(8, 6)),
}


@pytest.mark.parametrize("op", sorted(UNSUPPORTED))
def test_non_view_use_raises_naming_weight_parameter_and_op(lazy, op):
    with pytest.raises(UnplannableLoaderError) as err:
        UNSUPPORTED[op](lazy.narrow(0, 0, 8))
    message = str(err.value)
    assert "'ckpt.w'" in message
    assert op in message
    assert "model.layers.0.mlp.weight" in message
    assert "narrow(0, 0, 8)" in message or op == "Tensor.__getitem__"


def test_broadcasting_copy_raises(lazy, recorder):
    with pytest.raises(UnplannableLoaderError, match="'ckpt.w'.*broadcast"):
        recorder.target[2].copy_(lazy[0])


def test_copy_outside_a_weight_loader_raises(lazy, recorder):
    recorder.target = None
    with pytest.raises(UnplannableLoaderError, match="outside any parameter"):
        torch.empty(8, 6, device="meta").copy_(lazy)


def test_copy_into_another_tensor_than_the_loaded_parameter_raises(lazy):
    with pytest.raises(UnplannableLoaderError, match="other than the parameter"):
        torch.empty(16, 6, device="meta")[8:].copy_(lazy)


def test_multi_output_ops_record_which_output(lazy):
    parts = lazy.chunk(2, dim=1)
    assert [p.shape for p in parts] == [(8, 3), (8, 3)]
    assert [p.chain[-1].pick for p in parts] == [0, 1]
    rows: tuple[LazyWeight, ...] = torch.unbind(lazy)  # type: ignore[assignment]
    assert len(rows) == 8 and rows[5].chain[-1].pick == 5
