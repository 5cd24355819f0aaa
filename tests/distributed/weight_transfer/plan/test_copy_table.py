# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The copy table: a plan compiled into byte runs lands exactly what the
engine's lander lands, and what is not a byte move is reported, not guessed."""

import random

import numpy as np
import pytest
import torch

from vllm.distributed.weight_transfer.plan.bake import bake_worker_plan
from vllm.distributed.weight_transfer.plan.copy_exec import (
    CopyProgram,
    build_tasks,
    empty_dests,
    execute,
    land_fallback,
    triton_available,
)
from vllm.distributed.weight_transfer.plan.copy_table import (
    CHUNK_SOURCE,
    compile_chunk_table,
    compile_copy_table,
)
from vllm.distributed.weight_transfer.plan.ops import (
    SliceSpec,
    Span,
    ViewOp,
    dtype_from_name,
    replay_slice,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.sharded_rdt.lander import IN_PLACE
from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import land_chunks

from .test_bake import CHECKPOINT, Toy, _metas


def _source_metas(checkpoint):
    return {n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()}


def _model_tensors(model):
    return dict([*model.named_parameters(), *model.named_buffers()])


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("method", ["loop", "foreach"])
def test_table_lands_what_the_lander_lands(rank, method):
    plan = bake_worker_plan(Toy(rank), _metas(CHECKPOINT), worker=f"tp{rank}/2")

    expected = Toy(rank)
    land_chunks(expected, plan, CHECKPOINT, IN_PLACE)

    table = compile_copy_table(plan, _source_metas(CHECKPOINT))
    assert table.fallback == ()
    assert table.total_bytes == plan.nbytes
    model = Toy(rank)
    tensors = _model_tensors(model)
    sources = [CHECKPOINT[s.name] for s in table.sources]
    dests = [tensors[d.name] for d in table.dests]
    assert execute(table, sources, dests, method=method) == method

    reference = _model_tensors(expected)
    for name, tensor in tensors.items():
        # Bit for bit, including what the plan does not touch.
        assert torch.equal(tensor.view(torch.int32), reference[name].view(torch.int32))


def test_toy_rank1_takes_strided_columns_element_by_element():
    plan = bake_worker_plan(Toy(1), _metas(CHECKPOINT), worker="tp1/2")
    table = compile_copy_table(plan, _source_metas(CHECKPOINT))
    names = [s.name for s in table.sources]
    b = table.src == names.index("pair.b")
    # pair.b -> narrow(1, 2, 2).t(): per destination row, 4 floats 16 bytes apart.
    assert table.nbytes[b].tolist() == [4, 4]
    assert table.rows[b].tolist() == [4, 4]
    assert table.src_pitch[b].tolist() == [16, 16]
    assert table.runs == int(table.rows.sum())


def _copy(
    source,
    chain,
    shape,
    region_shape,
    stride,
    offset=0,
    dtype="float32",
    region_dtype=None,
    module="m",
    param="w",
):
    return SliceCopy(
        SliceSpec(source, tuple(chain), shape, dtype),
        Region(module, param, offset, region_shape, stride, region_dtype or dtype),
    )


def _land_by_replay(plan, sources, table):
    out = {
        d.name: torch.zeros(d.numel, dtype=t.dtype)
        for d, t in zip(table.dests, empty_dests(table), strict=True)
    }
    for copy in plan.copies:
        r = copy.region
        dest = out[r.qualname]
        dest.as_strided(r.shape, r.stride, r.offset).copy_(
            replay_slice(sources[copy.slice.source], copy.slice)
        )
    return out


def _land_by_table(plan, sources, table, method="loop"):
    dests = [torch.zeros_like(t) for t in empty_dests(table)]
    execute(table, [sources[s.name] for s in table.sources], dests, method=method)
    by_name = {d.name: t for d, t in zip(table.dests, dests, strict=True)}
    land_fallback(plan, table, sources, by_name)
    return by_name


def test_column_slices_are_rows_and_adjacent_runs_merge():
    # A TP=2 rank's o_proj (columns 4..8 of an 8x8) and q/k stacked into one
    # fused weight: rows of the column slice, one merged run for q then k.
    sources = {
        "o": torch.randn(8, 8),
        "q": torch.randn(4, 8),
        "k": torch.randn(2, 8),
    }
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy(
                "o", [ViewOp("narrow", (1, 4, 4))], (8, 4), (8, 4), (4, 1), module="o"
            ),
            _copy("q", [], (4, 8), (4, 8), (8, 1), module="qk"),
            _copy("k", [], (2, 8), (2, 8), (8, 1), offset=32, module="qk"),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    assert table.entries == 3  # q and k are different sources: not merged
    o = table.dst == [d.name for d in table.dests].index("o.w")
    assert table.rows[o].tolist() == [8]
    assert table.nbytes[o].tolist() == [16]
    assert table.src_pitch[o].tolist() == [32]
    assert table.dst_pitch[o].tolist() == [16]
    got = _land_by_table(plan, sources, table)
    want = _land_by_replay(plan, sources, table)
    for name in want:
        assert torch.equal(got[name], want[name]), name

    # Two halves of one source landing back to back merge into one run.
    halves = build_plan(
        worker="t",
        names=["q"],
        copies=[
            _copy("q", [ViewOp("narrow", (0, 0, 2))], (2, 8), (2, 8), (8, 1)),
            _copy(
                "q", [ViewOp("narrow", (0, 2, 2))], (2, 8), (2, 8), (8, 1), offset=16
            ),
        ],
    )
    merged = compile_copy_table(halves, _source_metas(sources))
    assert (merged.entries, merged.runs, merged.total_bytes) == (1, 1, 128)


def test_cast_and_copying_chain_fall_back_by_name():
    sources = {
        "half": torch.randn(3, 4).half(),
        "sq": torch.randn(4, 4),
        "ok": torch.randn(5),
    }
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy(
                "half",
                [],
                (3, 4),
                (3, 4),
                (4, 1),
                dtype="float16",
                region_dtype="float32",
                module="cast",
            ),
            # t() then a flattening reshape has to copy: not a view.
            _copy(
                "sq",
                [ViewOp("t"), ViewOp("reshape", ((16,),))],
                (16,),
                (16,),
                (1,),
                module="flat",
            ),
            _copy("ok", [ViewOp("contiguous")], (5,), (5,), (1,), module="plain"),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    assert [(f.index, f.source, f.region) for f in table.fallback] == [
        (0, "half", "cast.w"),
        (1, "sq", "flat.w"),
    ]
    assert "cast float16 -> float32" in table.fallback[0].describe()
    assert "not a strided view" in table.fallback[1].reason
    assert [s.name for s in table.sources] == ["ok"]
    got = _land_by_table(plan, sources, table)
    want = _land_by_replay(plan, sources, table)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_overlapping_destinations_fall_back_and_keep_plan_order():
    sources = {"a": torch.randn(4), "b": torch.randn(4), "c": torch.randn(2)}
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy("a", [], (4,), (4,), (1,), module="x"),
            _copy("b", [], (4,), (4,), (1,), offset=2, module="x"),  # overlaps a
            _copy("c", [], (2,), (2,), (1,), module="y"),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    assert [f.index for f in table.fallback] == [0, 1]
    assert [s.name for s in table.sources] == ["c"]
    got = _land_by_table(plan, sources, table)
    assert torch.equal(got["x.w"][2:], sources["b"])  # the later copy won
    assert torch.equal(got["x.w"][:2], sources["a"][:2])

    # Interleaved but disjoint strided regions (even and odd columns) stay.
    sources = {"e": torch.randn(3, 2), "o": torch.randn(3, 2)}
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy("e", [], (3, 2), (3, 2), (4, 2)),
            _copy("o", [], (3, 2), (3, 2), (4, 2), offset=1),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    assert table.fallback == ()
    got = _land_by_table(plan, sources, table)
    want = _land_by_replay(plan, sources, table)
    assert torch.equal(got["m.w"], want["m.w"])


def _random_case(rng: random.Random):
    """A source, a chain of allowlisted view ops, and a destination region in
    a randomly permuted layout."""
    shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
    t = torch.empty(shape, device="meta")
    chain = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["narrow", "t", "getitem", "unsqueeze", "unbind"])
        if kind == "narrow" and t.dim():
            d = rng.randrange(t.dim())
            if t.shape[d] == 0:
                continue
            start = rng.randrange(t.shape[d])
            op = ViewOp("narrow", (d, start, rng.randint(1, t.shape[d] - start)))
        elif kind == "t" and t.dim() == 2:
            op = ViewOp("t")
        elif kind == "getitem" and t.dim():
            step = rng.randint(1, 2)
            op = ViewOp("__getitem__", ((Ellipsis, Span(None, None, step)),))
        elif kind == "unsqueeze":
            op = ViewOp("unsqueeze", (0,))
        elif kind == "unbind" and t.dim() > 1 and t.shape[0] > 0:
            op = ViewOp("unbind", (0,), pick=rng.randrange(t.shape[0]))
        else:
            continue
        chain.append(op)
        t = op.apply(t)
    out_shape = tuple(t.shape)
    order = list(range(len(out_shape)))
    rng.shuffle(order)
    stride = [0] * len(out_shape)
    acc = 1
    for d in reversed(order):
        stride[d] = acc
        acc *= out_shape[d]
    offset = rng.randint(0, 3)
    return tuple(shape), chain, out_shape, tuple(stride), offset


def _random_plan(rng: random.Random, most: int, row_major: bool = False):
    """A plan of 1 to ``most`` random view chains (``_random_case``) landing
    one after another, with gaps, in one destination ``d.w``, and its
    sources. ``row_major``: each region laid out row-major instead of in
    the case's permuted layout."""
    copies, sources = [], {}
    offset = 0
    for k in range(rng.randint(1, most)):
        shape, chain, out_shape, stride, gap = _random_case(rng)
        name = f"s{k}"
        sources[name] = torch.randn(shape)
        if row_major:
            stride = [int(np.prod(out_shape[i + 1 :])) for i in range(len(out_shape))]
        copies.append(
            _copy(name, chain, out_shape, out_shape, stride, offset + gap, module="d")
        )
        offset += gap + int(np.prod(out_shape))
    return build_plan(worker="t", names=list(sources), copies=copies), sources


def test_random_view_chains_land_like_replay():
    rng = random.Random(0)
    for case in range(200):
        plan, sources = _random_plan(rng, 3)
        table = compile_copy_table(plan, _source_metas(sources))
        assert table.fallback == (), case
        for method in ("loop", "foreach"):
            got = _land_by_table(plan, sources, table, method)
            want = _land_by_replay(plan, sources, table)
            for name in want:
                assert torch.equal(got[name], want[name]), (case, method)
        flat = table.flat_runs()
        assert int(flat["nbytes"].sum()) == plan.nbytes


STRIDED = "region's innermost dimension is strided"


def _packed_chunk(plan, sources, pad=8):
    """The plan's slices replayed and packed one after another into one byte
    buffer, each at a multiple of ``pad`` bytes (as a producer packs a
    chunk); with the (offset, copy) pairs ``compile_chunk_table`` takes."""
    landings, pieces, offset = [], [], 0
    for copy in plan.copies:
        value = replay_slice(sources[copy.slice.source], copy.slice)
        raw = torch.empty(value.numel(), dtype=value.dtype)
        raw.copy_(value.reshape(-1))
        raw = raw.view(torch.uint8)
        offset = -(-offset // pad) * pad
        landings.append((offset, copy))
        pieces.append((offset, raw))
        offset += raw.numel()
    chunk = torch.zeros(offset, dtype=torch.uint8)
    for at, raw in pieces:
        chunk[at : at + raw.numel()] = raw
    return chunk, landings


def _land_chunk_by_table(table, chunk, landings, method, dtype=torch.float32):
    dests = [torch.zeros(d.numel, dtype=dtype) for d in table.dests]
    if table.entries:
        CopyProgram(table, [chunk], dests, method=method)()
    by_name = {d.name: t for d, t in zip(table.dests, dests, strict=True)}
    for fb in table.fallback:
        offset, copy = landings[fb.index]
        spec, r = copy.slice, copy.region
        value = chunk[offset : offset + spec.nbytes]
        value = value.view(dtype_from_name(spec.dtype)).view(spec.shape)
        by_name[r.qualname].as_strided(r.shape, r.stride, r.offset).copy_(value)
    return by_name


def test_chunk_tables_land_packed_slices_like_replay():
    """A chunk's table reads each slice from its packed bytes and writes its
    region: random view chains, several slices per chunk, every method."""
    rng = random.Random(1)
    batched = 0
    for case in range(100):
        plan, sources = _random_plan(rng, 4)
        chunk, landings = _packed_chunk(plan, sources, pad=rng.choice([4, 16]))
        table = compile_chunk_table(landings, chunk.numel())
        assert [s.name for s in table.sources] == [CHUNK_SOURCE] * bool(table.copies)
        # Permuted regions whose innermost dim is strided are copied one by one.
        assert {f.reason for f in table.fallback} <= {STRIDED}, case
        left = sum(plan.copies[f.index].slice.nbytes for f in table.fallback)
        assert table.total_bytes + left == plan.nbytes
        batched += table.copies
        want = _land_by_replay(
            plan, sources, compile_copy_table(plan, _source_metas(sources))
        )
        for method in ("loop", "foreach"):
            got = _land_chunk_by_table(table, chunk, landings, method)
            for name in want:
                assert torch.equal(got[name], want[name]), (case, method)
    assert batched > 100


def test_chunk_table_leaves_casts_transposes_and_misaligned_slices_out():
    sources = {
        "h": torch.randn(3, 4).half(),
        "t": torch.randn(4, 6),
        "ok": torch.randn(6),
    }
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy(
                "h",
                [],
                (3, 4),
                (3, 4),
                (4, 1),
                dtype="float16",
                region_dtype="float32",
                module="cast",
            ),
            # A transposed region: column-major writes, one element per run.
            _copy("t", [], (4, 6), (4, 6), (1, 4), module="tr"),
            _copy("ok", [], (6,), (6,), (1,), module="plain"),
        ],
    )
    chunk, landings = _packed_chunk(plan, sources, pad=4)
    table = compile_chunk_table(landings, chunk.numel())
    assert [(f.index, f.reason) for f in table.fallback] == [
        (0, "cast float16 -> float32"),
        (1, STRIDED),
    ]
    assert table.entries == 1 and table.copies == 1
    got = _land_chunk_by_table(table, chunk, landings, "loop")
    want = _land_by_replay(
        plan, sources, compile_copy_table(plan, _source_metas(sources))
    )
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # A float32 slice 2 bytes into the chunk cannot be read as words there.
    shifted = [(2, landings[2][1])]
    table = compile_chunk_table(shifted, chunk.numel())
    assert table.entries == 0 and "not 4-aligned" in table.fallback[0].reason
    with pytest.raises(ValueError, match="ends past the chunk"):
        compile_chunk_table([(chunk.numel() - 4, landings[2][1])], chunk.numel())


def test_tasks_cover_every_byte_once():
    sources = {"big": torch.randn(64, 16), "o": torch.randn(8, 8)}
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy("big", [], (64, 16), (64, 16), (16, 1), module="a"),
            _copy(
                "o", [ViewOp("narrow", (1, 4, 4))], (8, 4), (8, 4), (4, 1), module="b"
            ),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    src_addr, dst_addr = [0, 1 << 20], [2 << 20, 3 << 20]
    for task_bytes in (8, 48, 256, 1 << 20):
        tasks = build_tasks(table, src_addr, dst_addr, 0, 4, task_bytes)
        covered = set()
        for s, d, width, rows, sp, dp in tasks.tolist():
            assert width * 4 <= max(task_bytes, 16) or rows == 1
            for r in range(rows):
                for c in range(width):
                    covered.add((s + r * sp + c, d + r * dp + c))
        flat = table.flat_runs()
        want = set()
        for si, so, di, do, nb in zip(
            *(
                flat[k].tolist()
                for k in ("src", "src_offset", "dst", "dst_offset", "nbytes")
            ),
            strict=True,
        ):
            for c in range(0, nb, 4):
                want.add(((src_addr[si] + so + c) // 4, (dst_addr[di] + do + c) // 4))
        assert covered == want, task_bytes


def test_program_checks_its_tensors():
    plan = bake_worker_plan(Toy(0), _metas(CHECKPOINT), worker="tp0/2")
    table = compile_copy_table(plan, _source_metas(CHECKPOINT))
    sources = [CHECKPOINT[s.name] for s in table.sources]
    dests = empty_dests(table)
    with pytest.raises(ValueError, match="is float64"):
        CopyProgram(table, [s.double() for s in sources], dests)
    with pytest.raises(ValueError, match="bytes from its first element"):
        CopyProgram(table, sources, [d[1:] for d in dests])
    with pytest.raises(ValueError, match="needs CUDA"):
        CopyProgram(table, sources, dests, method="triton")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("rank", [0, 1])
def test_triton_kernel_in_the_interpreter(rank, monkeypatch):
    """The CUDA executor's kernel, run by Triton's CPU interpreter: the toy
    (4-byte element runs at rank 1) and 16-byte aligned row slices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = bake_worker_plan(Toy(rank), _metas(CHECKPOINT), worker=f"tp{rank}/2")
    expected = Toy(rank)
    land_chunks(expected, plan, CHECKPOINT, IN_PLACE)
    table = compile_copy_table(plan, _source_metas(CHECKPOINT))
    model = Toy(rank)
    tensors = _model_tensors(model)
    program = CopyProgram(
        table,
        [CHECKPOINT[s.name] for s in table.sources],
        [tensors[d.name] for d in table.dests],
        method="triton",
        task_bytes=16,
    )
    program()
    reference = _model_tensors(expected)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name]), name

    sources = {"o": torch.randn(16, 24).bfloat16(), "n": torch.randn(8).bfloat16()}
    plan = build_plan(
        worker="t",
        names=list(sources),
        copies=[
            _copy(
                "o",
                [ViewOp("narrow", (1, 8, 16))],
                (16, 16),
                (16, 16),
                (16, 1),
                dtype="bfloat16",
                module="o",
            ),
            _copy("n", [], (8,), (8,), (1,), dtype="bfloat16", module="n"),
        ],
    )
    table = compile_copy_table(plan, _source_metas(sources))
    for task_bytes in (16, 64, 1 << 20):
        dests = [torch.zeros_like(t) for t in empty_dests(table)]
        program = CopyProgram(
            table,
            [sources[s.name] for s in table.sources],
            dests,
            method="triton",
            task_bytes=task_bytes,
        )
        assert (program.word, program.vec) == (8, 2)
        program()
        want = _land_by_replay(plan, sources, table)
        for spec, got in zip(table.dests, dests, strict=True):
            assert torch.equal(got.view(torch.int16), want[spec.name].view(torch.int16))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_released_program_runs_from_another_chunk_buffer(monkeypatch):
    """The kernel in Triton's CPU interpreter: a chunk table bound to one
    buffer, released from it, and run from other buffers holding other
    values (only the source offsets shift); a buffer that breaks the
    table's alignment is not taken."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(2)
    for case in range(10):
        plan, sources = _random_plan(rng, 3, row_major=True)
        chunk, landings = _packed_chunk(plan, sources, pad=16)
        table = compile_chunk_table(landings, chunk.numel())
        dests = [torch.zeros(d.numel, dtype=torch.float32) for d in table.dests]
        bound_at = chunk.clone()
        program = CopyProgram(table, [bound_at], dests, method="triton")
        origin = bound_at.data_ptr()
        assert program.can_shift(0)
        program.release_sources()
        with pytest.raises(RuntimeError, match="released its sources"):
            program()
        for scale in (2.0, -3.0):
            scaled = {n: t * scale for n, t in sources.items()}
            other, _ = _packed_chunk(plan, scaled, pad=16)
            spare = torch.zeros(other.numel() + 64, dtype=torch.uint8)
            moved = spare[16 : 16 + other.numel()]
            moved.copy_(other)
            assert program.can_shift(moved.data_ptr() - origin)
            program.run_shifted(moved.data_ptr() - origin)
            want = _land_by_replay(
                plan, scaled, compile_copy_table(plan, _source_metas(sources))
            )
            got = {d.name: t for d, t in zip(table.dests, dests, strict=True)}
            for name in want:
                assert torch.equal(got[name], want[name]), (case, scale)
        if program.word * program.vec > 1:
            misaligned = spare[1 : 1 + other.numel()]
            assert not program.can_shift(misaligned.data_ptr() - origin)
            with pytest.raises(ValueError, match="multiple of"):
                program.run_shifted(misaligned.data_ptr() - origin)
