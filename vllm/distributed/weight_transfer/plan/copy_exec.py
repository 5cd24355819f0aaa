# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Execute a `CopyTable` on real tensors: every byte copied once, source to
destination, with no staging buffer.

`CopyProgram` binds a table to its tensors once (checks dtypes and sizes,
resolves addresses, builds whatever the method needs on the device) and then
runs the whole table per call. Binding again is only needed when a tensor moves;
a one-copy sync maps the trainer's storages once and keeps them, so the bound
program is reused every sync. `execute` binds and runs in one go.

Methods:

``triton`` (CUDA; the default there when Triton imports)
    The table is cut into tasks of at most ``task_bytes`` (rows of an entry
    grouped, long rows split), and one kernel launch per row-width class copies
    all tasks of that class: each program reads its task (source and
    destination word offsets, row length, rows, pitches) and moves the rows in
    tiles with the widest integer word the table's alignment allows (8 bytes,
    with hints for 16-byte accesses when every offset, size, pitch and base
    address is a multiple of 16).
    Addresses are word offsets from one base allocation, so one kernel reads
    any number of separate tensors.
``foreach`` (any device)
    ``torch._foreach_copy_`` over one byte view per entry (2D strided views for
    entries with several rows).
``loop`` (any device; the default on CPU)
    One ``copy_`` per entry. On CUDA this is the slow baseline: the host issues
    one copy per entry.

Copies the compiler left to ``fallback`` are not part of the table;
`land_fallback` lands them the ordinary way (replayed slice, ``copy_`` into the
region), in plan order. Table and fallback never write the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.plan.copy_table import CopyTable, TensorSpec
from vllm.distributed.weight_transfer.plan.ops import (
    dtype_from_name,
    dtype_name,
    replay_slice,
)
from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan

METHODS = ("triton", "foreach", "loop")
# On an H200, 128 KiB tasks reached 92-99.7% of a flat device copy on the
# baked Qwen3 plans, 1-2 points above 512 KiB and 2 MiB
# (benchmarks/results/copy_table_h200.json).
DEFAULT_TASK_BYTES = 128 * 1024
_TILE_BYTES = 16 * 1024
_MIN_COLS_BYTES = 64
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _word_view(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """A flat tensor of ``word``-byte integers over ``tensor``'s storage, from
    its first element to the storage's end."""
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if start % word:
        raise ValueError(f"tensor does not start on a {word}-byte boundary")
    out = torch.empty(0, dtype=_WORD_DTYPES[word], device=tensor.device)
    out.set_(storage, start // word, ((storage.nbytes() - start) // word,), (1,))
    return out


def _common_alignment(table: CopyTable, tensors: Sequence[torch.Tensor]) -> int:
    """Widest power of two dividing the table's offsets, sizes and pitches and
    every tensor's start address."""
    align = table.alignment()
    for t in tensors:
        while t.data_ptr() % align:
            align //= 2
    return align


def _check(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], role: str
) -> None:
    if len(specs) != len(tensors):
        raise ValueError(
            f"the table has {len(specs)} {role} tensors but {len(tensors)} were given"
        )
    for spec, tensor in zip(specs, tensors, strict=True):
        if dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"{role} {spec.name} is {dtype_name(tensor.dtype)}, the table "
                f"expects {spec.dtype}"
            )
        if role == "source":
            if tuple(tensor.shape) != spec.shape or not tensor.is_contiguous():
                raise ValueError(
                    f"source {spec.name} must be contiguous with shape "
                    f"{spec.shape}; got shape {tuple(tensor.shape)}, stride "
                    f"{tensor.stride()}"
                )
        else:
            available = tensor.untyped_storage().nbytes() - (
                tensor.storage_offset() * tensor.element_size()
            )
            if available < spec.nbytes:
                raise ValueError(
                    f"destination {spec.name} has {available} bytes from its "
                    f"first element, the table writes up to byte {spec.nbytes}"
                )


def _entry_views(
    table: CopyTable,
    src_words: list[torch.Tensor],
    dst_words: list[torch.Tensor],
    word: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One view per entry on each side, in ``word``-byte integers: a slice for
    a contiguous run, a 2D strided view for an entry of several rows."""
    srcs, dsts = [], []
    columns = zip(
        table.src.tolist(),
        (table.src_offset // word).tolist(),
        table.dst.tolist(),
        (table.dst_offset // word).tolist(),
        (table.nbytes // word).tolist(),
        table.rows.tolist(),
        (table.src_pitch // word).tolist(),
        (table.dst_pitch // word).tolist(),
        strict=True,
    )
    for si, so, di, do, n, rows, sp, dp in columns:
        s, d = src_words[si], dst_words[di]
        if rows == 1:
            srcs.append(s[so : so + n])
            dsts.append(d[do : do + n])
        else:
            srcs.append(s.as_strided((rows, n), (sp, 1), s.storage_offset() + so))
            dsts.append(d.as_strided((rows, n), (dp, 1), d.storage_offset() + do))
    return srcs, dsts


_KERNELS: dict[bool, Any] = {}


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_kernel() -> Any:
    """The tile-copy kernel, defined on first use (per interpreter mode)."""
    kernel = _KERNELS.get(_interpreting())
    if kernel is not None:
        return kernel
    import triton
    import triton.language as tl

    # ``shift`` varies with the source's address: not specialized on, so a
    # new address never compiles the kernel again.
    @triton.jit(do_not_specialize=["shift"])
    def copy_tasks(
        base,
        tasks,
        shift,
        COLS: tl.constexpr,
        ROWS: tl.constexpr,
        VEC: tl.constexpr,
    ):
        # One task per program: 6 int64 words (source offset, destination
        # offset, words per row, rows, source pitch, destination pitch), all
        # counted in words from ``base``; ``shift`` words are added to every
        # source offset (a source read from another address than the one
        # the tasks were built for).
        task = tasks + tl.program_id(0).to(tl.int64) * 6
        src = tl.multiple_of(tl.load(task) + shift, VEC)
        dst = tl.multiple_of(tl.load(task + 1), VEC)
        width = tl.multiple_of(tl.load(task + 2), VEC)
        rows = tl.load(task + 3)
        src_pitch = tl.multiple_of(tl.load(task + 4), VEC)
        dst_pitch = tl.multiple_of(tl.load(task + 5), VEC)
        cols = tl.arange(0, COLS).to(tl.int64)
        tile_rows = tl.arange(0, ROWS).to(tl.int64)
        for r0 in range(0, rows, ROWS):
            r = r0 + tile_rows
            row_ok = r < rows
            src_row = src + r * src_pitch
            dst_row = dst + r * dst_pitch
            for c0 in range(0, width, COLS):
                c = c0 + cols
                mask = row_ok[:, None] & (c < width)[None, :]
                value = tl.load(base + (src_row[:, None] + c[None, :]), mask=mask)
                tl.store(base + (dst_row[:, None] + c[None, :]), value, mask=mask)

    _KERNELS[_interpreting()] = copy_tasks
    return copy_tasks


def _next_pow2(x: np.ndarray) -> np.ndarray:
    out = np.ones_like(x)
    while np.any(out < x):
        out = np.where(out < x, out * 2, out)
    return out


def build_tasks(
    table: CopyTable,
    src_addr: Sequence[int],
    dst_addr: Sequence[int],
    base_addr: int,
    word: int,
    task_bytes: int,
) -> np.ndarray:
    """The table cut into tasks: an ``(n, 6)`` int64 array of (source offset,
    destination offset, words per row, rows, source pitch, destination pitch)
    in ``word``-byte words from ``base_addr``. A task moves at most
    ``task_bytes`` (or one row segment of that size)."""
    seg = max(1, task_bytes // word)
    s = np.asarray(src_addr, dtype=np.int64)[table.src] + table.src_offset - base_addr
    d = np.asarray(dst_addr, dtype=np.int64)[table.dst] + table.dst_offset - base_addr
    if np.any(s % word) or np.any(d % word):
        raise ValueError(f"table addresses are not {word}-byte aligned")
    s, d = s // word, d // word
    width = table.nbytes // word
    rows = table.rows
    sp, dp = table.src_pitch // word, table.dst_pitch // word

    out = []
    narrow = width <= seg
    if np.any(narrow):
        # Whole rows, grouped: per entry ceil(rows / per_task) tasks.
        i = np.nonzero(narrow)[0]
        per_task = np.maximum(1, seg // width[i])
        n_tasks = -(-rows[i] // per_task)
        e = np.repeat(i, n_tasks)
        k = np.arange(int(n_tasks.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(n_tasks) - n_tasks, n_tasks
        )
        g = np.repeat(per_task, n_tasks)
        first = k * g
        out.append(
            np.stack(
                [
                    s[e] + first * sp[e],
                    d[e] + first * dp[e],
                    width[e],
                    np.minimum(g, rows[e] - first),
                    sp[e],
                    dp[e],
                ],
                axis=1,
            )
        )
    if np.any(~narrow):
        # Long rows: every row split into segments of ``seg`` words.
        i = np.nonzero(~narrow)[0]
        n_seg = -(-width[i] // seg)
        per_entry = rows[i] * n_seg
        e = np.repeat(i, per_entry)
        k = np.arange(int(per_entry.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(per_entry) - per_entry, per_entry
        )
        ns = np.repeat(n_seg, per_entry)
        r, j = k // ns, k % ns
        start = j * seg
        out.append(
            np.stack(
                [
                    s[e] + r * sp[e] + start,
                    d[e] + r * dp[e] + start,
                    np.minimum(seg, width[e] - start),
                    np.ones_like(e),
                    sp[e],
                    dp[e],
                ],
                axis=1,
            )
        )
    if not out:
        return np.zeros((0, 6), dtype=np.int64)
    return np.ascontiguousarray(np.concatenate(out).astype(np.int64))


class CopyProgram:
    """A table bound to its tensors; call it to copy. See the module docstring."""

    def __init__(
        self,
        table: CopyTable,
        sources: Sequence[torch.Tensor],
        dests: Sequence[torch.Tensor],
        *,
        method: str = "auto",
        task_bytes: int = DEFAULT_TASK_BYTES,
    ) -> None:
        _check(table.sources, sources, "source")
        _check(table.dests, dests, "destination")
        devices = {t.device for t in [*sources, *dests]}
        if len(devices) > 1:
            raise ValueError(
                f"tensors are on several devices: {sorted(map(str, devices))}"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        if method == "auto":
            if self.device.type == "cuda" and triton_available():
                method = "triton"
            elif self.device.type == "cuda":
                method = "foreach"
            else:
                method = "loop"
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; one of {METHODS}")
        self.method = method
        self.table = table
        self._keep = (list(sources), list(dests))
        self._run: Callable[[], None]
        self._shiftable = False  # the triton method: sources may move together
        if method == "triton":
            self._bind_triton(sources, dests, task_bytes)
        else:
            word = min(8, _common_alignment(table, [*sources, *dests]))
            self.word, self.vec = word, 1
            srcs, dsts = _entry_views(
                table,
                [_word_view(t, word) for t in sources],
                [_word_view(t, word) for t in dests],
                word,
            )
            if method == "foreach":

                def run() -> None:
                    if srcs:
                        torch._foreach_copy_(dsts, srcs)

            else:

                def run() -> None:
                    for d, s in zip(dsts, srcs, strict=True):
                        d.copy_(s)

            self._run = run

    def _bind_triton(
        self,
        sources: Sequence[torch.Tensor],
        dests: Sequence[torch.Tensor],
        task_bytes: int,
    ) -> None:
        if self.device.type != "cuda" and not _interpreting():
            raise ValueError("the triton method needs CUDA tensors")
        src_addr = [t.data_ptr() for t in sources]
        dst_addr = [t.data_ptr() for t in dests]
        align = _common_alignment(self.table, [*sources, *dests])
        word = min(align, 8)
        vec = align // word  # 2 int64 words per 16-byte vector, else 1
        self._base = torch.empty(2, dtype=_WORD_DTYPES[word], device=self.device)
        base_addr = self._base.data_ptr()
        if base_addr % align:  # never for an allocator block
            raise ValueError("the base allocation is not aligned")
        tasks = build_tasks(self.table, src_addr, dst_addr, base_addr, word, task_bytes)
        tile = max(1, _TILE_BYTES // word)
        min_cols = max(vec, _MIN_COLS_BYTES // word)
        cols = np.maximum(
            min_cols,
            np.minimum(tile, _next_pow2(tasks[:, 2])),
        )
        launches = []
        for c in sorted(set(cols.tolist())):
            part = np.ascontiguousarray(tasks[cols == c])
            launches.append(
                (
                    int(c),
                    max(1, tile // int(c)),
                    part.shape[0],
                    torch.from_numpy(part).to(self.device),
                )
            )
        self.tasks = int(tasks.shape[0])
        self.word = word
        self.vec = vec
        self.launches = [(c, r, n) for c, r, n, _ in launches]
        kernel = _triton_kernel()
        base = self._base
        self._shiftable = True

        def run_shifted(shift: int) -> None:
            for c, r, n, t in launches:
                kernel[(n,)](base, t, shift, COLS=c, ROWS=r, VEC=vec, num_warps=8)

        self._run_shifted = run_shifted
        self._run = lambda: run_shifted(0)

    def __call__(self) -> None:
        with torch.no_grad():
            self._run()

    def can_shift(self, delta: int) -> bool:
        """Whether `run_shifted(delta)` applies: the Triton method, and
        ``delta`` keeps the table's alignment."""
        return self._shiftable and delta % (self.word * self.vec) == 0

    def run_shifted(self, delta: int) -> None:
        """Run the table with every source ``delta`` bytes from the address
        it was bound at: for sources that all lie in one buffer, read from a
        copy of that buffer elsewhere with the same layout (the caller
        vouches for the layout; the dests are the bound ones)."""
        if not self.can_shift(delta):
            raise ValueError(
                f"cannot shift the sources by {delta} bytes: needs the triton "
                f"method and a multiple of {self.word * self.vec} bytes"
            )
        with torch.no_grad():
            self._run_shifted(delta // self.word)

    def release_sources(self) -> None:
        """Stop keeping the source tensors alive (a program kept only to be
        run with `run_shifted` from other buffers, while the one it was bound
        to may be freed); calling the program itself is refused from then
        on."""
        self._keep = ([], self._keep[1])

        def refused() -> None:
            raise RuntimeError(
                "this copy program released its sources; run it with run_shifted"
            )

        self._run = refused


def execute(
    table: CopyTable,
    sources: Sequence[torch.Tensor],
    dests: Sequence[torch.Tensor],
    *,
    method: str = "auto",
) -> str:
    """Copy every run of ``table`` from ``sources`` (``table.sources`` order)
    into ``dests`` (``table.dests`` order). Returns the method used."""
    program = CopyProgram(table, sources, dests, method=method)
    program()
    return program.method


@torch.no_grad()
def land_fallback(
    plan: WorkerPlan,
    table: CopyTable,
    sources: Mapping[str, torch.Tensor],
    dests: Mapping[str, torch.Tensor],
) -> None:
    """Land the copies the table left out, in plan order: the replayed slice
    copied (and cast, where the region's dtype differs) into its region of
    ``dests[region qualname]`` (regions are counted from the tensor's first
    element, as `region_view` counts them)."""
    copies = plan.copies
    for fb in table.fallback:
        copy = copies[fb.index]
        region = copy.region
        dest = dests[region.qualname]
        if dtype_name(dest.dtype) != region.dtype:
            raise ValueError(f"{region.qualname} is not {region.dtype}")
        view = dest.as_strided(
            region.shape, region.stride, dest.storage_offset() + region.offset
        )
        view.copy_(replay_slice(sources[copy.slice.source], copy.slice))


def empty_dests(
    table: CopyTable, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """Flat destination tensors sized for ``table`` (uninitialised)."""
    return [
        torch.empty(spec.numel, dtype=dtype_from_name(spec.dtype), device=device)
        for spec in table.dests
    ]
