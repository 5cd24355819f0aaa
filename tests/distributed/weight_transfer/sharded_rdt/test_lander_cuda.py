# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``sharded_rdt`` lander's batched direct copies on a GPU (Triton): a
program bound to one buffer and released from it runs from any other buffer
holding the chunk (``CopyProgram.run_shifted``), and ``ChunkLander`` lands
chunks from receive buffers it keeps and from fresh buffers (a staged
commit's) bit for bit, binding each chunk once.

Needs an NVIDIA GPU and Triton; skipped without them. Imports nothing that
needs vLLM installed, so it runs on the device machine
(``tools/fork/device``)."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.plan.copy_exec import (
    CopyProgram,
    triton_available,
)
from vllm.distributed.weight_transfer.plan.copy_table import compile_chunk_table
from vllm.distributed.weight_transfer.plan.ops import (
    SliceSpec,
    ViewOp,
    replay_slice,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
from vllm.distributed.weight_transfer.pull.producer import pack_chunk
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.sharded_rdt.lander import IN_PLACE, ChunkLander

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()),
    reason="needs a CUDA GPU and Triton",
)


# Two layers, so two gather groups: two chunks.
QKV, OUT = "model.layers.0.qkv", "model.layers.0.o"
NORM, UP = "model.layers.1.norm", "model.layers.1.up"


def _sources(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = {QKV: (48, 32), OUT: (32, 64), NORM: (32,), UP: (3, 16, 8)}
    return {
        name: torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
        for name, shape in shapes.items()
    }


def _plan():
    """Rows, a column slice (a TP rank's half), a whole vector and one
    expert of a stacked tensor, landing in two served tensors."""

    def copy(source, chain, shape, module, param, offset, stride):
        return SliceCopy(
            SliceSpec(source, tuple(chain), shape, "bfloat16"),
            Region(module, param, offset, shape, stride, "bfloat16"),
        )

    copies = [
        copy(QKV, [ViewOp("narrow", (0, 0, 24))], (24, 32), "attn", "w", 0, (32, 1)),
        copy(OUT, [ViewOp("narrow", (1, 32, 32))], (32, 32), "attn", "w", 768, (32, 1)),
        copy(NORM, [], (32,), "norm", "w", 0, (1,)),
        copy(UP, [ViewOp("unbind", (0,), pick=1)], (16, 8), "norm", "w", 32, (8, 1)),
    ]
    return build_plan(worker="t", names=[QKV, OUT, NORM, UP], copies=copies)


def _served():
    return {
        "attn.w": torch.zeros(24 * 32 + 32 * 32, dtype=torch.bfloat16, device="cuda"),
        "norm.w": torch.zeros(32 + 16 * 8, dtype=torch.bfloat16, device="cuda"),
    }


def _direct(plan, served):
    out = {}
    for c in plan.copies:
        r, t = c.region, served[c.region.qualname]
        out[c] = t.as_strided(r.shape, r.stride, t.storage_offset() + r.offset)
    return out


def _assert_landed(direct, sources):
    for c, view in direct.items():
        want = replay_slice(sources[c.slice.source], c.slice)
        assert torch.equal(view.view(torch.int16), want.view(torch.int16)), c


def test_a_released_program_runs_from_any_buffer_with_the_chunk():
    plan = _plan()
    served = _served()
    direct = _direct(plan, served)
    pulls = build_pull_plan(plan, RdtRouter(1, 1), consumer_id=0)
    assert len(pulls.chunks) == 2
    chunk = pulls.chunks[0]
    copies = [c for c in plan.copies if c.slice.source in (QKV, OUT)]
    direct = {c: direct[c] for c in copies}
    first = torch.empty(chunk.nbytes, dtype=torch.uint8, device="cuda")
    pack_chunk(chunk, _sources(1), first)
    offsets = {p.spec: p.offset for p in chunk.slices}
    table = compile_chunk_table([(offsets[c.slice], c) for c in copies], chunk.nbytes)
    assert table.fallback == ()
    dests = {
        name: view.as_strided((1,), (1,), view.storage_offset() - c.region.offset)
        for c, view in direct.items()
        for name in [c.region.qualname]
    }
    program = CopyProgram(table, [first], [dests[d.name] for d in table.dests])
    origin = first.data_ptr()
    assert program.method == "triton" and program.can_shift(0)
    program()
    _assert_landed(direct, _sources(1))
    program.release_sources()
    with pytest.raises(RuntimeError, match="released its sources"):
        program()
    del first
    for seed in (2, 3):
        # A buffer at another address (one allocation among others).
        spare = torch.empty(chunk.nbytes + 4096, dtype=torch.uint8, device="cuda")
        other = spare[512 : 512 + chunk.nbytes]
        pack_chunk(chunk, _sources(seed), other)
        assert program.can_shift(other.data_ptr() - origin)
        program.run_shifted(other.data_ptr() - origin)
        _assert_landed(direct, _sources(seed))
    # A buffer that breaks the table's alignment is not taken.
    shifted = spare[2 : 2 + chunk.nbytes]
    assert not program.can_shift(shifted.data_ptr() - origin)
    with pytest.raises(ValueError, match="multiple of"):
        program.run_shifted(shifted.data_ptr() - origin)


@pytest.mark.parametrize("fresh", [False, True])
def test_the_lander_lands_kept_and_fresh_buffers_bit_for_bit(fresh):
    plan = _plan()
    served = _served()
    direct = _direct(plan, served)
    pulls = build_pull_plan(plan, RdtRouter(1, 1), consumer_id=0)
    assert len(pulls.chunks) == 2
    lander = ChunkLander(torch.nn.Module(), plan, pulls, IN_PLACE, direct=direct)
    kept = [
        torch.empty(c.nbytes, dtype=torch.uint8, device="cuda") for c in pulls.chunks
    ]
    for seed in range(4):
        sources = _sources(10 + seed)
        lander.begin()
        for index, chunk in enumerate(pulls.chunks):
            if fresh:
                data = torch.empty(
                    chunk.nbytes + 1024, dtype=torch.uint8, device="cuda"
                )
                data = data[512 * (seed % 2) :][: chunk.nbytes]
            else:
                data = kept[index]
            pack_chunk(chunk, sources, data)
            lander.land(index, data, reused=not fresh)
        _assert_landed(direct, sources)
        assert lander.batched == len(plan.copies)
    # Each chunk bound once, whichever buffer it arrived in later.
    assert lander.binds == len(pulls.chunks)
