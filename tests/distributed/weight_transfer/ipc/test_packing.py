# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc transfer plan: chunk boundaries, offsets, alignment and buffer size
are pure functions of the source metadata."""

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.ipc.packing import (
    packed_buffer_nbytes,
    plan_transfer,
)


def meta(name, numel, dtype=torch.float32):
    return ParamMeta(name, dtype, (numel,))


def test_small_model_fits_one_chunk_with_aligned_offsets():
    metas = [meta("a", 3), meta("b", 5, torch.bfloat16), meta("c", 1)]
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=1 << 20, alignment=64)
    assert len(plan.chunks) == 1
    assert [(s.name, s.offset, s.nbytes) for s in plan.slots()] == [
        ("a", 0, 12),
        ("b", 64, 10),
        ("c", 128, 4),
    ]
    # buffer sized from the metadata (aligned total), not the cap
    assert plan.buffer_nbytes == 192


def test_chunks_split_at_the_cap_in_metadata_order():
    metas = [meta(f"t{i}", 16) for i in range(10)]  # 64 bytes each
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=200, alignment=64)
    assert plan.buffer_nbytes == 200
    assert [c.names for c in plan.chunks] == [
        ["t0", "t1", "t2"],
        ["t3", "t4", "t5"],
        ["t6", "t7", "t8"],
        ["t9"],
    ]
    assert all(c.end <= plan.buffer_nbytes for c in plan.chunks)
    assert [s.name for s in plan.slots()] == [m.name for m in metas]


def test_buffer_always_fits_the_largest_tensor():
    metas = [meta("small", 4), meta("huge", 1000), meta("small2", 4)]
    assert packed_buffer_nbytes(metas, buffer_cap_bytes=100, alignment=64) == 4000
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=100, alignment=64)
    assert plan.buffer_nbytes == 4000
    assert [c.names for c in plan.chunks] == [["small"], ["huge"], ["small2"]]


def test_every_offset_is_aligned_and_chunks_do_not_overlap():
    metas = [meta(f"t{i}", n) for i, n in enumerate([1, 7, 33, 2, 100, 5, 64, 3])]
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=512, alignment=16)
    for chunk in plan.chunks:
        end = 0
        for slot in chunk.slots:
            assert slot.offset % 16 == 0
            assert slot.offset >= end
            end = slot.offset + slot.nbytes
        assert end <= plan.buffer_nbytes


def test_unpacked_plan_groups_tensors_under_the_cap_at_offset_zero():
    metas = [meta(f"t{i}", 16) for i in range(5)]  # 64 bytes each
    plan = plan_transfer(metas, packed=False, buffer_cap_bytes=130)
    assert plan.buffer_nbytes == 0
    assert [c.names for c in plan.chunks] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert {s.offset for s in plan.slots()} == {0}


def test_zero_size_tensors_and_empty_metadata():
    plan = plan_transfer([meta("empty", 0), meta("a", 2)], packed=True)
    assert [s.nbytes for s in plan.slots()] == [0, 8]
    assert plan_transfer([], packed=True).chunks == ()


def test_plan_rejects_bad_settings_and_duplicate_names():
    with pytest.raises(ValueError, match="packed_buffer_size_bytes must be positive"):
        plan_transfer([meta("a", 1)], packed=True, buffer_cap_bytes=0)
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        plan_transfer([meta("a", 1)], packed=True, alignment=48)
    with pytest.raises(ValueError, match="lists 'a' twice"):
        plan_transfer([meta("a", 1), meta("a", 2)], packed=True)


def test_overlapped_plan_alternates_the_two_halves_of_one_buffer():
    metas = [meta(f"t{i}", 16) for i in range(8)]  # 64 bytes each, 512 in all
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=256, overlap=True)
    assert plan.overlapped and plan.buffer_nbytes == 256
    assert [c.names for c in plan.chunks] == [
        [f"t{2 * i}", f"t{2 * i + 1}"] for i in range(4)
    ]
    assert [c.span for c in plan.chunks] == [(0, 128), (128, 256)] * 2
    pairs = zip(plan.chunks, plan.chunks[1:], strict=False)
    assert not any(a.overlaps(b) for a, b in pairs)


def test_a_tensor_larger_than_half_the_buffer_travels_alone_from_its_start():
    metas = [meta("a", 16), meta("big", 48), meta("b", 16), meta("c", 16)]
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=256, overlap=True)
    assert plan.overlapped and plan.buffer_nbytes == 256
    assert [c.names for c in plan.chunks] == [["a"], ["big"], ["b", "c"]]
    assert [c.span for c in plan.chunks] == [(0, 64), (0, 192), (0, 128)]
    # the lone tensor's chunk shares bytes with both neighbours, so it waits
    assert plan.chunks[1].overlaps(plan.chunks[0])
    assert plan.chunks[2].overlaps(plan.chunks[1])


def test_a_model_within_the_cap_is_one_chunk_even_with_overlap():
    metas = [meta(f"t{i}", 3) for i in range(3)]
    plan = plan_transfer(metas, packed=True, buffer_cap_bytes=1 << 20, overlap=True)
    assert not plan.overlapped and len(plan.chunks) == 1
