# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer's parameters in one shared allocation, so that an ``ipc`` sync
moves each byte once: from the trainer's own tensor into the served one.

``SharedParameters.place(model)`` allocates one buffer on the parameters'
device (CPU: a POSIX shared-memory segment from ``shm_buffer``; CUDA: one
device allocation, exported by CUDA IPC), copies every parameter into it
(each at a 64-byte aligned offset) and points the parameter at its place
there (``param.data``). The module keeps training as before: the optimizer's
in-place updates now write into the buffer.

``ipc``'s trainer engine then sends a chunk whose tensors all lie in one such
buffer without packing it: the message names the buffer (a handle marked
``persistent``) and each tensor's offset in it, and the worker reads the
trainer's bytes where they are. A worker keeps a persistent buffer mapped
from one update to the next, so the mapping (page faults on CPU,
``cudaIpcOpenMemHandle`` on CUDA) is paid once, and one allocation is one
mapping however many tensors it holds.

Nothing stale can be read: the trainer locates every tensor in the buffer at
every sync, from the tensor's own data pointer. A parameter the trainer has
re-allocated since (``param.data = ...``, a dtype change) is no longer inside
the buffer, so its chunk is packed as before; the sync stays correct and only
that chunk costs the extra copy. ``SharedParameters.moved()`` lists such
parameters; ``place`` again to bring them back.

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

import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.ipc_wire import BufferHandle, ShmHandle
from vllm.distributed.weight_transfer.shm_buffer import SharedMemoryBuffer

ALIGN = 64

_live: weakref.WeakSet[SharedParameters] = weakref.WeakSet()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class SharedPlace:
    """Where a tensor's bytes lie in a shared buffer."""

    owner: SharedParameters
    offset: int


class SharedParameters:
    """One shared buffer holding a module's parameters; see the module
    docstring."""

    def __init__(
        self, buffer: SharedMemoryBuffer | torch.Tensor, names: dict[str, int]
    ) -> None:
        # A shared-memory segment (CPU) or one device allocation (CUDA).
        self._buffer: SharedMemoryBuffer | torch.Tensor | None = buffer
        # parameter name -> its offset in the segment
        self.offsets = names
        self._params: dict[str, torch.nn.Parameter] = {}
        # The CUDA export every message names, until ``export_anew``.
        self._export: BufferHandle | None = None
        flat = buffer if isinstance(buffer, torch.Tensor) else buffer.tensor
        assert flat is not None
        self._base, self._nbytes, self._device = (
            flat.data_ptr(),
            flat.numel(),
            flat.device,
        )
        # What ``Tensor.get_device()`` answers for a tensor on that device
        # (-1 on CPU): cheaper to compare than device objects.
        self._device_index = flat.get_device()
        with _live_lock:
            _live.add(self)

    @classmethod
    def place(
        cls, module: torch.nn.Module, device: torch.device | str | None = None
    ) -> SharedParameters:
        """Move every parameter of ``module`` on ``device`` (default: the
        device of its first parameter) into a new shared buffer there."""
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
        offsets: dict[str, int] = {}
        end = 0
        for name, p in params.items():
            offsets[name] = end
            end += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        shared = cls(_allocate(end, where), offsets)
        flat = shared.segment_bytes()
        with torch.no_grad():
            for name, p in params.items():
                nbytes = p.numel() * p.element_size()
                start = offsets[name]
                place = flat[start : start + nbytes].view(p.dtype).view(p.shape)
                place.copy_(p.detach())
                p.data = place
                shared._params[name] = p
        return shared

    @property
    def device(self) -> torch.device:
        return self.segment_bytes().device

    @property
    def handle(self) -> BufferHandle:
        """The buffer's handle for a worker. On CUDA the buffer is exported
        once and the export reused (see ``export_anew``)."""
        buffer = self._buffer
        if buffer is None:
            raise ValueError("this SharedParameters buffer was closed")
        if isinstance(buffer, torch.Tensor):
            if self._export is None:
                from vllm.distributed.weight_transfer.cuda_ipc_buffer import (
                    export_cuda_bytes,
                )

                self._export = export_cuda_bytes(buffer, persistent=True)
            return self._export
        base = buffer.handle
        return ShmHandle(name=base.name, nbytes=base.nbytes, persistent=True)

    @property
    def shm_name(self) -> str | None:
        """The shared-memory segment's name (CPU); None on CUDA."""
        buffer = self._buffer
        if isinstance(buffer, SharedMemoryBuffer):
            return buffer.handle.name
        return None

    def export_anew(self) -> None:
        """On CUDA, let the next ``handle`` export the buffer again.

        torch counts one reader per export: the worker that maps an export
        releases its counter when it drops the mapping, and the buffer's
        memory is held for readers until then. A worker that dropped its
        mapping (an update failed, or one did not use this buffer) maps it
        again on the next message, so that message needs a fresh export. The
        ``ipc`` trainer calls this before the first chunk of a sync that
        follows such an update. Not every sync: each export wraps the
        storage's memory in one more reference-counting layer for as long as
        the storage lives."""
        self._export = None

    def segment_bytes(self) -> torch.Tensor:
        """The whole buffer as flat bytes (what a worker maps)."""
        buffer = self._buffer
        if isinstance(buffer, torch.Tensor):
            return buffer
        if buffer is None or buffer.tensor is None:
            raise ValueError("this SharedParameters buffer was closed")
        return buffer.tensor

    def locate(self, tensor: torch.Tensor) -> int | None:
        """``tensor``'s byte offset in the buffer, or None when its bytes are
        not all there, contiguous. (Called for every tensor of every sync:
        the buffer's address, size and device are read once, at placing.)"""
        if self._buffer is None or tensor.get_device() != self._device_index:
            return None
        start = tensor.data_ptr() - self._base
        if start < 0 or start + tensor.nbytes > self._nbytes:
            return None
        return start if tensor.is_contiguous() else None

    def source(self, module: torch.nn.Module) -> SharedParametersSource:
        """A ``WeightSource`` over ``module``'s parameters (``module`` is the
        one placed) that knows when nothing moved; see the module docstring."""
        return SharedParametersSource(self, module)

    def moved(self) -> list[str]:
        """Parameters placed here that no longer live in the segment."""
        return [n for n, p in self._params.items() if self.locate(p) is None]

    def close(self) -> None:
        """Stop sharing the buffer. The parameters keep working (their memory
        stays with them while they exist) but later syncs pack them. On CPU
        the segment's name is unlinked."""
        buffer, self._buffer = self._buffer, None
        self._export = None
        with _live_lock:
            _live.discard(self)
        if isinstance(buffer, SharedMemoryBuffer):
            # Only the name goes: the parameters keep their memory.
            buffer.close()


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
        # tensor that lies contiguous in the buffer).
        self._found: tuple[list, ...] = ()
        self._in_buffer = False
        self._look()

    def _look(self) -> None:
        holders, keys, params, metas = [], [], [], []
        in_buffer = True
        for name, p in self._module.named_parameters():
            holder, _, key = name.rpartition(".")
            holders.append(self._module.get_submodule(holder)._parameters)
            keys.append(key)
            params.append(p)
            metas.append(ParamMeta(name, p.dtype, tuple(p.shape)))
            if p.numel() and self._shared.locate(p) is None:
                in_buffer = False
        self._found = (holders, keys, params, *self._now(params))
        self._metas, self._in_buffer = metas, in_buffer

    @staticmethod
    def _now(params: list) -> tuple[list, ...]:
        return tuple(list(map(read, params)) for read in _READS)

    def pinned(self) -> tuple[SharedParameters, list[ParamMeta]] | None:
        """The buffer and this source's metadata (the same list object as at
        the last look) when nothing changed since and every parameter lies in
        the buffer; None otherwise (and the next ``metadata()`` looks
        again)."""
        if not self._in_buffer or self._shared._buffer is None:
            return None
        holders, keys, params, *attributes = self._found
        if not all(map(operator.is_, map(dict.get, holders, keys), params)):
            return None  # a parameter was replaced on its module
        for read, then in zip(_READS, attributes, strict=True):
            if list(map(read, params)) != then:
                return None  # re-allocated, cast, reshaped or transposed
        return self._shared, self._metas

    def metadata(self) -> list[ParamMeta]:
        if self.pinned() is None:
            self._look()
        return self._metas

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            yield name, materialize_full_tensor(param)


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
