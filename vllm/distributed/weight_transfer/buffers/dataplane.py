# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The two data planes of the ``ipc`` backend behind one small interface.

Trainer side, ``allocate_buffer`` / ``export_tensor`` return an
``ExportedBuffer``: a flat uint8 tensor the trainer writes into, the JSON
handle a worker needs to read it, and ``close()``. The data plane follows the
device of the source tensors: CUDA tensors go through CUDA IPC
(``cuda_ipc_buffer``), CPU tensors through POSIX shared memory
(``shm_buffer``).

Worker side, ``BufferImporter`` picks this worker's handle out of a
``{device_key: handle}`` map (see ``buffers.handles`` for the keys), maps each buffer
once per update and releases every mapping in ``close()``, except, when
asked, those of persistent buffers (a trainer's ``SharedParameters``, or the
packed buffer it keeps between syncs), kept for the next update. A kept
shared-memory mapping is re-checked (``MappedSegment.check``) each time it
is handed out again; a kept CUDA mapping hands each new export's reference
counter back to torch (``CudaMapping.check``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.weight_transfer.buffers.handles import (
    CPU_KEY_PREFIX,
    BufferHandle,
    CudaIpcHandle,
    ShmHandle,
    cpu_device_key,
    select_cpu_key,
)
from vllm.distributed.weight_transfer.common.wire_fields import FieldsKey

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.buffers.shm import MappedSegment


def device_key(device: torch.device, trainer_rank: int) -> str:
    """The key under which a trainer rank publishes buffers on ``device``."""
    if device.type == "cuda":
        from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
            physical_gpu_uuid,
        )

        index = device.index if device.index is not None else 0
        return physical_gpu_uuid(index)
    if device.type == "cpu":
        return cpu_device_key(trainer_rank)
    raise ValueError(
        f"the ipc backend moves CPU or CUDA tensors, got a tensor on {device}"
    )


def sync_device(device: torch.device | None) -> None:
    """Wait until ``device``'s current stream has run everything queued so far
    (CUDA only; CPU copies are done when they return)."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class ExportedBuffer:
    """A trainer-side buffer: write into ``tensor``; publish ``handle``."""

    tensor: torch.Tensor | None
    handle: BufferHandle
    _owner: Any = None  # SharedMemoryBuffer, or the exported CUDA tensor

    def export_anew(self) -> None:
        """Give a CUDA buffer a fresh export (``handle``), with a reference
        counter of its own for the next worker that maps it; see
        ``SharedParameters.export_anew``. Shared memory needs none."""
        if isinstance(self.handle, CudaIpcHandle) and self.tensor is not None:
            from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
                export_cuda_bytes,
            )

            self.handle = export_cuda_bytes(
                self.tensor, persistent=self.handle.persistent
            )

    def close(self) -> None:
        self.tensor = None
        owner, self._owner = self._owner, None
        close = getattr(owner, "close", None)
        if callable(close):
            close()


def allocate_buffer(
    nbytes: int, device: torch.device, *, persistent: bool = False
) -> ExportedBuffer:
    """A new exported byte buffer of ``nbytes`` on ``device``. ``persistent``
    marks its handle for a buffer the trainer reuses from sync to sync, which
    workers then keep mapped (see ``BufferImporter.close``)."""
    if device.type == "cuda":
        from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
            export_cuda_bytes,
        )

        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        handle = export_cuda_bytes(tensor, persistent=persistent)
        return ExportedBuffer(tensor, handle, tensor)
    if device.type == "cpu":
        from vllm.distributed.weight_transfer.buffers.shm import (
            SharedMemoryBuffer,
            reap_segments,
        )

        reap_segments()  # segments of trainers that died without closing them
        shm = SharedMemoryBuffer(nbytes)
        shm_handle = shm.handle
        if persistent:
            shm_handle = dataclasses.replace(shm_handle, persistent=True)
        return ExportedBuffer(shm.tensor, shm_handle, shm)
    raise ValueError(f"the ipc backend cannot export memory on {device}")


def export_tensor(tensor: torch.Tensor) -> ExportedBuffer:
    """Export one tensor's bytes: zero-copy on CUDA, one copy into shm on CPU."""
    tensor = tensor.detach()
    if tensor.is_cuda:
        from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
            export_cuda_bytes,
        )

        tensor = tensor.contiguous()
        return ExportedBuffer(None, export_cuda_bytes(tensor), tensor)
    buffer = allocate_buffer(tensor.numel() * tensor.element_size(), tensor.device)
    assert buffer.tensor is not None
    if tensor.numel():
        buffer.tensor.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    buffer.tensor = None
    return buffer


def release_exported_cuda_memory() -> None:
    """Let CUDA reclaim exported buffers every importer has released."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


class BufferImporter:
    """Worker side: selects, maps and caches the buffers of one update.

    ``writable=False`` maps shared-memory segments read-only (what the worker
    engine does: it only reads); ``writable=True`` is for tools that edit the
    trainer's bytes in place.
    """

    def __init__(
        self, device: torch.device, local_rank: int, *, writable: bool = False
    ) -> None:
        self.device = device
        self.local_rank = local_rank
        self.writable = writable
        self._open: dict[tuple, MappedSegment | CudaMapping] = {}
        # Keys opened since the last ``close``.
        self._used: set[tuple] = set()
        # Buffers mapped in this importer's lifetime (a kept one counts once).
        self.mappings_opened = 0
        # Changes whenever a mapping is opened or released: equal values mean
        # the same mappings, at the same addresses.
        self.generation = 0
        # Open mappings of buffers not marked persistent.
        self._transient = 0
        self._gpu_uuid: str | None = None

    def select(
        self, handles: dict[str, BufferHandle], where: str
    ) -> tuple[str, BufferHandle]:
        """This worker's ``(device key, handle)`` in ``handles``; ``ValueError``
        if it has none."""
        if self.device.type == "cuda":
            if self._gpu_uuid is None:
                from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
                    physical_gpu_uuid,
                )

                index = self.device.index if self.device.index is not None else 0
                self._gpu_uuid = physical_gpu_uuid(index)
            key: str | None = self._gpu_uuid
            expected: type = CudaIpcHandle
            if key not in handles:
                raise ValueError(
                    f"{where} has no handle for this worker's GPU {key} (keys: "
                    f"{sorted(handles)}); a trainer rank on this GPU must take "
                    "part in the send"
                )
        elif self.device.type == "cpu":
            key = select_cpu_key(list(handles), self.local_rank)
            expected = ShmHandle
            if key is None:
                raise ValueError(
                    f"{where} has no shared-memory handle for this host (keys: "
                    f"{sorted(handles)}); CPU transfers need the trainer on the "
                    f"same host, under a '{CPU_KEY_PREFIX}<hostname>:<rank>' key"
                )
        else:
            raise ValueError(f"the ipc backend cannot import into {self.device}")
        assert key is not None
        handle = handles[key]
        if not isinstance(handle, expected):
            raise ValueError(
                f"{where}[{key!r}] is a {handle.kind!r} handle but this worker "
                f"runs on {self.device.type}"
            )
        return key, handle

    def open(self, handle: BufferHandle) -> torch.Tensor:
        """The buffer as a flat uint8 tensor, mapped once until ``close()``."""
        key = mapping_key(handle)
        entry = self._open.get(key)
        if entry is None:
            entry = self._map(handle)
            self._open[key] = entry
            self.mappings_opened += 1
            self.generation += 1
            self._transient += not handle.persistent
        else:
            entry.check(handle)
        self._used.add(key)
        tensor = entry.tensor
        assert tensor is not None
        return tensor

    def _map(self, handle: BufferHandle) -> MappedSegment | CudaMapping:
        if isinstance(handle, ShmHandle):
            from vllm.distributed.weight_transfer.buffers.shm import MappedSegment

            return MappedSegment(handle, writable=self.writable)
        index = self.device.index if self.device.index is not None else 0
        return CudaMapping(handle, index)

    def use(self, keys: frozenset[tuple], segments: Sequence[tuple] = ()) -> None:
        """Count the mappings under ``keys`` (``mapping_key``s, all mapped
        now) as read by this update, as ``open`` does for a handle it was
        given again unchanged: the shared-memory ``segments`` among them are
        checked again (``MappedSegment.check``); a CUDA mapping needs
        nothing (same export, same counter)."""
        for key in segments:
            entry = self._open[key]
            entry.check(entry.handle)
        self._used |= keys

    def holds(self, handle: BufferHandle) -> bool:
        """Whether the buffer ``handle`` names is mapped now."""
        return mapping_key(handle) in self._open

    def storage_ptrs(self) -> set[int]:
        """Data pointers of every mapped buffer (to find views into them)."""
        ptrs = set()
        for entry in self._open.values():
            tensor = entry.tensor
            if tensor is not None and tensor.numel():
                ptrs.add(tensor.untyped_storage().data_ptr())
        return ptrs

    def kept(self) -> list[BufferHandle]:
        """Handles of the buffers mapped now (kept from earlier updates, or
        opened since the last ``close``)."""
        return [entry.handle for entry in self._open.values()]

    def close(self, keep_persistent: bool = False) -> None:
        """Release the mappings. ``keep_persistent`` keeps those of buffers
        marked persistent (a trainer's own parameters, or its kept packed
        buffer) for the next update,
        unless buffers were opened since the last ``close`` and they were not
        among them (a trainer that moved on, or died); a kept mapping is
        checked again before each reuse."""
        if keep_persistent and self._keeps_all():
            # Nothing to release: no look at each of (maybe thousands of)
            # mappings.
            self._used = set()
            return
        entries = self._open
        self._open = {}
        for key, entry in entries.items():
            if self._keeps(key, entry, keep_persistent):
                self._open[key] = entry
            else:
                entry.close()
        if len(self._open) != len(entries):
            self.generation += 1
        self._transient = sum(not e.handle.persistent for e in self._open.values())
        self._used = set()
        del entries

    def releasing(self, keep_persistent: bool = False) -> set[int]:
        """Addresses of the mappings ``close(keep_persistent)`` would release
        now (so what was bound to them can be dropped first)."""
        if keep_persistent and self._keeps_all():
            return set()
        return {
            entry.tensor.data_ptr()
            for key, entry in self._open.items()
            if entry.tensor is not None and not self._keeps(key, entry, keep_persistent)
        }

    def _keeps_all(self) -> bool:
        """Whether ``close(keep_persistent=True)`` would keep every mapping:
        all persistent, and all read since the last ``close`` (the keys read
        are a subset of those open)."""
        return self._transient == 0 and len(self._used) == len(self._open)

    def _keeps(
        self, key: tuple, entry: MappedSegment | CudaMapping, keep_persistent: bool
    ) -> bool:
        return (
            keep_persistent
            and (key in self._used or not self._used)
            and entry.handle.persistent
        )


def mapping_key(handle: BufferHandle) -> tuple:
    """What identifies the buffer a handle names (two handles with one key
    share a mapping)."""
    if isinstance(handle, ShmHandle):
        return ("shm", handle.name, handle.nbytes, handle.persistent)
    return (
        "cuda",
        handle.storage_handle,
        handle.storage_offset_bytes,
        handle.tensor_offset,
        handle.nbytes,
        handle.persistent,
    )


class CudaMapping:
    """A trainer's CUDA allocation mapped into this process (``tensor``: its
    bytes as flat uint8), until ``close()``.

    A persistent allocation stays mapped across updates; each later message
    about it carries a new reference counter from the trainer's export, which
    ``check`` hands to torch (which finds the mapping cached, so opens nothing
    and releases that counter at once)."""

    def __init__(self, handle: CudaIpcHandle, device_index: int) -> None:
        from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
            import_cuda_bytes,
        )

        self.handle = handle
        self.device_index = device_index
        self.tensor: torch.Tensor | None = import_cuda_bytes(handle, device_index)

    def check(self, handle: BufferHandle) -> None:
        assert isinstance(handle, CudaIpcHandle)
        if self.tensor is None:
            raise ValueError("this CUDA mapping was closed")
        counter = (handle.ref_counter_handle, handle.ref_counter_offset)
        if counter == (self.handle.ref_counter_handle, self.handle.ref_counter_offset):
            return
        from vllm.distributed.weight_transfer.buffers.cuda_ipc import (
            import_cuda_bytes,
        )

        # Same allocation, same bytes: torch answers from its cache while
        # self.tensor holds the storage, and releases the new counter.
        self.tensor = import_cuda_bytes(handle, self.device_index)
        self.handle = handle

    def close(self) -> None:
        self.tensor = None


class MappedBuffers(FieldsKey):
    """The buffers a chunk is read from, as a dict key: each one's mapping
    key (which export) and address, hashed once (a message may name
    thousands of buffers: a trainer's adopted parameter storages)."""

    __slots__ = ("addresses",)

    def __init__(
        self, handle_keys: Sequence[Hashable], buffers: Sequence[torch.Tensor]
    ) -> None:
        super().__init__((tuple(handle_keys), tuple(b.data_ptr() for b in buffers)))
        self.addresses = frozenset(self.fields[1])
