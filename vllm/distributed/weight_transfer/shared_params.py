# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU trainer's parameters in shared memory, so that an ``ipc`` sync moves
each byte once: from the trainer's own tensor into the served one.

``SharedParameters.place(model)`` allocates one POSIX shared-memory segment
(``shm_buffer``), copies every parameter into it (each at a 64-byte aligned
offset) and points the parameter at its place there (``param.data``). The
module keeps training as before: the optimizer's in-place updates now write
into the segment.

``ipc``'s trainer engine then sends a chunk whose tensors all lie in one such
segment without packing it: the message names the segment (a handle marked
``persistent``) and each tensor's offset in it, and the worker reads the
trainer's bytes where they are. A worker keeps a persistent segment mapped
from one update to the next, so the mapping (and its page faults) is paid
once.

Nothing stale can be read: the trainer locates every tensor in the segment at
every sync, from the tensor's own data pointer. A parameter the trainer has
re-allocated since (``param.data = ...``, a dtype change) is no longer inside
the segment, so its chunk is packed as before; the sync stays correct and
only that chunk costs the extra copy. ``SharedParameters.moved()`` lists such
parameters; ``place`` again to bring them back.

The segment lives as long as the ``SharedParameters`` object (keep it, e.g. on
the trainer), and is unlinked by ``close()``; workers' mappings stay valid
until they drop them, so nothing is freed under a reader. CPU only: on CUDA a
colocated trainer's tensors are exported by CUDA IPC without a copy already.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from vllm.distributed.weight_transfer.ipc_wire import ShmHandle
from vllm.distributed.weight_transfer.shm_buffer import SharedMemoryBuffer

ALIGN = 64

_live: weakref.WeakSet[SharedParameters] = weakref.WeakSet()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class SharedPlace:
    """Where a tensor's bytes lie in a shared segment."""

    owner: SharedParameters
    offset: int


class SharedParameters:
    """One shared-memory segment holding a module's parameters; see the module
    docstring."""

    def __init__(self, buffer: SharedMemoryBuffer, names: dict[str, int]) -> None:
        self._buffer: SharedMemoryBuffer | None = buffer
        # parameter name -> its offset in the segment
        self.offsets = names
        self._params: dict[str, torch.nn.Parameter] = {}
        with _live_lock:
            _live.add(self)

    @classmethod
    def place(cls, module: torch.nn.Module) -> SharedParameters:
        """Move every CPU parameter of ``module`` into a new segment."""
        params = {
            name: p
            for name, p in module.named_parameters()
            if p.device.type == "cpu" and p.numel()
        }
        offsets: dict[str, int] = {}
        end = 0
        for name, p in params.items():
            offsets[name] = end
            end += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        buffer = SharedMemoryBuffer(end)
        # The parameters will view the mapping for as long as they exist.
        buffer.outlive_views()
        assert buffer.tensor is not None
        shared = cls(buffer, offsets)
        with torch.no_grad():
            for name, p in params.items():
                nbytes = p.numel() * p.element_size()
                start = offsets[name]
                place = buffer.tensor[start : start + nbytes].view(p.dtype)
                place = place.view(p.shape)
                place.copy_(p.detach())
                p.data = place
                shared._params[name] = p
        return shared

    @property
    def handle(self) -> ShmHandle:
        if self._buffer is None:
            raise ValueError("this SharedParameters segment was closed")
        base = self._buffer.handle
        return ShmHandle(name=base.name, nbytes=base.nbytes, persistent=True)

    def segment_bytes(self) -> torch.Tensor:
        """The whole segment as flat bytes (what a worker maps)."""
        buffer = self._buffer
        if buffer is None or buffer.tensor is None:
            raise ValueError("this SharedParameters segment was closed")
        return buffer.tensor

    def locate(self, tensor: torch.Tensor) -> int | None:
        """``tensor``'s byte offset in the segment, or None when its bytes are
        not all there, contiguous."""
        buffer = self._buffer
        if buffer is None or buffer.tensor is None or tensor.device.type != "cpu":
            return None
        if not tensor.is_contiguous():
            return None
        base = buffer.tensor.data_ptr()
        start = tensor.data_ptr() - base
        nbytes = tensor.numel() * tensor.element_size()
        if start < 0 or start + nbytes > buffer.nbytes:
            return None
        return start

    def moved(self) -> list[str]:
        """Parameters placed here that no longer live in the segment."""
        return [n for n, p in self._params.items() if self.locate(p) is None]

    def close(self) -> None:
        """Unlink the segment. The parameters keep working (their memory
        stays mapped in this process while they exist) but are no longer
        shared; later syncs pack them."""
        buffer, self._buffer = self._buffer, None
        with _live_lock:
            _live.discard(self)
        if buffer is not None:
            # Only the name goes: the parameters keep their memory.
            buffer.close()


def shared_place(tensor: torch.Tensor) -> SharedPlace | None:
    """Where ``tensor`` lies in a live ``SharedParameters`` segment, if it does."""
    if tensor.device.type != "cpu":
        return None
    with _live_lock:
        segments = list(_live)
    for segment in segments:
        offset = segment.locate(tensor)
        if offset is not None:
            return SharedPlace(segment, offset)
    return None
