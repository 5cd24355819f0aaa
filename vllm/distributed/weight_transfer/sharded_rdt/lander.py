# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Land pulled chunks in a model: the one landing path of sharded_rdt.

The worker engine opens a `LayerwiseReloadSession` (every layer on the meta
device, its kernel tensors kept aside), then hands each pulled chunk to
`ChunkLander.land`:

1. a module touched for the first time in this sync is materialized (empty
   checkpoint-format tensors, as layerwise reload would before loading);
2. each slice of the chunk is copied into its planned region, the ``copy_``
   the model's weight loader would have made;
3. after the last chunk of a gather group, every module the plan says completes
   there is processed at once by vLLM's per-layer step
   (``process_weights_after_loading``, which inside the session also redoes the
   CPU MoE expert setup), the result is copied into the kernel tensors and
   the module leaves the reload.

Step 2 is the lander's own work: where each slice sits in the chunk's bytes,
which dtype and shape it is read as, and which region (`region_view`) it is
copied into. Steps 1 and 3 are the lander's `ModuleSteps`. The engine uses
`LayerwiseReloadSteps`, the default; `IN_PLACE` does neither step, for a model
whose checkpoint-format tensors are already real and in place, as in the
planner's replay-versus-``load_weights`` check, which lands with this same
lander.

Modules the plan never touches are left to the session's ``finish()``, which
puts their kernel tensors back unchanged.

Direct copies (``direct``: trainer-side FP8 codes and scales, and with
``landing="planned"`` the copies of every module whose processing keeps its
bytes, ``planned_landing``; each bound to a view of the served tensor it
writes) skip both steps: their bytes are copied into the served view as they
arrive, and their modules are never materialized or processed. The engine
opens the layerwise reload only when the first module must be materialized
(``begin(before_first_module=...)``), so a sync whose copies are all direct
never moves a layer aside.

A chunk's direct copies run as one batched copy: at the first landing of a
chunk the lander compiles them into a copy table whose source is the chunk's
bytes (``copy_table.compile_chunk_table``, kept per chunk) and binds it to the
buffer the chunk arrived in and to the served tensors (a ``CopyProgram``: one
Triton launch per row-width class on CUDA). The engine's receive buffers are
reused (``land(..., reused=True)``): the program bound to one is kept for the
next sync, whose chunk arrives in the same buffer. The copies the
table cannot move as bytes (a cast, a transposed view) are copied one by one,
as are all of a chunk's copies when its buffer is on another device than the
served tensors. A buffer that is not reused (a staged copy, landed at the
commit) is not bound anew at every landing: that costs more than it saves on
dense shapes (on an H200, Qwen3-8B: 63 ms bound anew against 11 ms one by one
and 8.7 ms bound once; `bench_sharded_rdt_landing_cuda.py`;
``bind_fresh_buffers=True`` does it). On CUDA the program bound at the first
such landing is kept without its source and run from each later buffer
(``CopyProgram.run_shifted``: the task table stays on the device and only the
source offsets shift); elsewhere those copies go one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.distributed.weight_transfer.landing.regions import region_view
from vllm.distributed.weight_transfer.plan.copy_exec import CopyProgram
from vllm.distributed.weight_transfer.plan.copy_table import (
    CopyTable,
    compile_chunk_table,
)
from vllm.distributed.weight_transfer.plan.ops import (
    bit_pattern,
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    SliceCopy,
    WorkerPlan,
)
from vllm.distributed.weight_transfer.pull.chunks import PullPlan
from vllm.distributed.weight_transfer.quant.values import is_checked


class ModuleSteps(Protocol):
    """What happens to a module around the slices landed in it."""

    def materialize(self, module_name: str) -> None:
        """Before the first slice lands in the module in this sync."""

    def process(self, module_name: str) -> None:
        """After the last chunk of the group the plan says completes it."""


class LayerwiseReloadSteps:
    """The engine's steps, inside an open layerwise reload session: give the
    module real checkpoint-format tensors, then run vLLM's per-layer processing
    and copy the result into the kernel tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def _info(self, module_name: str):  # -> (module, LayerReloadingInfo)
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        module = self.model.get_submodule(module_name)
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():
            raise RuntimeError(
                f"{module_name} is not being reloaded; start_weight_update must "
                "run before update_weights"
            )
        return module, info

    def materialize(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        module, info = self._info(module_name)
        materialize_layer(module, info)

    def process(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            _layerwise_process,
        )

        # The module is materialized and filled, and nothing is buffered for
        # it, so vLLM's per-layer step only processes it (quantization,
        # repacking, the session's MoE expert setup) and copies the result into
        # the kernel tensors.
        module, info = self._info(module_name)
        _layerwise_process(module, info)


class _InPlaceSteps:
    def materialize(self, module_name: str) -> None:
        pass

    def process(self, module_name: str) -> None:
        pass


IN_PLACE: ModuleSteps = _InPlaceSteps()
"""Neither step: the checkpoint-format tensors are already real and in place,
and nothing is processed after landing."""


@dataclass(frozen=True)
class _Landing:
    copy: SliceCopy
    offset: int  # byte offset of the copy's slice in its chunk


@dataclass(frozen=True)
class _DirectBatch:
    """A chunk's direct copies, bound to the buffer it arrived in (or, with
    ``origin``, run from whichever buffer holds the chunk)."""

    program: CopyProgram | None  # the copies the table moves; None: none
    one_by_one: tuple[_Landing, ...]  # the rest, copied one ``copy_`` each
    # With ``any_buffer``: the address the program was bound at (it released
    # that buffer, and runs shifted to the buffer that holds the chunk now).
    origin: int | None = None


def deferred_modules(model: torch.nn.Module, plan: WorkerPlan) -> list[str]:
    """Planned modules that layerwise reload only processes at finalize
    (attention layers with loadable scales); landing cannot process them early."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    names = {c.region.module for c in plan.copies}
    return sorted(
        n for n in names if is_deferred_attention_layer(model.get_submodule(n))
    )


class ChunkLander:
    """See the module docstring. ``steps`` defaults to `LayerwiseReloadSteps`
    on ``model``."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: WorkerPlan,
        pulls: PullPlan,
        steps: ModuleSteps | None = None,
        direct: Mapping[SliceCopy, torch.Tensor] | None = None,
        *,
        batch_method: str | None = "auto",
        bind_fresh_buffers: bool = False,
    ) -> None:
        self.model = model
        self.plan = plan
        self.pulls = pulls
        self.steps = LayerwiseReloadSteps(model) if steps is None else steps
        # Copies that land straight in a served tensor, bound to its view
        # (``sharded_rdt_plan.with_direct_copies``): no module step around them.
        self.direct: Mapping[SliceCopy, torch.Tensor] = dict(direct or {})
        # ``batch_method``: the ``CopyProgram`` method of the batched direct
        # copies ("auto" picks per device), or None to copy them one by one;
        # ``bind_fresh_buffers``: batch them from buffers not reused too.
        self.batch_method = batch_method
        self.bind_fresh_buffers = bind_fresh_buffers
        self._tables: dict[int, CopyTable] = {}
        self._batches: dict[tuple[int, int, torch.device], _DirectBatch] = {}
        self._any_buffer: dict[int, _DirectBatch] = {}
        self._landings: list[list[_Landing]] = []
        self._completes_after: dict[int, tuple[str, ...]] = {}
        groups = {g.index: g for g in plan.groups}
        last_chunk_of_group: dict[int, int] = {}
        for i, chunk in enumerate(pulls.chunks):
            offsets = {p.spec: p.offset for p in chunk.slices}
            group = groups[chunk.group]
            self._landings.append(
                [
                    _Landing(c, offsets[c.slice])
                    for c in group.copies
                    if c.slice in offsets
                ]
            )
            last_chunk_of_group[chunk.group] = i
        for gi, i in last_chunk_of_group.items():
            self._completes_after[i] = groups[gi].completes
        self._direct: list[list[_Landing]] = [
            [x for x in chunk if x.copy in self.direct] for chunk in self._landings
        ]
        self._reloaded: list[list[_Landing]] = [
            [x for x in chunk if x.copy not in self.direct] for chunk in self._landings
        ]
        # Batched direct copies bound so far (a kept one counts once), and
        # direct copies the bound programs moved in this sync.
        self.binds = 0
        self.batched = 0
        # Per chunk asked about: its read-back sources, or None (unreadable).
        self._read_back: dict[int, list[tuple[_Landing, torch.Tensor]] | None] = {}
        # Per chunk asked about: its served pieces, or None (not writable there).
        self._pieces: dict[int, list[tuple[int, torch.Tensor]] | None] = {}
        self._materialized: set[str] = set()
        self._before_first_module: Callable[[], None] | None = None
        self.processed: list[str] = []

    def begin(self, before_first_module: Callable[[], None] | None = None) -> None:
        """Start a sync. ``before_first_module`` runs once, just before the
        first module is materialized (not at all when every copy is
        direct)."""
        self._materialized = set()
        self._before_first_module = before_first_module
        self.processed = []
        self.batched = 0

    @staticmethod
    def _value(landing: _Landing, data: torch.Tensor) -> torch.Tensor:
        """The slice ``landing`` copies, read from its chunk's bytes."""
        spec = landing.copy.slice
        raw = data[landing.offset : landing.offset + spec.nbytes]
        return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)

    @torch.no_grad()
    def land(self, index: int, data: torch.Tensor, *, reused: bool = False) -> None:
        """Land chunk ``index`` of the pull plan from its packed bytes.

        ``reused``: ``data`` is a buffer this chunk arrives in again at later
        syncs (a receive buffer that lives as long as the lander), so the
        batched copy bound to it is kept, and keeps it alive; otherwise the
        direct copies run from a program kept without its source on CUDA, one
        by one elsewhere (or, with ``bind_fresh_buffers``, from a program
        bound for this landing only)."""
        if self._direct[index]:
            if reused or self.bind_fresh_buffers:
                batch = self._direct_batch(index, data, reused)
            else:
                batch = self._any_buffer_batch(index, data)
            if batch.program is not None:
                if batch.origin is None:
                    batch.program()
                else:
                    batch.program.run_shifted(data.data_ptr() - batch.origin)
                self.batched += batch.program.table.copies
            for landing in batch.one_by_one:
                self.direct[landing.copy].copy_(self._value(landing, data))
        for landing in self._reloaded[index]:
            region = landing.copy.region
            if region.module not in self._materialized:
                if self._before_first_module is not None:
                    prepare, self._before_first_module = self._before_first_module, None
                    prepare()
                self.steps.materialize(region.module)
                self._materialized.add(region.module)
            region_view(self.model, region).copy_(self._value(landing, data))
        for module_name in self._completes_after.get(index, ()):
            self.steps.process(module_name)
            self.processed.append(module_name)

    def _direct_batch(
        self, index: int, data: torch.Tensor, reused: bool
    ) -> _DirectBatch:
        key = (index, data.data_ptr(), data.device)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._bind_direct(index, data)
            self.binds += 1
            if reused:
                self._batches[key] = batch
        return batch

    def _any_buffer_batch(self, index: int, data: torch.Tensor) -> _DirectBatch:
        """Chunk ``index``'s direct copies from a buffer that is not reused:
        a Triton program bound at the first such landing, kept without its
        source and run from each later buffer (``CopyProgram.run_shifted``:
        only the source offsets shift); one by one where that does not apply
        (not CUDA, or a buffer aligned differently from the first)."""
        one_by_one = _DirectBatch(None, tuple(self._direct[index]))
        batch = self._any_buffer.get(index)
        if batch is None:
            bound = self._bind_direct(index, data)
            self.binds += 1
            batch = one_by_one
            if bound.program is not None and bound.program.can_shift(0):
                bound.program.release_sources()
                batch = _DirectBatch(
                    bound.program, bound.one_by_one, origin=data.data_ptr()
                )
            self._any_buffer[index] = batch
        if batch.program is None or batch.origin is None:
            return batch
        if (
            not self._holds_chunk(index, data)
            or not self._same_device(batch, data)
            or not batch.program.can_shift(data.data_ptr() - batch.origin)
        ):
            return one_by_one
        return batch

    def _holds_chunk(self, index: int, data: torch.Tensor) -> bool:
        """Whether ``data`` can be a batched copy's source for chunk
        ``index``: the chunk's bytes, flat and contiguous."""
        return (
            data.dtype == torch.uint8
            and data.dim() == 1
            and data.is_contiguous()
            and data.numel() == self.pulls.chunks[index].nbytes
        )

    @staticmethod
    def _same_device(batch: _DirectBatch, data: torch.Tensor) -> bool:
        """Whether ``data`` is on the device ``batch``'s program reads from
        (a shift between addresses of two devices means nothing)."""
        return batch.program is not None and data.device == batch.program.device

    def _bind_direct(self, index: int, data: torch.Tensor) -> _DirectBatch:
        """Chunk ``index``'s direct copies bound to ``data`` and the served
        tensors: a program for what the chunk's table moves, the rest one by
        one."""
        landings = self._direct[index]
        served = [self.direct[x.copy] for x in landings]
        if (
            self.batch_method is None
            or not self._holds_chunk(index, data)
            or any(
                view.device != data.device
                or dtype_name(view.dtype) != x.copy.region.dtype
                or view.storage_offset() < x.copy.region.offset
                for x, view in zip(landings, served, strict=True)
            )
        ):
            return _DirectBatch(None, tuple(landings))
        table = self._tables.get(index)
        if table is None:
            table = self._tables[index] = compile_chunk_table(
                [(x.offset, x.copy) for x in landings],
                self.pulls.chunks[index].nbytes,
            )
        one_by_one = tuple(landings[f.index] for f in table.fallback)
        if table.entries == 0:
            return _DirectBatch(None, one_by_one)
        # Each destination as a flat tensor from the served tensor's first
        # element, where the regions' offsets count from.
        firsts: dict[str, torch.Tensor] = {}
        for x, view in zip(landings, served, strict=True):
            region = x.copy.region
            if region.qualname not in firsts:
                firsts[region.qualname] = view.as_strided(
                    (1,), (1,), view.storage_offset() - region.offset
                )
        program = CopyProgram(
            table,
            [data],
            [firsts[spec.name] for spec in table.dests],
            method=self.batch_method,
        )
        return _DirectBatch(program, one_by_one)

    def can_read_back(self, index: int) -> bool:
        """Whether chunk ``index``'s packed bytes can be read back from the
        served tensors: every slice of it lands by a direct copy that keeps
        its bytes (same dtype and shape: no cast, no processing after)."""
        return self._read_back_sources(index) is not None

    def _read_back_sources(
        self, index: int
    ) -> list[tuple[_Landing, torch.Tensor]] | None:
        """One direct copy per slice of chunk ``index`` with the served view
        it wrote, or None when some slice has none that keeps its bytes
        (found once per chunk: the served views are fixed for the lander's
        life)."""
        if index in self._read_back:
            return self._read_back[index]
        by_offset: dict[int, tuple[_Landing, torch.Tensor]] = {}
        for landing in self._direct[index]:
            view = self.direct[landing.copy]
            spec = landing.copy.slice
            if dtype_name(view.dtype) == spec.dtype and tuple(view.shape) == tuple(
                spec.shape
            ):
                by_offset.setdefault(landing.offset, (landing, view))
        slices = [p for p in self.pulls.chunks[index].slices if p.spec.nbytes]
        sources = (
            None
            if not slices or any(p.offset not in by_offset for p in slices)
            else [by_offset[p.offset] for p in slices]
        )
        self._read_back[index] = sources
        return sources

    @torch.no_grad()
    def read_back(self, index: int, into: torch.Tensor) -> None:
        """Fill ``into`` (uint8, the chunk's size) with chunk ``index``'s
        packed bytes as the served tensors hold them: each slice from the
        view its direct copy wrote, the alignment gaps zero, as a producer
        packs them. Only for a chunk that `can_read_back`."""
        sources = self._read_back_sources(index)
        if sources is None:
            raise ValueError(f"chunk {index} cannot be read back from served tensors")
        end = 0
        for landing, view in sources:
            if landing.offset > end:
                into[end : landing.offset].zero_()
            self._value(landing, into).copy_(view)
            end = landing.offset + landing.copy.slice.nbytes
        if end < into.numel():
            into[end:].zero_()

    def pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """Chunk ``index``'s slices as they lie in the served tensors,
        ``(byte offset in the chunk, flat uint8 view)`` in offset order, when
        a change to the chunk's bytes may be written there instead of landing
        the chunk: it can be read back, each slice lands in exactly one
        place, by a copy that keeps its bytes, into a contiguous view, nothing
        of the chunk is reloaded, and no slice holds values the landing
        checks (scales, codes). Else None. Found once per chunk."""
        if index in self._pieces:
            return self._pieces[index]
        sources = self._read_back_sources(index)
        pieces = None
        if sources is not None and not self._reloaded[index]:
            offsets = [x.offset for x in self._direct[index]]
            if len(offsets) == len(set(offsets)) and not any(
                is_checked(landing.copy.slice.source, view.dtype)
                or not view.is_contiguous()
                for landing, view in sources
            ):
                pieces = [
                    (landing.offset, view.reshape(-1).view(torch.uint8))
                    for landing, view in sources
                ]
        self._pieces[index] = pieces
        return pieces

    def land_in_place(self, index: int) -> None:
        """Chunk ``index`` was written straight into its `pieces`: run what
        landing it would run besides its copies (the processing of the
        modules its group completes)."""
        if self.pieces(index) is None:
            raise ValueError(f"chunk {index} has no pieces to have been written in")
        for module_name in self._completes_after.get(index, ()):
            self.steps.process(module_name)
            self.processed.append(module_name)

    def has_direct(self, index: int) -> bool:
        """Whether chunk ``index`` holds a direct copy."""
        return bool(self._direct[index])

    @torch.no_grad()
    def direct_differs(self, index: int, data: torch.Tensor) -> torch.Tensor:
        """After chunk ``index`` landed from ``data``: a 0-dim bool tensor,
        true when any served region a direct copy of the chunk wrote differs
        bit for bit from the chunk's bytes for it, cast as the landing casts
        (the landing read back). False for a chunk without direct copies."""
        flags = []
        for landing in self._direct[index]:
            served = self.direct[landing.copy]
            want = self._value(landing, data)
            if want.dtype != served.dtype:
                want = want.to(served.dtype)
            flags.append(torch.ne(bit_pattern(served), bit_pattern(want)).any())
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()
