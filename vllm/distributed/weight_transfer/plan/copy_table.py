# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sharded_rdt plan compiled into byte runs: the one-copy data plane's table.

A `WorkerPlan` says which slice of which trainer tensor lands in which region of
which worker tensor. When every slice is a strided view of its source and the
region has the slice's dtype, landing the plan is a pure byte move: each byte the
worker keeps is read once from the trainer's tensor and written once into its
place. `compile_copy_table` turns the plan into that move, written as plain
integer arrays:

    entry i: rows[i] rows of nbytes[i] contiguous bytes each;
             row r reads  sources[src[i]] at byte src_offset[i] + r * src_pitch[i]
             and writes   dests[dst[i]]   at byte dst_offset[i] + r * dst_pitch[i]

One entry is one "2D run"; ``rows == 1`` is a plain contiguous run. A slice with
contiguous rows (a column slice of a TP-sharded matrix, say) is one entry with
one row per matrix row, so a plan of tens of thousands of copies stays a table of
tens of thousands of entries even when it has millions of rows. Runs that
continue each other (same tensors, adjacent bytes on both sides) are merged.

What is not a byte move is not guessed at. A copy goes to ``fallback``, by
position in ``plan.copies`` and by name, when

* its op chain is not a strided view of the source (an op that had to copy,
  such as a ``reshape`` of a non-viewable layout);
* its slice's dtype differs from its region's (the loader's ``copy_`` casts);
* its slice and region shapes differ other than by size-1 dimensions;
* its destination bytes overlap another copy's in the same tensor (the plan's
  order decides who wins there; a batched copy has no order). Then every copy
  into that tensor falls back, so table and fallback never write the same
  bytes and can run in either order.

``contiguous`` in a chain keeps the logical element order, so it is skipped.

The table knows source tensors by checkpoint name (geometry from the caller's
metadata: the plan records slice shapes, not source shapes) and destination
tensors by region qualname, sized to cover every region that lands in them.
Sources are taken to be contiguous in their recorded shape.

`compile_chunk_table` compiles the copies of one pulled ``sharded_rdt`` chunk
the same way, with the chunk as the table's one source: each slice is already
cut and packed contiguously in the chunk, at a known byte offset, so no chain
is replayed.

Executing a table on real tensors is `copy_table_exec`'s job; this module does
no I/O and touches no tensor data (chains are replayed on meta tensors).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.plan.ops import (
    ShapedTensor,
    SliceSpec,
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    WorkerPlan,
)


@dataclass(frozen=True)
class TensorSpec(ShapedTensor):
    """A tensor the table reads or writes. For a source, ``shape`` is its
    checkpoint shape; for a destination, ``(numel,)`` with the fewest elements
    that hold every region written into it."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class FallbackCopy:
    """A copy of the plan the table leaves to the ordinary path."""

    index: int  # position in plan.copies
    source: str
    region: str
    reason: str

    def describe(self) -> str:
        return f"copy {self.index}: {self.source!r} -> {self.region}: {self.reason}"


_FIELDS = (
    "src",
    "src_offset",
    "dst",
    "dst_offset",
    "nbytes",
    "rows",
    "src_pitch",
    "dst_pitch",
)


@dataclass(frozen=True, eq=False)
class CopyTable:
    """See the module docstring. Every array has one element per entry; offsets,
    sizes and pitches are in bytes."""

    sources: tuple[TensorSpec, ...]
    dests: tuple[TensorSpec, ...]
    src: np.ndarray
    src_offset: np.ndarray
    dst: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    rows: np.ndarray
    src_pitch: np.ndarray
    dst_pitch: np.ndarray
    fallback: tuple[FallbackCopy, ...] = ()
    copies: int = 0  # plan copies the table carries

    @property
    def entries(self) -> int:
        return int(self.src.shape[0])

    @property
    def runs(self) -> int:
        """Contiguous byte runs (rows summed over entries)."""
        return int(self.rows.sum())

    @property
    def total_bytes(self) -> int:
        return int((self.nbytes * self.rows).sum())

    def alignment(self) -> int:
        """Largest power of two (at most 16) dividing every offset, size and
        pitch of the table: the widest word an executor may move."""
        if self.entries == 0:
            return 16
        acc = np.bitwise_or.reduce(
            np.concatenate(
                [
                    self.src_offset,
                    self.dst_offset,
                    self.nbytes,
                    self.src_pitch,
                    self.dst_pitch,
                    np.array([16], dtype=np.int64),
                ]
            )
        )
        return int(acc & -acc)

    def flat_runs(self) -> dict[str, np.ndarray]:
        """Every row as a run of its own: arrays ``src``, ``src_offset``,
        ``dst``, ``dst_offset``, ``nbytes``. Sized by `runs`; for tests and
        small tables."""
        rows = self.rows
        entry = np.repeat(np.arange(self.entries), rows)
        starts = np.cumsum(rows) - rows
        r = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(starts, rows)
        return {
            "src": self.src[entry],
            "src_offset": self.src_offset[entry] + r * self.src_pitch[entry],
            "dst": self.dst[entry],
            "dst_offset": self.dst_offset[entry] + r * self.dst_pitch[entry],
            "nbytes": self.nbytes[entry],
        }

    def summary(self) -> dict[str, Any]:
        return {
            "copies": self.copies,
            "entries": self.entries,
            "runs": self.runs,
            "bytes": self.total_bytes,
            "sources": len(self.sources),
            "dests": len(self.dests),
            "alignment": self.alignment(),
            "fallback": len(self.fallback),
        }


class _NotAView(Exception):
    pass


def _strided_geometry(
    shape: tuple[int, ...], dtype: torch.dtype, spec: SliceSpec
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(element offset, shape, stride) of ``spec``'s slice inside a contiguous
    source of ``shape``: the chain replayed on a meta tensor, refusing any op
    whose result is not a view of the source."""
    root = torch.empty(shape, dtype=dtype, device="meta")
    out = root
    for op in spec.chain:
        if op.name == "contiguous":
            continue  # same elements in the same logical order
        out = op.apply(out)
        if out is not root and out._base is not root:
            raise _NotAView(f"{op} is not a view of the source here")
    if tuple(out.shape) != spec.shape:
        raise ValueError(
            f"replaying {spec.describe()} on {tuple(shape)} gives shape "
            f"{tuple(out.shape)}, but the plan expects {spec.shape}; the source "
            "metadata does not match the one the plan was baked from"
        )
    return int(out.storage_offset()), tuple(out.shape), tuple(out.stride())


def _runs_of(
    src_offset: int,
    src_stride: Sequence[int],
    dst_offset: int,
    dst_stride: Sequence[int],
    shape: Sequence[int],
    itemsize: int,
) -> list[tuple[int, int, int, int, int, int]]:
    """2D runs (src_off, dst_off, nbytes, rows, src_pitch, dst_pitch), all in
    bytes, moving a strided source onto a strided destination of one logical
    shape, in row-major order. Size-1 dims are dropped first."""
    dims = [
        (n, a, b)
        for n, a, b in zip(shape, src_stride, dst_stride, strict=True)
        if n != 1
    ]
    if any(n == 0 for n, _, _ in dims):
        return []
    # Merge a dim into the one before it where both sides continue contiguously.
    merged: list[list[int]] = []
    for n, a, b in dims:
        if merged:
            pn, pa, pb = merged[-1]
            if pa == n * a and pb == n * b:
                merged[-1] = [pn * n, a, b]
                continue
        merged.append([n, a, b])
    if merged and merged[-1][1] == 1 and merged[-1][2] == 1:
        inner = merged.pop()[0]
    else:
        inner = 1  # no contiguous row: every element is its own run
    row = inner * itemsize
    if not merged:
        return [(src_offset * itemsize, dst_offset * itemsize, row, 1, row, row)]
    n_rows, a_row, b_row = merged[-1]
    outer = merged[:-1]
    a_base = np.zeros(1, dtype=np.int64) + src_offset
    b_base = np.zeros(1, dtype=np.int64) + dst_offset
    for n, a, b in outer:
        step = np.arange(n, dtype=np.int64)
        a_base = (a_base[:, None] + step[None, :] * a).reshape(-1)
        b_base = (b_base[:, None] + step[None, :] * b).reshape(-1)
    return [
        (
            int(sa) * itemsize,
            int(sb) * itemsize,
            row,
            n_rows,
            a_row * itemsize,
            b_row * itemsize,
        )
        for sa, sb in zip(a_base.tolist(), b_base.tolist(), strict=True)
    ]


def _squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _region_bounds(region: Region, itemsize: int) -> tuple[int, int]:
    """[first byte, end byte) the region spans in its tensor."""
    if region.numel == 0:
        return region.offset * itemsize, region.offset * itemsize
    lo = region.offset + sum(
        (n - 1) * s for n, s in zip(region.shape, region.stride, strict=True) if s < 0
    )
    return lo * itemsize, (region.last_element + 1) * itemsize


def _overlapping(intervals: list[tuple[int, int, int, int, int, int]]) -> bool:
    """Whether any two rows of these (dst_off, nbytes, rows, dst_pitch, ...)
    byte runs share a byte."""
    starts, ends = [], []
    for off, nbytes, rows, pitch, _, _ in intervals:
        r = np.arange(rows, dtype=np.int64) * pitch + off
        starts.append(r)
        ends.append(r + nbytes)
    s = np.concatenate(starts)
    e = np.concatenate(ends)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    return bool(np.any(s[1:] < e[:-1]))


# A contiguous or 2D byte run: (source offset, destination offset, bytes per
# row, rows, source pitch, destination pitch), all in bytes.
_Run = tuple[int, int, int, int, int, int]


@dataclass
class _Planned:
    """One plan copy that stays in the table, as byte runs."""

    copy_index: int
    source: str
    dest: int
    runs: list[_Run]


@dataclass
class _Destinations:
    """The tensors the plan writes, in first-write order: dtype, the bytes up
    to the highest region, and each region's byte bounding box (for the
    overlap check)."""

    index: dict[str, int]
    dtypes: list[str]
    ends: list[int]
    boxes: dict[int, list[tuple[int, int, int]]]  # dest -> (lo, hi, copy)

    def add(self, copy_index: int, region: Region) -> int:
        di = self.index.get(region.qualname)
        if di is None:
            di = self.index[region.qualname] = len(self.dtypes)
            self.dtypes.append(region.dtype)
            self.ends.append(0)
        elif self.dtypes[di] != region.dtype:
            raise ValueError(
                f"{region.qualname} is written as {self.dtypes[di]} and as "
                f"{region.dtype} by the same plan"
            )
        itemsize = dtype_from_name(region.dtype).itemsize
        self.ends[di] = max(self.ends[di], (region.last_element + 1) * itemsize)
        lo, hi = _region_bounds(region, itemsize)
        if hi > lo:
            self.boxes.setdefault(di, []).append((lo, hi, copy_index))
        return di

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(
                qualname,
                (self.ends[di] // dtype_from_name(self.dtypes[di]).itemsize,),
                self.dtypes[di],
            )
            for qualname, di in self.index.items()
        )


def _source_spec(
    name: str,
    source_metas: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    sliced_as: str,
) -> TensorSpec:
    meta = source_metas.get(name)
    if meta is None:
        raise KeyError(
            f"no metadata for source {name!r}; source_metas must name every "
            "checkpoint tensor the plan reads"
        )
    shape = tuple(int(s) for s in meta[0])
    # Normalized through torch, so an alias ("half") names its dtype.
    dtype = dtype_name(dtype_from_name(dtype_name(meta[1])))
    if dtype != sliced_as:
        raise ValueError(
            f"source {name!r} is {dtype} but the plan slices it as {sliced_as}"
        )
    return TensorSpec(name, shape, dtype)


def _copy_runs(
    spec: SliceSpec,
    region: Region,
    source: TensorSpec,
    geometry_cache: dict[Any, tuple[int, tuple[int, ...], tuple[int, ...]] | str],
) -> list[_Run] | str:
    """The byte runs of one copy whose slice dtype and shape match its region,
    or why it cannot be a byte copy."""
    key = (source.shape, spec.dtype, spec.chain, spec.shape)
    geometry = geometry_cache.get(key)
    if geometry is None:
        try:
            geometry = _strided_geometry(
                source.shape, dtype_from_name(source.dtype), spec
            )
        except _NotAView as e:
            geometry = f"op chain is not a strided view: {e}"
        geometry_cache[key] = geometry
    if isinstance(geometry, str):
        return geometry
    s_off, s_shape, s_stride = geometry
    # Pair the dims of both sides after dropping size-1 dims.
    s_dims = [(n, a) for n, a in zip(s_shape, s_stride, strict=True) if n != 1]
    d_strides = [b for n, b in zip(region.shape, region.stride, strict=True) if n != 1]
    return _runs_of(
        s_off,
        [a for _, a in s_dims],
        region.offset,
        d_strides,
        [n for n, _ in s_dims],
        dtype_from_name(region.dtype).itemsize,
    )


def _overlapping_dests(
    dests: _Destinations, planned: list[_Planned], fallback: set[int]
) -> set[int]:
    """Destinations where two copies write the same bytes: bounding boxes
    first, exact rows only where boxes meet. Copies that fell back still write
    their bytes, so their boxes count."""
    overlapped: set[int] = set()
    for di, boxes in dests.boxes.items():
        boxes.sort()
        if all(boxes[k + 1][0] >= boxes[k][1] for k in range(len(boxes) - 1)):
            continue
        rows = [
            (off_d, nb, nr, pd, 0, 0)
            for p in planned
            if p.dest == di
            for (_, off_d, nb, nr, _, pd) in p.runs
        ]
        rows += [(lo, hi - lo, 1, 0, 0, 0) for lo, hi, ci in boxes if ci in fallback]
        if _overlapping(rows):
            overlapped.add(di)
    return overlapped


def _merged_columns(
    planned: list[_Planned], src_index: Mapping[str, int]
) -> list[list[int]]:
    """The table's columns (`_FIELDS` order), merging a run into the previous
    entry when it continues it: one contiguous run after another on both
    sides, or further rows of the same 2D run."""
    columns: list[list[int]] = [[] for _ in _FIELDS]
    for p in planned:
        si, di = src_index[p.source], p.dest
        for s_off_b, d_off_b, nbytes, n_rows, s_pitch, d_pitch in p.runs:
            if columns[0]:
                last = len(columns[0]) - 1
                p_src, p_soff, p_dst, p_doff, p_nb, p_rows, p_sp, p_dp = (
                    c[last] for c in columns
                )
                if p_src == si and p_dst == di:
                    if (
                        p_rows == 1
                        and n_rows == 1
                        and p_soff + p_nb == s_off_b
                        and p_doff + p_nb == d_off_b
                    ):
                        columns[4][last] = p_nb + nbytes
                        columns[6][last] = columns[7][last] = p_nb + nbytes
                        continue
                    if (
                        p_nb == nbytes
                        and p_sp == s_pitch
                        and p_dp == d_pitch
                        and p_soff + p_rows * p_sp == s_off_b
                        and p_doff + p_rows * p_dp == d_off_b
                    ):
                        columns[5][last] = p_rows + n_rows
                        continue
            for col, value in zip(
                columns,
                (si, s_off_b, di, d_off_b, nbytes, n_rows, s_pitch, d_pitch),
                strict=True,
            ):
                col.append(value)
    return columns


def compile_copy_table(
    plan: WorkerPlan,
    source_metas: Mapping[str, tuple[Sequence[int], torch.dtype | str]],
    *,
    only_sources: Collection[str] | None = None,
) -> CopyTable:
    """Compile ``plan`` into a `CopyTable`.

    ``source_metas`` maps each checkpoint name the plan reads to its (shape,
    dtype), e.g. from the trainer's ``ParamMeta`` list. Sources appear in the
    table in first-use order, destinations in first-write order.
    ``only_sources`` keeps just the copies that read those names (one chunk of
    an update, say); fallback indices still count positions in
    ``plan.copies``.
    """
    copies = plan.copies
    if only_sources is not None:
        wanted = set(only_sources)
        kept = [i for i, c in enumerate(copies) if c.slice.source in wanted]
    else:
        kept = list(range(len(copies)))
    dests = _Destinations({}, [], [], {})
    geometry_cache: dict[Any, tuple[int, tuple[int, ...], tuple[int, ...]] | str] = {}
    source_specs: dict[str, TensorSpec] = {}
    fallback: dict[int, FallbackCopy] = {}
    planned: list[_Planned] = []

    for ci in kept:
        copy = copies[ci]
        spec, region = copy.slice, copy.region
        di = dests.add(ci, region)
        if spec.dtype != region.dtype:
            reason: str | None = f"cast {spec.dtype} -> {region.dtype}"
        elif _squeezed(spec.shape) != _squeezed(region.shape):
            reason = f"slice shape {spec.shape} lands in region shape {region.shape}"
        else:
            source = _source_spec(spec.source, source_metas, spec.dtype)
            runs = _copy_runs(spec, region, source, geometry_cache)
            if isinstance(runs, str):
                reason = runs
            else:
                reason = None
                source_specs[spec.source] = source
                planned.append(_Planned(ci, spec.source, di, runs))
        if reason is not None:
            fallback[ci] = FallbackCopy(ci, spec.source, region.qualname, reason)

    return _assemble(
        {ci: copies[ci] for ci in kept}, dests, planned, fallback, source_specs
    )


def _assemble(
    copies: Mapping[int, SliceCopy],
    dests: _Destinations,
    planned: list[_Planned],
    fallback: dict[int, FallbackCopy],
    source_specs: Mapping[str, TensorSpec],
) -> CopyTable:
    """The table of the ``planned`` copies, after moving to ``fallback`` every
    copy into a destination where two copies write the same bytes (a batched
    copy has no order; those land the ordinary way, in plan order).
    ``copies`` are all the copies compiled, by fallback index."""
    overlapped = _overlapping_dests(dests, planned, set(fallback))
    if overlapped:
        for ci, copy in copies.items():
            if dests.index[copy.region.qualname] in overlapped and ci not in fallback:
                fallback[ci] = FallbackCopy(
                    ci,
                    copy.slice.source,
                    copy.region.qualname,
                    "destination bytes overlap another copy into the same tensor",
                )
        planned = [p for p in planned if p.copy_index not in fallback]

    src_index: dict[str, int] = {}
    for p in planned:
        src_index.setdefault(p.source, len(src_index))
    columns = _merged_columns(planned, src_index)
    arrays = {
        name: np.asarray(col, dtype=np.int32 if name in ("src", "dst") else np.int64)
        for name, col in zip(_FIELDS, columns, strict=True)
    }
    return CopyTable(
        sources=tuple(source_specs[name] for name in src_index),
        dests=dests.specs(),
        fallback=tuple(fallback[ci] for ci in sorted(fallback)),
        copies=len(planned),
        **arrays,
    )


CHUNK_SOURCE = "chunk"
"""The one source of a `compile_chunk_table` table: the chunk's bytes."""


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def compile_chunk_table(
    landings: Sequence[tuple[int, SliceCopy]], chunk_nbytes: int
) -> CopyTable:
    """Compile the copies of one pulled ``sharded_rdt`` chunk into a `CopyTable`
    whose one source is the chunk itself (``CHUNK_SOURCE``, ``chunk_nbytes``
    bytes of uint8): ``landings`` pairs each copy with the byte offset where
    its slice sits in the chunk, already cut and packed contiguously in the
    slice's shape (the producer's packing). Fallback indices count positions
    in ``landings``.

    Besides the reasons `compile_copy_table` gives (a cast, shapes that differ
    other than by size-1 dims, overlapping destinations), a copy falls back
    when its slice does not start on a multiple of its dtype's size in the
    chunk, or when its region's innermost dimension is strided (a transposed
    view): the table would hold one run per element there, and ``copy_``
    moves such a view faster."""
    dests = _Destinations({}, [], [], {})
    source = TensorSpec(CHUNK_SOURCE, (chunk_nbytes,), "uint8")
    fallback: dict[int, FallbackCopy] = {}
    planned: list[_Planned] = []
    for i, (offset, copy) in enumerate(landings):
        spec, region = copy.slice, copy.region
        di = dests.add(i, region)
        itemsize = dtype_from_name(region.dtype).itemsize
        inner = [b for n, b in zip(region.shape, region.stride, strict=True) if n != 1]
        reason: str | None = None
        if spec.dtype != region.dtype:
            reason = f"cast {spec.dtype} -> {region.dtype}"
        elif _squeezed(spec.shape) != _squeezed(region.shape):
            reason = f"slice shape {spec.shape} lands in region shape {region.shape}"
        elif offset % itemsize:
            reason = f"slice at byte {offset} of the chunk is not {itemsize}-aligned"
        elif inner and inner[-1] != 1:
            reason = "region's innermost dimension is strided"
        elif offset + spec.nbytes > chunk_nbytes:
            raise ValueError(
                f"{spec.describe()} at byte {offset} ends past the chunk's "
                f"{chunk_nbytes} bytes"
            )
        if reason is not None:
            fallback[i] = FallbackCopy(i, spec.source, region.qualname, reason)
            continue
        shape = [n for n in spec.shape if n != 1]
        runs = _runs_of(
            offset // itemsize,
            _contiguous_strides(shape),
            region.offset,
            inner,
            shape,
            itemsize,
        )
        planned.append(_Planned(i, CHUNK_SOURCE, di, runs))
    return _assemble(
        {i: copy for i, (_, copy) in enumerate(landings)},
        dests,
        planned,
        fallback,
        {CHUNK_SOURCE: source},
    )
