# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The planned landing of a chunk that stays mapped across syncs, bound once
as a `CopyProgram` and run every sync.

With ``landing="planned"`` a worker lands each direct checkpoint tensor by
replaying the slices its plan recorded: a few Python calls and one device copy
per slice, tens of microseconds per tensor, which dominates a sync of
thousands of small tensors (MoE experts). When the trainer's parameters live
in buffers the worker keeps mapped (``SharedParameters``: one segment or
several), a chunk's bytes
sit at the same addresses at every sync, and so do the served tensors they
land in. Then the chunk's whole planned landing is one copy table
(``copy_table``), compiled from the plan for the chunk's names and bound to
the mapped bytes and the served tensors once (``copy_table_exec``).

`ChunkPrograms` keeps those bound programs. ``land`` is given a key that
names everything a program was bound to: the mappings (which buffers, at
which addresses) and the chunk's layout in them (names, dtypes, shapes,
buffers and offsets).
The same key runs the program bound before; another key binds a new one. The
owner drops the programs bound to a mapping before it unmaps it
(``forget``), and drops them all when a served tensor was replaced (the
landing plan is baked again then, and its programs go with it).

A packed buffer mapped anew at every sync (a trainer that frees it after the
sync, the CUDA default) has the same layout each time at another address.
``anywhere`` binds the layout's program at its first chunk, keeps it without
its sources, and runs it from each later buffer with the sources shifted by
the distance (Triton only: the task table stays on the device).

Copies the table cannot take as a pure byte move (a cast, a view that had to
copy) are left out, together with every other copy of the same checkpoint
name: those names land the ordinary way (``LandingPlan.land``), so a name is
landed by one path only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.common.wire_fields import FieldsKey
from vllm.distributed.weight_transfer.ipc.layout_memo import layout_fact
from vllm.distributed.weight_transfer.plan.copy_exec import CopyProgram
from vllm.distributed.weight_transfer.plan.copy_table import compile_copy_table
from vllm.distributed.weight_transfer.plan.ops import dtype_name
from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan

# Programs kept per landing plan; a trainer's layout has one per chunk.
DEFAULT_MAX_PROGRAMS = 256


@dataclass(frozen=True)
class BoundChunk:
    """One chunk's planned landing, bound to its mappings (or, with
    ``shift``, run from a buffer ``shift`` bytes from the one it was bound
    to)."""

    program: CopyProgram | None  # None when no copy of the chunk is a byte move
    names: frozenset[str]  # checkpoint names the program lands in full
    # Addresses of the mappings the sources lie in; empty: none kept.
    mappings: frozenset[int]
    shift: int | None = None

    def __call__(self) -> None:
        if self.program is None:
            return
        if self.shift is None:
            self.program()
        else:
            self.program.run_shifted(self.shift)


class ChunkLayout(FieldsKey):
    """A chunk's layout in its buffers (names, dtypes, shapes, buffers,
    offsets) as a dict key: hashed once, and equal to another only when
    every field is."""

    __slots__ = ()

    def __init__(self, views: Sequence[Any]) -> None:
        super().__init__(
            tuple((v.name, v.dtype, v.shape, v.buffer, v.offset) for v in views)
        )


def chunk_in_mapping(
    mapped: Hashable, buffers: Sequence[torch.Tensor], info: Any
) -> tuple[
    tuple[Hashable, ChunkLayout],
    Callable[[Sequence[str]], dict[str, torch.Tensor]],
]:
    """For a packed ``ipc`` message ``info`` (``IPCWeightTransferUpdateInfo``)
    read from ``buffers`` (its mappings, in the message's buffer order;
    ``mapped`` names them and their addresses, e.g.
    ``ipc_dataplane.MappedBuffers``): the key ``ChunkPrograms.bound`` takes (the
    mappings and the message's layout in them, a ``ChunkLayout`` made once
    per layout), and the ``sources`` callback that views the named tensors
    in the mappings (tensors at offsets their dtype cannot start at are left
    out). ``ChunkPrograms.anywhere`` takes the key's last element, the layout
    alone."""
    layout = layout_fact(info, ChunkLayout, ChunkLayout)
    key = (mapped, layout)

    def sources(names: Sequence[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        return {
            v.name: buffers[v.buffer][v.offset : v.offset + v.nbytes]
            .view(v.dtype)
            .view(v.shape)
            for v in info.views()
            if v.name in wanted and v.offset % v.dtype.itemsize == 0
        }

    return key, sources


class ChunkPrograms:
    """Bound programs for the chunks of one landing plan; see the module
    docstring.

    ``plan`` is the worker's baked plan, ``served`` the tensors it writes by
    region qualname (the live parameters), ``direct`` the checkpoint names
    whose copies may land straight in them. ``method`` is the executor's
    (``copy_table_exec.METHODS``, or "auto").
    """

    def __init__(
        self,
        plan: WorkerPlan,
        served: Mapping[str, torch.Tensor],
        direct: frozenset[str],
        *,
        method: str = "auto",
        max_programs: int = DEFAULT_MAX_PROGRAMS,
    ) -> None:
        self.plan = plan
        self.served = served
        self.direct = direct
        self.method = method
        self.max_programs = max_programs
        self._bound: dict[Hashable, BoundChunk] = {}
        # Per layout: a program released from its sources and the buffer
        # address it was bound at (``anywhere``); (None, 0) where that
        # cannot apply.
        self._anywhere: dict[Hashable, tuple[BoundChunk | None, int]] = {}
        # Programs bound in this object's lifetime (a reused one counts once),
        # and the times a bound one was handed out again.
        self.binds = 0
        self.reused = 0

    def __len__(self) -> int:
        return len(self._bound)

    def bound(
        self,
        key: Hashable,
        mappings: frozenset[int],
        names: Sequence[str],
        sources: Callable[[Sequence[str]], Mapping[str, torch.Tensor]],
    ) -> BoundChunk:
        """The program for the chunk ``key`` names, bound now if it was not.

        ``mappings`` are the addresses of the buffers the chunk lies in,
        ``names`` the chunk's names, and ``sources(names)`` the tensors of
        those it is given in the mappings (called only when binding; a name
        it leaves out lands the ordinary way)."""
        found = self._bound.get(key)
        if found is not None:
            self.reused += 1
            return found
        chunk = self._bind(mappings, names, sources)
        if len(self._bound) >= self.max_programs:
            # A trainer whose layout keeps changing: drop the oldest.
            self._bound.pop(next(iter(self._bound)))
        self._bound[key] = chunk
        self.binds += 1
        return chunk

    def anywhere(
        self,
        layout: Hashable,
        buffer: torch.Tensor,
        names: Sequence[str],
        sources: Callable[[Sequence[str]], Mapping[str, torch.Tensor]],
    ) -> BoundChunk | None:
        """The program for a chunk of ``layout`` read from ``buffer``, a
        mapping that is not kept (a packed buffer the trainer frees after the
        sync): bound at the first such chunk, kept without its sources, and
        run from each later buffer of the same layout with its sources
        shifted by the buffers' distance (``CopyProgram.run_shifted``; the
        tasks stay on the device). None where that does not apply (not the
        Triton method, or a buffer aligned differently): the chunk lands the
        ordinary way."""
        found = self._anywhere.get(layout)
        if found is None:
            chunk = self._bind(frozenset(), names, sources)
            self.binds += 1
            program = chunk.program
            if program is not None and program.can_shift(0):
                program.release_sources()
                found = (chunk, buffer.data_ptr())
            else:
                found = (None, 0)
            if len(self._anywhere) >= self.max_programs:
                self._anywhere.pop(next(iter(self._anywhere)))
            self._anywhere[layout] = found
        else:
            self.reused += 1
        chunk_or_none, origin = found
        if chunk_or_none is None or chunk_or_none.program is None:
            return None
        delta = buffer.data_ptr() - origin
        if not chunk_or_none.program.can_shift(delta):
            return None
        return BoundChunk(
            chunk_or_none.program, chunk_or_none.names, frozenset(), delta
        )

    def _bind(
        self,
        mappings: frozenset[int],
        names: Sequence[str],
        sources: Callable[[Sequence[str]], Mapping[str, torch.Tensor]],
    ) -> BoundChunk:
        tensors = sources([n for n in names if n in self.direct])
        wanted = [n for n in names if n in tensors]
        metas = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
        table = compile_copy_table(self.plan, metas, only_sources=wanted)
        if table.fallback:
            # A name with any copy the table cannot move lands the ordinary
            # way, all of it.
            slow = {f.source for f in table.fallback}
            wanted = [n for n in wanted if n not in slow]
            table = compile_copy_table(self.plan, metas, only_sources=wanted)
            assert not table.fallback, table.fallback
        if table.entries == 0:
            return BoundChunk(None, frozenset(wanted), mappings)
        program = CopyProgram(
            table,
            [tensors[spec.name] for spec in table.sources],
            [self.served[spec.name] for spec in table.dests],
            method=self.method,
        )
        return BoundChunk(program, frozenset(wanted), mappings)

    def names_bound(self) -> int:
        """Checkpoint names the kept programs land."""
        return sum(len(chunk.names) for chunk in self._bound.values())

    def forget(self, mappings: set[int]) -> None:
        """Drop the programs bound to any of the ``mappings`` (addresses):
        call before those are unmapped."""
        if not mappings:
            return
        self._bound = {
            k: c for k, c in self._bound.items() if c.mappings.isdisjoint(mappings)
        }

    def clear(self) -> None:
        self._bound.clear()
        self._anywhere.clear()
