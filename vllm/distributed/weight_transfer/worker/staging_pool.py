# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staging buffers a worker keeps from one staged update to the next.

A staged update (``staged_update``) copies every byte it receives into
staging. Allocating that staging anew for every update makes the copy pay
for fresh memory: on a host, every page is faulted in at its first write,
and inside a serving vLLM CPU worker those faults cost several times the
copy itself (``docs/training/weight_transfer/transactional.md``, "Why they
are slow there"); on CUDA, pinned host staging is registered with the driver
again each time. The shapes a trainer sends repeat from one sync to the next,
so the worker keeps the buffers of its last committed update and hands them
out again, in the order they were taken, to the next update's tensors of the
same shape, dtype and placement. Every buffer handed out is overwritten
whole by the staging copy, so what it held before does not matter.

The rules:

* ``take`` returns one of the last update's buffers of that kind, or
  ``None``; ``allocate`` makes a new one. Both count it as this update's.
* ``end_update(served)`` after a commit: this update's buffers become the
  ones to reuse, the last update's buffers it did not take are freed, and a
  buffer whose memory something else still uses is never handed out again:
  a served tensor (a loader that kept the staged tensor instead of copying
  it), or any other tensor or view of it still alive (a kernel handle that
  kept one, say; counted on the buffer's storage where PyTorch tells).
* ``drop()`` after an abort or a failed commit, and at shutdown: every buffer
  is freed, so a failed sync leaves nothing behind.

Between updates the pool holds at most one update's staging
(``reserved_bytes``): the memory ``WeightTransferConfig.staging`` asks for
anyway, kept instead of returned.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Iterable

import torch

# What makes two buffers interchangeable.
BufferKind = tuple[tuple[int, ...], torch.dtype, torch.device, bool]


def buffer_kind(
    shape: Iterable[int], dtype: torch.dtype, device: torch.device, pinned: bool
) -> BufferKind:
    return (tuple(int(n) for n in shape), dtype, device, pinned)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


class StagingPool:
    """See the module docstring. Safe to use from the engine's thread and a
    staged update's background pull at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The last committed update's buffers not taken yet, per kind, in the
        # order that update took them.
        self._reusable: dict[BufferKind, deque[torch.Tensor]] = defaultdict(deque)
        # Buffers the open update took, in order, with their kinds.
        self._taken: list[tuple[BufferKind, torch.Tensor]] = []
        # Buffers handed out again across this pool's life, and buffers a
        # commit left in use elsewhere, so never handed out again.
        self.reuses = 0
        self.held_back = 0

    def _kept_bytes(self) -> int:
        """Bytes of the kept buffers not taken yet (the lock held)."""
        return sum(_nbytes(b) for queue in self._reusable.values() for b in queue)

    @property
    def reusable_bytes(self) -> int:
        """Bytes kept from the last update that the open one has not taken."""
        with self._lock:
            return self._kept_bytes()

    @property
    def reserved_bytes(self) -> int:
        """Every byte the pool holds: kept and taken."""
        with self._lock:
            return self._kept_bytes() + sum(_nbytes(b) for _, b in self._taken)

    def take(self, kind: BufferKind) -> torch.Tensor | None:
        """One of the last update's buffers of ``kind``, now this update's;
        ``None`` when none is left."""
        with self._lock:
            queue = self._reusable.get(kind)
            if not queue:
                return None
            buffer = queue.popleft()
            self._taken.append((kind, buffer))
            self.reuses += 1
            return buffer

    def allocate(self, kind: BufferKind) -> torch.Tensor:
        """A new buffer of ``kind``, counted as this update's."""
        shape, dtype, device, pinned = kind
        buffer = torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)
        with self._lock:
            self._taken.append((kind, buffer))
        return buffer

    def release_reusable(self) -> None:
        """Free the kept buffers the open update has not taken (when staging
        would not fit otherwise)."""
        with self._lock:
            self._reusable.clear()

    def end_update(self, served: Iterable[torch.Tensor]) -> None:
        """The open update committed: keep its buffers for the next one,
        except any whose memory a tensor of ``served`` uses, or that any
        other tensor still refers to."""
        # A served tensor that is the buffer itself is also counted by
        # ``_held_elsewhere``; the pointer check is what remains on a PyTorch
        # build that does not expose the storage's use count.
        in_use = {t.untyped_storage().data_ptr() for t in served}
        with self._lock:
            taken, self._taken = self._taken, []
            self._reusable.clear()
            for kind, buffer in taken:
                if buffer.untyped_storage().data_ptr() in in_use or _held_elsewhere(
                    buffer
                ):
                    self.held_back += 1
                    continue
                self._reusable[kind].append(buffer)

    def drop(self) -> None:
        """Free every buffer, kept or taken."""
        with self._lock:
            self._reusable.clear()
            self._taken = []


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than ``buffer`` itself (a view, a tensor a
    kernel handle keeps) still refers to its memory. PyTorch counts the
    references to a storage; this reads that count where the build exposes
    it, and answers False where it does not."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = buffer.untyped_storage()
    # ``buffer`` and the ``storage`` object just made hold one each.
    return int(use_count(storage._cdata)) > 2


def served_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers a model serves from."""
    return [*model.parameters(), *model.buffers()]
