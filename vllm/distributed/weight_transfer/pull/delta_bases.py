# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What each side keeps of the chunk bytes last synced, so that the next
sync can move only the elements that changed (``pull.delta`` is the codec).

Producer side, `PublishedBases`: per serve share and chunk, the packed bytes
the producer last served, the sync they were packed in and their ``ws1``
checksum. ``offer`` encodes the delta from those bytes to the ones just
packed into the slot's delta buffer, keeps the new bytes, and returns the
delta's header (None: the chunk is served whole only).

Worker side, `HeldBases`: per chunk of the worker's pull plan, the bytes it
last landed and the sync they came from. A chunk landed during a sync
replaces its entry at once but is *pending* (not a base) until the update
commits; an update that fails drops its pending entries, so the next sync
pulls those chunks whole.

``land_delta`` is the consumer's step: check the offered delta's base
version against the held entry, read the delta's bytes, put the held bytes
in the receive buffer and apply the delta there, which checks the held
bytes' checksum against the delta's base first. Any refusal leaves the
caller to read the whole chunk, which the producer still holds.

Both stores are bounded: a chunk that would take a store past its limit is
not kept, and travels whole every sync. The producer keeps its copies where
its serve buffers are (host memory by default, the GPU's with
``serve_device="cuda"``); the worker keeps its copies in host memory. Nothing
here knows a transport or a model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.pull.delta import (
    ChunkDelta,
    DeltaBaseMismatch,
    apply_delta,
    encode_delta,
)


@dataclass
class KeptBytes:
    """One chunk's bytes as a side last synced them."""

    version: int
    data: torch.Tensor  # uint8, host memory
    digest: str | None = None  # ``ws1`` of ``data``, when known
    pending: bool = False


class _BoundedStore:
    """Copies of chunk bytes by key, at most ``limit_bytes`` in all, in host
    memory or (``next_to_data``) on the device of the bytes they copy."""

    next_to_data = False

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"delta base limit is {limit_bytes} bytes; need >= 0")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._entries: dict[Hashable, KeptBytes] = {}
        self._lock = threading.Lock()

    def _get(self, key: Hashable) -> KeptBytes | None:
        with self._lock:
            return self._entries.get(key)

    def _store(
        self, key: Hashable, data: torch.Tensor, version: int, *, pending: bool
    ) -> KeptBytes | None:
        """Copy ``data`` into ``key``'s entry (made when the limit allows) as
        version ``version``; the entry, or None when it is not kept."""
        nbytes = data.numel()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.data.numel() != nbytes:
                self.used_bytes -= entry.data.numel()
                del self._entries[key]
                entry = None
            if entry is None:
                if self.used_bytes + nbytes > self.limit_bytes:
                    return None
                where = data.device if self.next_to_data else "cpu"
                entry = KeptBytes(
                    version, torch.empty(nbytes, dtype=torch.uint8, device=where)
                )
                self._entries[key] = entry
                self.used_bytes += nbytes
            entry.version = version
            entry.pending = pending
            entry.digest = None
        entry.data.copy_(data)
        return entry

    def _drop(self, keep: Callable[[Hashable, KeptBytes], bool]) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if not keep(k, e)]:
                self.used_bytes -= self._entries.pop(key).data.numel()

    def clear(self) -> None:
        self._drop(lambda _k, _e: False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class PublishedBases(_BoundedStore):
    """A producer's last served bytes per ``(share, seq)``, kept where its
    serve buffers are (a GPU's memory for a producer serving from the GPU:
    comparing there runs at device speed, where a copy to the host and a
    comparison on its cores would cost more than the wire saves); see the
    module docstring."""

    next_to_data = True

    def offer(
        self,
        key: Hashable,
        packed: torch.Tensor,
        version: int,
        out: torch.Tensor,
        *,
        unit: int,
        digest: str | None = None,
    ) -> dict[str, Any] | None:
        """Encode the delta from the kept bytes of ``key`` to ``packed`` (the
        chunk just packed for sync ``version``) into ``out``, keep ``packed``
        as the new base, and return the delta's wire header; None when
        nothing was kept for ``key``, or the delta would be no smaller than
        the chunk. ``digest`` is ``packed``'s ``ws1`` checksum, if known."""
        new = packed
        entry = self._get(key)
        header = None
        if (
            entry is not None
            and entry.data.numel() == new.numel()
            and entry.data.device == new.device
        ):
            delta = encode_delta(
                entry.data,
                new,
                unit=unit,
                base_version=entry.version,
                base_digest=entry.digest,
            )
            if delta is not None:
                header, wire = delta.to_wire()
                out[: wire.numel()].copy_(wire)
        kept = self._store(key, new, version, pending=False)
        if kept is not None:
            # Unknown (checksums off): computed by the next encode that
            # yields a delta, so a chunk that changes all over never pays it.
            kept.digest = digest
        return header

    def forget(self, share: Hashable) -> None:
        """Drop every chunk kept for serve share ``share`` (its plan changed)."""
        self._drop(lambda k, _e: not (isinstance(k, tuple) and k[0] == share))


class HeldBases(_BoundedStore):
    """A worker's last landed bytes per chunk index; see the module
    docstring."""

    def base(self, index: int) -> KeptBytes | None:
        """Chunk ``index``'s committed bytes, or None."""
        entry = self._get(index)
        return None if entry is None or entry.pending else entry

    def record(self, index: int, data: torch.Tensor, version: int | None) -> None:
        """Chunk ``index`` landed ``data`` (its whole bytes) in the sync
        ``version``; a base once the update commits. Without a version the
        entry is dropped: nothing could name it as a base."""
        if version is None:
            self._drop(lambda k, _e: k != index)
            return
        if self._store(index, data, version, pending=True) is None:
            self._drop(lambda k, _e: k != index)

    def commit(self) -> None:
        """The update committed: its pending entries become bases."""
        with self._lock:
            for entry in self._entries.values():
                entry.pending = False

    def discard_pending(self) -> None:
        """The update failed: what it landed is not what serves."""
        self._drop(lambda _k, e: not e.pending)


@dataclass(frozen=True)
class OfferedDelta:
    """A producer's delta for a chunk: its wire header, its byte count, and
    how to read its bytes into the consumer's buffer."""

    header: object
    nbytes: int
    read_into: Callable[[torch.Tensor], object]


def land_delta(offered: OfferedDelta, into: torch.Tensor, held: KeptBytes) -> None:
    """Make ``into`` (the chunk's receive buffer) hold the chunk's new bytes
    from ``held`` and the ``offered`` delta; ``ValueError`` (a
    ``DeltaBaseMismatch`` when ``held`` is not the delta's base) when it
    cannot, after which ``into`` holds nothing useful and the caller reads
    the whole chunk."""
    header = offered.header
    base_version = header.get("base_version") if isinstance(header, dict) else None
    if base_version != held.version:
        raise DeltaBaseMismatch(
            f"delta.base_version is {base_version!r} but this worker holds the "
            f"chunk of sync {held.version}"
        )
    if not 0 <= offered.nbytes < into.numel():
        raise ValueError(
            f"the producer offered a delta of {offered.nbytes} bytes for a chunk "
            f"of {into.numel()}: a delta must be smaller than its chunk"
        )
    if offered.nbytes:  # (nothing changed: an empty delta)
        offered.read_into(into[: offered.nbytes])
    wire = ChunkDelta.from_wire(header, into[: offered.nbytes])
    # The parsed delta views the receive buffer, which the held bytes fill
    # next: keep its positions and values apart first.
    delta = ChunkDelta(
        base_version=wire.base_version,
        base_digest=wire.base_digest,
        nbytes=wire.nbytes,
        unit=wire.unit,
        positions=wire.positions.clone(),
        values=wire.values.clone(),
    )
    into.copy_(held.data)
    apply_delta(into, delta, held_version=held.version)
