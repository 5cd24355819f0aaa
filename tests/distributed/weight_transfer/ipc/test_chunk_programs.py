# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``chunk_programs.ChunkPrograms`` on the hand-written model of
``test_planned_landing``: a chunk's planned landing bound once over one flat
buffer (standing in for a kept mapping of the trainer's parameters) lands
what ``LandingPlan.land`` lands, is reused for the same layout, picks up new
bytes written in place, binds again for another layout, and leaves names
whose copies are not byte moves to the ordinary path. The engine path
(``SharedParameters`` over shared memory, the fresh-load oracle) is
``test_ipc_llm.test_trainer_parameters_in_shared_memory_are_read_in_place``.
"""

import pytest
import torch

from vllm.distributed.weight_transfer.ipc.chunk_programs import ChunkPrograms
from vllm.distributed.weight_transfer.plan.copy_exec import triton_available

from ..landing.test_planned import MIXED, Mixed, _bake


def _flat(tensors: dict[str, torch.Tensor], gap: int = 0):
    """The tensors in one uint8 buffer, each at a multiple of 16 bytes after
    ``gap`` free bytes, and each one's offset."""
    offsets, cursor = {}, 0
    for name, t in tensors.items():
        cursor = -(-(cursor + gap) // 16) * 16
        offsets[name] = cursor
        cursor += t.numel() * t.element_size()
    buffer = torch.zeros(cursor, dtype=torch.uint8)
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        buffer[offsets[name] : offsets[name] + n].copy_(
            t.contiguous().view(-1).view(torch.uint8)
        )
    return buffer, offsets


def _sources(buffer, offsets, like):
    def sources(names):
        out = {}
        for name in names:
            t = like[name]
            n = t.numel() * t.element_size()
            start = offsets[name]
            out[name] = buffer[start : start + n].view(t.dtype).view(t.shape)
        return out

    return sources


def _programs(plan):
    return ChunkPrograms(plan.plan, plan.served, plan.direct_names, method="loop")


def _land(programs, plan, buffer, offsets, key="chunk", checkpoint=MIXED):
    """Land every checkpoint name the way the ipc worker does: the bound
    program for what it covers, ``plan.land`` for the other direct names."""
    names = list(checkpoint)
    sources = _sources(buffer, offsets, checkpoint)
    bound = programs.bound(key, frozenset({buffer.data_ptr()}), names, sources)
    bound()
    views = sources(names)
    for name in plan.direct_names - bound.names:
        plan.land(name, views[name])
    return bound


def _direct_params(model):
    params = dict(model.named_parameters())
    return {
        n: params[n] for n in ("toy.fused.weight", "toy.norm.weight", "kept.weight")
    }


def test_a_bound_chunk_lands_what_the_plan_lands_and_is_reused():
    reference = Mixed()
    reference.load_weights(MIXED.items())
    model = Mixed()
    plan = _bake(model, MIXED)
    programs = _programs(plan)
    buffer, offsets = _flat(MIXED)
    bound = _land(programs, plan, buffer, offsets)
    assert bound.names == plan.direct_names
    assert bound.program is not None
    for name, got in _direct_params(model).items():
        assert torch.equal(got, dict(reference.named_parameters())[name]), name
    # Nothing outside the direct modules was written.
    assert not model.doubled.weight.any() and not model.beside.weight.any()

    # The trainer steps in place: same layout, new bytes, same program.
    stepped = {n: t * 3 + 1 for n, t in MIXED.items()}
    for name, t in stepped.items():
        n = t.numel() * t.element_size()
        buffer[offsets[name] : offsets[name] + n].copy_(t.view(-1).view(torch.uint8))
    again = _land(programs, plan, buffer, offsets)
    assert again is bound and programs.binds == 1
    reference.load_weights(stepped.items())
    for name, got in _direct_params(model).items():
        assert torch.equal(got, dict(reference.named_parameters())[name]), name


def test_another_layout_binds_again_and_forget_drops_a_mapping():
    plan = _bake(Mixed(), MIXED)
    programs = _programs(plan)
    buffer, offsets = _flat(MIXED)
    first = _land(programs, plan, buffer, offsets, key="a")
    moved, moved_offsets = _flat(MIXED, gap=16)
    second = _land(programs, plan, moved, moved_offsets, key="b")
    assert second is not first and programs.binds == 2 and len(programs) == 2
    programs.forget({buffer.data_ptr()})
    assert len(programs) == 1
    assert _land(programs, plan, moved, moved_offsets, key="b") is second
    programs.clear()
    assert len(programs) == 0


def test_a_chunk_without_direct_names_binds_no_program():
    plan = _bake(Mixed(), MIXED)
    programs = _programs(plan)
    buffer, offsets = _flat(MIXED)
    reloaded_only = ["handled.weight", "shared.w"]
    bound = programs.bound(
        "reloaded",
        frozenset({buffer.data_ptr()}),
        reloaded_only,
        _sources(buffer, offsets, MIXED),
    )
    assert bound.program is None and bound.names == frozenset()
    bound()  # nothing to run


def test_a_name_whose_copies_cast_lands_the_ordinary_way():
    """The trainer sends ``kept.weight`` in float64 to a float32 layer: its
    copy casts, which no byte move does, so the program leaves that name out
    and ``LandingPlan.land`` casts it."""
    checkpoint = {**MIXED, "kept.weight": MIXED["kept.weight"].double()}
    reference = Mixed()
    reference.load_weights(checkpoint.items())
    model = Mixed()
    plan = _bake(model, checkpoint)
    assert "kept.weight" in plan.direct_names
    programs = _programs(plan)
    buffer, offsets = _flat(checkpoint)
    bound = _land(programs, plan, buffer, offsets, checkpoint=checkpoint)
    assert bound.names == plan.direct_names - {"kept.weight"}
    for name, got in _direct_params(model).items():
        assert torch.equal(got, dict(reference.named_parameters())[name]), name


def test_a_chunk_layout_key_is_equal_only_for_the_same_fields():
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer.ipc.chunk_programs import ChunkLayout

    def view(name="a", dtype=torch.float32, shape=(2, 2), offset=0, buffer=0):
        return SimpleNamespace(
            name=name, dtype=dtype, shape=shape, buffer=buffer, offset=offset
        )

    layout = ChunkLayout([view(), view("b", offset=16)])
    same = ChunkLayout([view(), view("b", offset=16)])
    assert layout == same and hash(layout) == hash(same)
    assert {layout: 1}[same] == 1
    for other in (
        [view(), view("b", offset=32)],
        [view(), view("c", offset=16)],
        [view(), view("b", dtype=torch.int32, offset=16)],
        [view(), view("b", shape=(4,), offset=16)],
        [view(), view("b", offset=16, buffer=1)],
        [view()],
    ):
        assert ChunkLayout(other) != layout


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_layout_read_from_a_new_buffer_each_sync_runs_one_program(monkeypatch):
    """A packed buffer mapped anew every sync (the CUDA default), here with
    the Triton kernel in its CPU interpreter: the program bound at the first
    chunk of a layout is kept without its sources and run from each later
    buffer of that layout, its sources shifted by the buffers' distance; a
    buffer that breaks the table's alignment lands the ordinary way."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = Mixed()
    plan = _bake(model, MIXED)
    programs = ChunkPrograms(plan.plan, plan.served, plan.direct_names, method="triton")
    names = list(MIXED)
    for step in range(3):
        values = {n: t * (step + 2) - step for n, t in MIXED.items()}
        packed, offsets = _flat(values)
        # Each sync's buffer at another address (and its first one released).
        spare = torch.zeros(packed.numel() + 64 * (step + 1), dtype=torch.uint8)
        buffer = spare[64 * step : 64 * step + packed.numel()]
        buffer.copy_(packed)
        del packed
        sources = _sources(buffer, offsets, values)
        bound = programs.anywhere("layout", buffer, names, sources)
        assert bound is not None and bound.names == plan.direct_names
        bound()
        reference = Mixed()
        reference.load_weights(values.items())
        for name, got in _direct_params(model).items():
            assert torch.equal(got, dict(reference.named_parameters())[name]), name
    assert programs.binds == 1 and programs.reused == 2
    shifted = spare[1 : 1 + buffer.numel()]
    assert programs.anywhere("layout", shifted, names, sources) is None
