# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer's parameters in shared allocations, so that an ``ipc`` sync
moves each byte once: from the trainer's own tensor into the served one.

``SharedParameters.place(model)`` allocates buffers on the parameters'
device (CPU: POSIX shared-memory segments from ``shm_buffer``; CUDA: device
allocations, exported by CUDA IPC), copies every parameter into them (each
at a 64-byte aligned offset) and points the parameter at its place there
(``param.data``). The module keeps training as before: the optimizer's
in-place updates now write into the buffers.

The parameters go into segments of at most ``max_segment_bytes`` (default
1 GiB; a larger parameter gets a segment of its own), one after the other,
each filled before the next is allocated. A parameter's old memory is freed
once it is copied (unless something else still holds it), so placing needs
the parameters' memory plus about one segment, not twice the parameters.
Seen from the trainer engine, the segments are one buffer: ``locate`` gives
a tensor's offset in the segments laid end to end, and ``message_part``
turns a message's offsets into per-segment offsets and handles.

``ipc``'s trainer engine then sends a chunk whose tensors all lie in such
segments without packing it: the message names the segments (handles marked
``persistent``) and each tensor's segment and offset, and the worker reads
the trainer's bytes where they are. A worker keeps a persistent buffer mapped
from one update to the next, so the mapping (page faults on CPU,
``cudaIpcOpenMemHandle`` on CUDA) is paid once, and one allocation is one
mapping however many tensors it holds.

Nothing stale is committed: the trainer locates every tensor in the buffer
at every sync, from the tensor's own data pointer (a pinned source, below,
may do so while the workers land the bytes; a move found then aborts that
update before its commit and the sync goes again in full). A parameter the
trainer has re-allocated since (``param.data = ...``, a dtype change) is no
longer inside the buffer, so its chunk is packed as before; the sync stays
correct and only that chunk costs the extra copy.
``SharedParameters.moved()`` lists such parameters; ``place`` again to bring
them back. Adopted parameters
(``adopt``) come back by themselves: ``shared.source(module)`` adopts the
new storage when it next looks at the module (``readopt``).

The buffer lives as long as the ``SharedParameters`` object or any parameter
viewing it (keep the object, e.g. on the trainer). ``close()`` stops sharing
it (on CPU the segment's name is unlinked); workers' mappings stay valid until
they drop them, so nothing is freed under a reader: a shared-memory mapping
holds its pages, and torch's CUDA IPC reference counting keeps a device
allocation alive while any importer maps it. Only single-rank trainers send
from the buffer (``world_size == 1``); others pack.

``shared.source(model)`` is the ``WeightSource`` to send such a module with:
the same names and tensors as ``ModuleSource(model)``, and it also says when
nothing has changed since the last look (``pinned()``): every parameter is
still the object its module holds, at the same address, shape and dtype, all
inside the buffer. Then its metadata is the same list as before, and the
``ipc`` trainer resends the last sync's message (naming the layout the
workers parsed then) without walking a tensor. A parameter re-allocated or
replaced on its module ends that until the next look finds everything in
place again; a parameter registered after the source was made is not one of
its tensors (make a new source after changing the module's structure).
"""

from __future__ import annotations

import bisect
import functools
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.buffers.handles import BufferHandle, ShmHandle
from vllm.distributed.weight_transfer.buffers.shm import SharedMemoryBuffer

ALIGN = 64
# Placing fills one segment of at most this many bytes before allocating the
# next, which bounds the extra memory placing needs.
DEFAULT_MAX_SEGMENT_BYTES = 1 << 30

_live: weakref.WeakSet[SharedParameters] = weakref.WeakSet()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class SharedPlace:
    """Where a tensor's bytes lie in a shared buffer."""

    owner: SharedParameters
    offset: int


@dataclass(frozen=True)
class SegmentPart:
    """What one ``ipc`` message over a ``SharedParameters`` names: the
    segments its tensors lie in (``segments``, positions in the owner), and
    per tensor its offset in its segment and, for an owner of several
    segments, the position of that segment in ``segments``; per named
    segment, the bytes its tensors cover (what the checksums read)."""

    owner: SharedParameters
    segments: tuple[int, ...]
    offsets: list[int]
    indexes: list[int] | None  # None: the owner has one segment
    spans: tuple[tuple[int, int], ...]

    @functools.cached_property
    def segment_set(self) -> frozenset[int]:
        """``segments`` as a set (made once per part: a whole sync resent
        by id names the same part every time)."""
        return frozenset(self.segments)

    def fields(self) -> dict[str, list[int]]:
        """The message's ``offsets`` and, over several segments,
        ``buffer_indexes``."""
        if self.indexes is None:
            return {"offsets": self.offsets}
        return {"offsets": self.offsets, "buffer_indexes": self.indexes}

    def handles(self) -> Any:
        """The handle JSON for the message's device key: one handle, or one
        per named segment (each the segment's current export)."""
        found = [self.owner.segment_handle(i).to_dict() for i in self.segments]
        return found if self.indexes is not None else found[0]

    def payloads(self) -> list[torch.Tensor]:
        """Per named segment, its bytes the message's tensors cover."""
        return [
            self.owner.segment_bytes(i)[start:end]
            for i, (start, end) in zip(self.segments, self.spans, strict=True)
        ]


class SegmentOrder:
    """The order one message over ``owner``'s segments must keep: within
    each segment its tensors come at increasing offsets, none overlapping
    (the wire's rule, per buffer); across segments any order goes (an
    adopted parameter re-allocated lies in a segment laid after all
    others, whatever its place in the source)."""

    def __init__(self, owner: SharedParameters) -> None:
        self.owner = owner
        self._ends: dict[int, int] = {}  # segment -> end of its last tensor
        self.last_end = 0  # end of the last tensor added

    def fits(self, offset: int, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` at ``offset`` (as ``locate`` gives
        it) can come next."""
        return offset >= self._ends.get(self.owner.segment_at(offset, nbytes), 0)

    def add(self, offset: int, nbytes: int) -> None:
        segment = self.owner.segment_at(offset, nbytes)
        self._ends[segment] = self.last_end = offset + nbytes

    def fits_all(self, found: Sequence[tuple[int, int]]) -> bool:
        """Whether tensors at ``found`` (``(offset, nbytes)`` each, in
        order) can all come next."""
        ends = dict(self._ends)
        for offset, nbytes in found:
            i = self.owner.segment_at(offset, nbytes)
            if offset < ends.get(i, 0):
                return False
            ends[i] = offset + nbytes
        return True


class SharedParameters:
    """Shared segments holding a module's parameters; see the module
    docstring."""

    def __init__(
        self,
        segments: Sequence[SharedMemoryBuffer | torch.Tensor],
        names: dict[str, int],
    ) -> None:
        # Shared-memory segments (CPU) or device allocations (CUDA), in the
        # order they are laid end to end; None where one was let go
        # (``readopt``). Positions never change.
        self._segments: list[SharedMemoryBuffer | torch.Tensor | None] | None = []
        # parameter name -> its offset in the segments laid end to end
        self.offsets = names
        self._params: dict[str, torch.nn.Parameter] = {}
        # The CUDA export of each segment every message names, until
        # ``export_anew``.
        self._exports: dict[int, BufferHandle] = {}
        # Per segment: its address, size and where it starts end to end.
        self._bases: list[int] = []
        self._sizes: list[int] = []
        self._starts: list[int] = []
        # True for a buffer of the trainer's own storages (``adopt``).
        self.adopted = False
        first = _flat(segments[0])
        self._device = first.device
        # What ``Tensor.get_device()`` answers for a tensor on that device
        # (-1 on CPU): cheaper to compare than device objects.
        self._device_index = first.get_device()
        for segment in segments:
            self._append(segment)
        self._index()
        with _live_lock:
            _live.add(self)

    def _append(self, segment: SharedMemoryBuffer | torch.Tensor) -> int:
        """Lay ``segment`` after the others; its position. (``_index``
        after the last one.)"""
        assert self._segments is not None
        flat = _flat(segment)
        start = self._starts[-1] + self._sizes[-1] if self._starts else 0
        self._segments.append(segment)
        self._bases.append(flat.data_ptr())
        self._sizes.append(flat.numel())
        self._starts.append(start)
        return len(self._segments) - 1

    def _index(self) -> None:
        """The live segments by address, for ``locate``."""
        segments = self._segments or []
        live = [i for i, s in enumerate(segments) if s is not None]
        self._by_address = sorted(live, key=self._bases.__getitem__)
        self._sorted_bases = [self._bases[i] for i in self._by_address]
        self._only = live[0] if len(live) == 1 else None

    @classmethod
    def place(
        cls,
        module: torch.nn.Module,
        device: torch.device | str | None = None,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
    ) -> SharedParameters:
        """Move every parameter of ``module`` on ``device`` (default: the
        device of its first parameter) into new shared segments there, of at
        most ``max_segment_bytes`` each (a larger parameter gets its own)."""
        if max_segment_bytes < ALIGN:
            raise ValueError(
                f"max_segment_bytes must be at least {ALIGN}, got {max_segment_bytes}"
            )
        first = next(module.parameters(), None)
        where = torch.device(device) if device is not None else None
        if where is None:
            where = first.device if first is not None else torch.device("cpu")
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        if where.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters on {where} cannot be shared")
        params = {
            name: p
            for name, p in module.named_parameters()
            if p.device == where and p.numel()
        }
        # Parameters in segment order, cut into segments: (name, offset in
        # its segment) per parameter and the segment's size.
        groups: list[tuple[list[tuple[str, int]], int]] = []
        for name, p in params.items():
            size = -(-p.numel() * p.element_size() // ALIGN) * ALIGN
            if not groups or groups[-1][1] + size > max_segment_bytes:
                groups.append(([], 0))
            members, end = groups[-1]
            members.append((name, end))
            groups[-1] = (members, end + size)
        segments: list[SharedMemoryBuffer | torch.Tensor] = []
        offsets: dict[str, int] = {}
        placed: dict[str, torch.nn.Parameter] = {}
        start = 0
        with torch.no_grad():
            for members, nbytes in groups or [([], 0)]:
                segment = _allocate(nbytes, where)
                segments.append(segment)
                flat = _flat(segment)
                for name, offset in members:
                    p = params[name]
                    size = p.numel() * p.element_size()
                    place = flat[offset : offset + size].view(p.dtype).view(p.shape)
                    place.copy_(p.detach())
                    # The old memory goes now unless something else holds it,
                    # which the next segment may reuse.
                    p.data = place
                    placed[name] = p
                    offsets[name] = start + offset
                start += flat.numel()
        shared = cls(segments, offsets)
        shared._params = placed
        return shared

    @classmethod
    def adopt(
        cls, module: torch.nn.Module, device: torch.device | str | None = None
    ) -> SharedParameters:
        """Share ``module``'s CUDA parameters where they are: each storage
        they lie in becomes a segment, exported by CUDA IPC once, and
        nothing is copied or allocated (CUDA only; on CPU, ``place``).

        A parameter the trainer re-allocates afterwards is adopted anew by
        ``shared.source(module)`` before the next sync (``readopt``), and the
        storage no parameter lies in any more is let go; sent with another
        source it is packed (``moved()`` lists it)."""
        first = next(module.parameters(), None)
        where = torch.device(device) if device is not None else None
        if where is None:
            where = first.device if first is not None else torch.device("cpu")
        if where.type != "cuda":
            raise ValueError(
                f"adopt shares CUDA parameters in place; these are on {where}. "
                "On CPU, SharedParameters.place(module) moves them into shared "
                "memory"
            )
        if where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        return cls._of_storages(module, where)

    @classmethod
    def _of_storages(
        cls, module: torch.nn.Module, where: torch.device
    ) -> SharedParameters:
        """``adopt`` without its device check: the bookkeeping alone (tests
        run it on CPU tensors, which no worker could map)."""
        segments: list[SharedMemoryBuffer | torch.Tensor] = []
        starts: dict[int, int] = {}  # storage address -> its segment's start
        offsets: dict[str, int] = {}
        adopted: dict[str, torch.nn.Parameter] = {}
        end = 0
        for name, p in module.named_parameters():
            if p.device != where or not p.numel():
                continue
            storage = p.untyped_storage()
            address = storage.data_ptr()
            if address not in starts:
                # The whole storage as flat bytes (it holds the storage).
                flat = torch.empty(0, dtype=torch.uint8, device=where).set_(storage)
                segments.append(flat)
                starts[address] = end
                end += flat.numel()
            offsets[name] = starts[address] + int(p.storage_offset()) * p.element_size()
            adopted[name] = p
        if not segments:
            raise ValueError(f"the module has no parameters on {where} to share")
        shared = cls(segments, offsets)
        shared._params = adopted
        shared.adopted = True
        return shared

    def readopt(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
        """For adopted parameters (``adopt``): adopt the storages of the
        ``named`` parameters that lie in none of the segments (re-allocated
        or replaced since; each new storage is exported at its first use),
        and let go of the segments no parameter lies in any more. The names
        adopted anew; nothing for placed parameters, which pack instead."""
        if not self.adopted or self._segments is None:
            return []
        # A storage resized or freed in place is not where it was shared:
        # its segment goes before anything is located in it.
        moved = [i for i, seg in enumerate(self._segments) if seg is not None]
        moved = [i for i in moved if self._moved(i)]
        for i in moved:
            self._segments[i] = None
            self._exports.pop(i, None)
        if moved:
            self._index()
        found: dict[int, int] = {}  # new storage address -> its segment
        again = []
        params: dict[str, torch.nn.Parameter] = {}
        offsets: dict[str, int] = {}
        for name, p in named:
            if p.device != self._device or not p.numel():
                continue
            offset = self.locate(p)
            if offset is None:
                if not p.is_contiguous():
                    continue  # packed at every sync
                storage = p.untyped_storage()
                address = storage.data_ptr()
                if address not in found:
                    flat = torch.empty(0, dtype=torch.uint8, device=p.device)
                    found[address] = self._append(flat.set_(storage))
                    self._index()
                start = self._starts[found[address]]
                offset = start + int(p.storage_offset()) * p.element_size()
                again.append(name)
            params[name], offsets[name] = p, offset
        # What the module holds now, and nothing it let go of: a parameter
        # removed or replaced no longer keeps its old storage's segment.
        changed = params.keys() != self._params.keys() or any(
            p is not self._params[n] for n, p in params.items()
        )
        self._params, self.offsets = params, offsets
        if again or moved or changed:
            self._let_go_of_unused()
        return again

    def _let_go_of_unused(self) -> None:
        """Release the segments none of the parameters lies in (their
        storages, unless something else holds them, and their exports)."""
        assert self._segments is not None
        used = set()
        for p in self._params.values():
            offset = self.locate(p)
            if offset is not None:
                used.add(bisect.bisect_right(self._starts, offset) - 1)
        for i, segment in enumerate(self._segments):
            if segment is not None and i not in used:
                self._segments[i] = None
                self._exports.pop(i, None)
        self._index()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_segments(self) -> int:
        """Segments in use (released ones do not count)."""
        return sum(s is not None for s in self._segments or ())

    @property
    def handle(self) -> BufferHandle:
        """The handle of a buffer with one segment in use."""
        if self._only is None:
            raise ValueError(
                f"these parameters lie in {self.num_segments} segments; use "
                "segment_handle(i)"
            )
        return self.segment_handle(self._only)

    def segment_handle(self, index: int) -> BufferHandle:
        """Segment ``index``'s handle for a worker. On CUDA each segment is
        exported once and the export reused (see ``export_anew``)."""
        segment = self._segment(index)
        if isinstance(segment, torch.Tensor):
            export = self._exports.get(index)
            if export is None:
                from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
                    export_cuda_bytes,
                )

                export = self._exports[index] = export_cuda_bytes(
                    segment, persistent=True
                )
            return export
        base = segment.handle
        return ShmHandle(name=base.name, nbytes=base.nbytes, persistent=True)

    @property
    def shm_name(self) -> str | None:
        """The shared-memory segment's name (CPU, one segment); None on CUDA."""
        names = self.shm_names
        return names[0] if len(names) == 1 else None

    @property
    def shm_names(self) -> list[str]:
        """The shared-memory segments' names (CPU); empty on CUDA."""
        return [
            s.handle.name
            for s in self._segments or ()
            if isinstance(s, SharedMemoryBuffer)
        ]

    def segment_at(self, offset: int, nbytes: int = 1) -> int:
        """The segment ``nbytes`` at ``offset`` (as ``locate`` gives it, or
        for an empty tensor the end of the tensor before it) lie in. An empty
        tensor at a segment's end belongs to that segment, not to the next
        one, which may have been let go."""
        if len(self._starts) == 1:
            return 0
        if nbytes:
            return bisect.bisect_right(self._starts, offset) - 1
        return max(bisect.bisect_left(self._starts, offset) - 1, 0)

    def message_part(self, found: Sequence[tuple[int, int]]) -> SegmentPart:
        """A message's view of these segments, for tensors at ``found``
        (``(offset, nbytes)`` each, offsets as ``locate`` gives them, in the
        message's order): the segments it names and each tensor's offset
        and segment there (see ``SegmentPart``)."""
        if len(self._sizes) == 1:
            offsets = [offset for offset, _ in found]
            start = min(offsets, default=0)
            end = max((o + n for o, n in found), default=0)
            return SegmentPart(self, (0,), offsets, None, ((start, end),))
        named: dict[int, list[int]] = {}  # segment -> [start, end] of its bytes
        local, segment_of = [], []
        for offset, nbytes in found:
            i = self.segment_at(offset, nbytes)
            at = offset - self._starts[i]
            local.append(at)
            segment_of.append(i)
            span = named.setdefault(i, [at, at + nbytes])
            span[0], span[1] = min(span[0], at), max(span[1], at + nbytes)
        segments = tuple(sorted(named))
        position = {s: k for k, s in enumerate(segments)}
        return SegmentPart(
            self,
            segments,
            local,
            [position[i] for i in segment_of],
            tuple((named[i][0], named[i][1]) for i in segments),
        )

    def export_anew(self, index: int | None = None) -> None:
        """On CUDA, let the next ``segment_handle(index)`` (every segment's,
        without ``index``) export the segment again.

        torch counts one reader per export: the worker that maps an export
        releases its counter when it drops the mapping, and the buffer's
        memory is held for readers until then. A worker that dropped its
        mapping (an update failed, or one did not use this buffer) maps it
        again on the next message, so that message needs a fresh export. The
        ``ipc`` trainer calls this before the first chunk of a sync that
        follows such an update. Not every sync: each export wraps the
        storage's memory in one more reference-counting layer for as long as
        the storage lives."""
        if index is None:
            self._exports.clear()
        else:
            self._exports.pop(index, None)

    def _segment(self, index: int) -> SharedMemoryBuffer | torch.Tensor:
        """Segment ``index`` (``ValueError`` once closed or let go, or when
        its memory is no longer where it was shared from)."""
        segments = self._segments
        if segments is None:
            raise ValueError("this SharedParameters buffer was closed")
        segment = segments[index]
        if segment is None:
            raise ValueError(f"segment {index} was let go (readopt)")
        if self._moved(index):
            raise ValueError(
                f"segment {index}'s storage was resized or freed in place since "
                "it was shared; the source looks again before the next sync"
            )
        return segment

    def _moved(self, index: int) -> bool:
        """Whether live segment ``index``'s memory is not the memory it was
        shared with: an adopted storage resized (or freed, as FSDP does
        between steps) in place keeps its tensor but not its address."""
        segment = self._segments[index] if self._segments is not None else None
        if not isinstance(segment, torch.Tensor):
            return False  # shared memory this object owns
        storage = segment.untyped_storage()
        return (
            storage.data_ptr() != self._bases[index]
            or storage.nbytes() != self._sizes[index]
        )

    def segment_bytes(self, index: int = 0) -> torch.Tensor:
        """Segment ``index`` as flat bytes (what a worker maps)."""
        segment = self._segment(index)
        flat = segment if isinstance(segment, torch.Tensor) else segment.tensor
        if flat is None:
            raise ValueError("this SharedParameters buffer was closed")
        return flat

    def locate(self, tensor: torch.Tensor) -> int | None:
        """``tensor``'s byte offset in the segments laid end to end, or None
        when its bytes are not all in one segment, contiguous. (Called for
        every tensor of every sync: the segments' addresses, sizes and
        device are read once, at placing.)"""
        if self._segments is None or tensor.get_device() != self._device_index:
            return None
        address = tensor.data_ptr()
        only = self._only
        if only is not None:
            i = only
        else:
            k = bisect.bisect_right(self._sorted_bases, address) - 1
            if k < 0:
                return None
            i = self._by_address[k]
        start = address - self._bases[i]
        if start < 0 or start + tensor.nbytes > self._sizes[i]:
            return None
        return self._starts[i] + start if tensor.is_contiguous() else None

    def source(self, module: torch.nn.Module) -> SharedParametersSource:
        """A ``WeightSource`` over ``module``'s parameters (``module`` is the
        one placed) that knows when nothing moved; see the module docstring."""
        return SharedParametersSource(self, module)

    def moved(self) -> list[str]:
        """Parameters placed here that no longer live in the segment."""
        return [n for n, p in self._params.items() if self.locate(p) is None]

    def close(self) -> None:
        """Stop sharing the segments. The parameters keep working (their
        memory stays with them while they exist) but later syncs pack them.
        On CPU the segments' names are unlinked."""
        segments, self._segments = self._segments, None
        self._exports.clear()
        with _live_lock:
            _live.discard(self)
        self._only, self._by_address, self._sorted_bases = None, [], []
        for segment in segments or ():
            if isinstance(segment, SharedMemoryBuffer):
                # Only the name goes: the parameters keep their memory.
                segment.close()


# Parameters per part of ``SharedParametersSource``'s record: a check that
# yields (``pinned(yielding=True)``) holds the interpreter lock for one part
# at a time, about 0.3-1 ms.
_PART = 1024

# What ``SharedParametersSource.pinned`` reads of each parameter, each a
# C-level callable: address, dtype, element count, strides.
_READS: tuple[Callable[[torch.Tensor], Any], ...] = (
    torch.Tensor.data_ptr,
    operator.attrgetter("dtype"),
    torch.Tensor.numel,
    torch.Tensor.stride,
)


class SharedParametersSource(WeightSource):
    """``module.named_parameters()``, as ``ModuleSource`` yields them, from a
    module whose parameters a ``SharedParameters`` placed.

    ``pinned()`` answers, without walking the module, whether every parameter
    is exactly where the last look found it, inside the shared buffer: then a
    sync can name the same bytes the last one did. The check reads each
    parameter's holder, address, dtype, element count and strides (a
    fraction of a microsecond each), so a moved parameter is always seen;
    the source then looks again (a full walk of the module) and the trainer
    sends the usual way, packing what is not in the buffer."""

    def __init__(self, shared: SharedParameters, module: torch.nn.Module) -> None:
        self._shared = shared
        self._module = module
        self._metas: list[ParamMeta] = []
        # What the last look found, per parameter: the dict holding it on its
        # module and its key there, the parameter, its address, dtype,
        # element count and strides (shape is left out: ``Tensor.size`` costs
        # ten times more, and with the others it fixes the shape of a
        # tensor that lies contiguous in the buffer). Kept in parts of
        # ``_PART`` parameters, so a check can let other threads run between
        # parts (``pinned(yielding=True)``).
        self._found: list[tuple[list, ...]] = []
        self._in_buffer = False
        self._look()

    def _look(self) -> None:
        holders, keys, params, metas = [], [], [], []
        in_buffer = True
        # Adopted parameters re-allocated or replaced since: their new
        # storages become segments (the sync then goes whole, naming them).
        self._shared.readopt(self._module.named_parameters())
        for name, p in self._module.named_parameters():
            holder, _, key = name.rpartition(".")
            holders.append(self._module.get_submodule(holder)._parameters)
            keys.append(key)
            params.append(p)
            metas.append(ParamMeta(name, p.dtype, tuple(p.shape)))
            if p.numel() and self._shared.locate(p) is None:
                in_buffer = False
        self._found = [
            (holders[i : i + _PART], keys[i : i + _PART], part, *self._now(part))
            for i in range(0, len(params), _PART)
            for part in [params[i : i + _PART]]
        ]
        self._metas, self._in_buffer = metas, in_buffer

    @staticmethod
    def _now(params: list) -> tuple[list, ...]:
        return tuple(list(map(read, params)) for read in _READS)

    def pinned(
        self, yielding: bool = False
    ) -> tuple[SharedParameters, list[ParamMeta]] | None:
        """The buffer and this source's metadata (the same list object as at
        the last look) when nothing changed since and every parameter lies in
        the buffer; None otherwise (and the next ``metadata()`` looks
        again).

        ``yielding``: give up the interpreter lock after each part of
        ``_PART`` parameters, for a check that runs on a helper thread while
        the caller's thread sends (the reads themselves never release it,
        and 9,435 parameters take 3-10 ms)."""
        if not self._in_buffer or self._shared._segments is None:
            return None
        for holders, keys, params, *attributes in self._found:
            if not all(map(operator.is_, map(dict.get, holders, keys), params)):
                return None  # a parameter was replaced on its module
            for read, then in zip(_READS, attributes, strict=True):
                if list(map(read, params)) != then:
                    return None  # re-allocated, cast, reshaped or transposed
            if yielding:
                time.sleep(0)
        return self._shared, self._metas

    def metadata(self) -> list[ParamMeta]:
        if self.pinned() is None:
            self._look()
        return self._metas

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            yield name, materialize_full_tensor(param)


def _flat(segment: SharedMemoryBuffer | torch.Tensor) -> torch.Tensor:
    """A segment's bytes as a flat uint8 tensor."""
    flat = segment if isinstance(segment, torch.Tensor) else segment.tensor
    assert flat is not None
    return flat


def _allocate(nbytes: int, device: torch.device) -> SharedMemoryBuffer | torch.Tensor:
    """A buffer of ``nbytes`` on ``device`` that outlives the views into it."""
    if device.type == "cuda":
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    buffer = SharedMemoryBuffer(nbytes)
    # The parameters will view the mapping for as long as they exist.
    buffer.outlive_views()
    return buffer


def shared_place(tensor: torch.Tensor) -> SharedPlace | None:
    """Where ``tensor`` lies in a live ``SharedParameters`` buffer, if it does."""
    if not _live:  # the common case, asked for every packed tensor
        return None
    with _live_lock:
        segments = list(_live)
    for segment in segments:
        offset = segment.locate(tensor)
        if offset is not None:
            return SharedPlace(segment, offset)
    return None
