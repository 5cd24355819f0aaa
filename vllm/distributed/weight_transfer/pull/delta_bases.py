# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What each side keeps of the chunk bytes last synced, so that the next
sync can move only the elements that changed (``pull.delta`` is the codec).

Producer side, `PublishedBases`: per serve share and chunk, the packed bytes
the producer last served, the sync they were packed in and their ``ws1``
checksum. ``offer`` encodes the delta from those bytes to the ones just
packed into the slot's delta buffer, keeps the new bytes, and returns the
delta's header (None: the chunk is served whole only).

Worker side, `HeldBases`: per chunk of the worker's pull plan, the sync it
last landed and, unless the served tensors hold its bytes, a copy of them. A
chunk whose every slice lands by a copy that keeps its bytes (the planned
landing's direct copies, trainer-side codes) can be read back from the
served tensors (`ReadBack`): the worker keeps no bytes for it
(`ServedBytes`). A chunk landed during a sync replaces its entry at once but
is *pending* (not a base) until the update commits; an update that fails
drops its pending entries, so the next sync pulls those chunks whole.

``land_delta`` is the consumer's step: check the offered delta's base
version against the held entry, read the delta's bytes, and rebuild the new
bytes in the receive buffer: from a kept copy, by applying the delta to it
in place (after checking its checksum against the delta's base) and copying
the result; from the served tensors, by reading them back into the buffer,
checking their checksum there and applying the delta to it. For served bytes
that carry their pieces (a sync landing in the served tensors),
``delta_in_place`` instead checks the delta against the pieces where they
lie and returns it unwritten, for the landing to write there. Any refusal
leaves the caller to read the whole chunk, which the producer still holds.

Both sides keep each copy's ``ws1`` checksum up to date from the changed
elements alone (``apply_delta`` returns it): the producer never checksums a
kept chunk again after its first delta, and a worker's check of the
delta's base is a comparison of two strings (see ``land_delta`` for why the
worker's stored checksum can be trusted).

Both stores are bounded: a chunk that would take a store past its limit is
not kept, and travels whole every sync (a chunk read back from the served
tensors costs the store nothing). The producer keeps its copies where its
serve buffers are (host memory by default, the GPU's with
``serve_device="cuda"``); the worker keeps its copies in host memory. Nothing
here knows a transport or a model.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vllm.distributed.weight_transfer.pull.delta import (
    ChunkDelta,
    DeltaBaseMismatch,
    apply_delta,
    delta_for_pieces,
    encode_delta,
)
from vllm.distributed.weight_transfer.pull.delta_write import PiecesWrite


@dataclass
class KeptBytes:
    """One chunk's bytes as a side last synced them."""

    version: int
    data: torch.Tensor  # uint8, host memory
    digest: str | None = None  # ``ws1`` of ``data``, when known
    pending: bool = False
    # Set by ``land_delta`` once it rebuilt the new bytes in ``data`` and
    # copied them to a receive buffer: that buffer's (device, address,
    # length), which ``HeldBases.record`` then need not copy back.
    copied_to: tuple[torch.device, int, int] | None = None


@dataclass
class ServedBytes:
    """A chunk whose bytes a worker does not keep: the served tensors hold
    them since the sync ``version`` landed it, and ``read_back`` (into a
    buffer of the chunk's size) packs them again. ``pieces``, when a delta
    may be written straight into the served tensors (`HeldBases.base` sets
    it for a sync that lands there): the chunk's slices as they lie in them,
    ``(byte offset in the chunk, uint8 view)``."""

    version: int
    read_back: Callable[[torch.Tensor], None]
    pending: bool = False
    pieces: list[tuple[int, torch.Tensor]] | None = None


class ReadBack(Protocol):
    """Which chunks the served tensors hold byte for byte, and how to pack
    one of them from there (the lander that landed them)."""

    def can_read_back(self, index: int) -> bool: ...

    def read_back(self, index: int, into: torch.Tensor) -> None: ...

    def pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """The chunk's slices in the served tensors, ``(byte offset in the
        chunk, uint8 view)``, when a delta may be written into them there
        (each slice lands in one place, by a copy that keeps its bytes, and
        nothing else of the chunk lands); else None."""
        ...


def _nbytes(entry: KeptBytes | ServedBytes) -> int:
    return entry.data.numel() if isinstance(entry, KeptBytes) else 0


class _BoundedStore:
    """Copies of chunk bytes by key, at most ``limit_bytes`` in all, in host
    memory or (``next_to_data``) on the device of the bytes they copy."""

    next_to_data = False

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"delta base limit is {limit_bytes} bytes; need >= 0")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        # `KeptBytes`; a `HeldBases` also keeps `ServedBytes`.
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def _get(self, key: Hashable) -> Any:
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
            if entry is not None and (
                not isinstance(entry, KeptBytes) or entry.data.numel() != nbytes
            ):
                self.used_bytes -= _nbytes(entry)
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
            entry.copied_to = None
        copy_bytes(entry.data, data)
        return entry

    def _drop(self, keep: Callable[[Hashable, Any], bool]) -> None:
        with self._lock:
            for key in [k for k, e in self._entries.items() if not keep(k, e)]:
                self.used_bytes -= _nbytes(self._entries.pop(key))

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
        entry = self._get(key)
        if (
            isinstance(entry, KeptBytes)
            and entry.data.numel() == packed.numel()
            and entry.data.device == packed.device
        ):
            delta = encode_delta(
                entry.data,
                packed,
                unit=unit,
                base_version=entry.version,
                base_digest=entry.digest,
            )
            if delta is not None:
                header, wire = delta.to_wire()
                out[: wire.numel()].copy_(wire)
                # The kept bytes become the packed ones by the apply a worker
                # runs (a write of the changed elements only), which also
                # yields their checksum without a pass over the chunk.
                kept_digest = apply_delta(
                    entry.data,
                    delta,
                    held_version=entry.version,
                    held_digest=delta.base_digest,
                )
                # With checksums on, the packed bytes' checksum confirms it;
                # were they to differ, the copy below makes the bytes exact.
                if digest is None or digest == kept_digest:
                    with self._lock:
                        entry.version = version
                        entry.digest = kept_digest
                    return header
                kept = self._store(key, packed, version, pending=False)
                if kept is not None:
                    kept.digest = digest
                return header
        kept = self._store(key, packed, version, pending=False)
        if kept is not None:
            # Unknown (checksums off): computed by the next encode that
            # yields a delta, so a chunk that changes all over never pays it.
            kept.digest = digest
        return None

    def forget(self, share: Hashable) -> None:
        """Drop every chunk kept for serve share ``share`` (its plan changed)."""
        self._drop(lambda k, _e: not (isinstance(k, tuple) and k[0] == share))


class HeldBases(_BoundedStore):
    """A worker's last landed bytes per chunk index; see the module
    docstring. ``served``: the chunks to read back from the served tensors
    instead of keeping a copy (None: keep a copy of every chunk)."""

    def __init__(self, limit_bytes: int, served: ReadBack | None = None) -> None:
        super().__init__(limit_bytes)
        self.served = served
        # Whether this sync lands in the served tensors (not in staging), so
        # that a delta to bytes read from there may be written there too.
        self.write_served = False

    def base(self, index: int) -> KeptBytes | ServedBytes | None:
        """Chunk ``index``'s committed bytes, or None; served bytes carry
        their pieces when ``write_served`` and the chunk allows it."""
        entry = self._get(index)
        if entry is None or entry.pending:
            return None
        if isinstance(entry, ServedBytes) and self.write_served and self.served:
            return dataclasses.replace(entry, pieces=self.served.pieces(index))
        return entry

    @property
    def served_chunks(self) -> int:
        """Chunks whose base is read back from the served tensors."""
        with self._lock:
            return sum(isinstance(e, ServedBytes) for e in self._entries.values())

    def record(self, index: int, data: torch.Tensor, version: int | None) -> None:
        """Chunk ``index`` landed ``data`` (its whole bytes) in the sync
        ``version``; a base once the update commits. Without a version the
        entry is dropped: nothing could name it as a base. A chunk that
        ``land_delta`` rebuilt in the held copy and copied to ``data`` is
        not copied back (call this before anything writes ``data``); a chunk
        the served tensors hold keeps no copy at all."""
        if version is None:
            self._drop(lambda k, _e: k != index)
            return
        served = self.served
        if served is not None and served.can_read_back(index):
            self._drop(lambda k, _e: k != index)
            with self._lock:
                self._entries[index] = ServedBytes(
                    version, lambda into: served.read_back(index, into), pending=True
                )
            return
        with self._lock:
            kept = self._entries.get(index)
            if isinstance(kept, KeptBytes) and kept.copied_to == _address(data):
                kept.version = version
                kept.pending = True
                kept.copied_to = None
                return
        if self._store(index, data, version, pending=True) is None:
            self._drop(lambda k, _e: k != index)

    def commit(self) -> None:
        """The update committed: its pending entries become bases. An entry
        rebuilt by ``land_delta`` but never recorded (its pull failed after
        the apply) names no sync and is dropped."""
        self._drop(lambda _k, e: not isinstance(e, KeptBytes) or e.copied_to is None)
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


def land_delta(
    offered: OfferedDelta,
    into: torch.Tensor,
    held: KeptBytes | ServedBytes,
    *,
    checksum: bool = False,
) -> str | None:
    """Make ``into`` (the chunk's receive buffer) hold the chunk's new bytes
    from ``held`` and the ``offered`` delta; ``ValueError`` (a
    ``DeltaBaseMismatch`` when ``held`` is not the delta's base) when it
    cannot, after which ``into`` holds nothing useful and the caller reads
    the whole chunk. Returns the ``ws1`` checksum of the new bytes when it
    is proven without a pass over them (``checksum`` asked for it, and the
    base's checksum was taken from its bytes: served bytes), else None.

    From `ServedBytes`: the delta is read into ``into`` and copied out, the
    served bytes are read back into ``into``, their checksum is checked
    against the delta's base (a served byte changed out of band is refused
    here: one pass over the chunk, the price of keeping no copy), and the
    delta is applied there; the new bytes' checksum follows from that
    checksum and the changed elements, when ``checksum``.

    From `KeptBytes`: the delta is read into ``into`` (as scratch), applied
    to ``held.data`` in place (its changed elements only), and ``held.data``
    copied to ``into``: one pass over the chunk. From the apply on, ``held`` is
    pending (not a base until ``HeldBases.record`` names its sync and the
    update commits; ``discard_pending`` drops it when the update fails).

    ``held.digest``, when known, stands for the checksum of ``held.data``
    without a pass over it. It is trustworthy because only this module
    writes a held copy: ``HeldBases`` copies whole chunks in (and forgets
    the digest), and this function writes the changed elements and sets the
    digest that follows from them (``apply_delta`` returns it). An unknown
    digest is computed from the bytes by the apply. A served byte changed out
    of band does not touch the held copy, and the whole rebuilt chunk lands
    over the served bytes anyway; with payload checksums on, the caller
    also checks the rebuilt chunk against the producer's checksum."""
    delta = _read_delta(offered, into, held.version)
    if isinstance(held, ServedBytes):
        # The delta is copied out of ``into`` before the served bytes are
        # read back over it.
        delta = delta.on(into.device, copy=True)
        held.read_back(into)
        return apply_delta(
            into, delta, held_version=held.version, checksum_after=checksum
        )
    delta = delta.on(held.data.device)
    held.copied_to = None
    digest = apply_delta(
        held.data, delta, held_version=held.version, held_digest=held.digest
    )
    held.pending = True
    held.digest = digest
    copy_bytes(into, held.data)
    held.copied_to = _address(into)
    # (The checksum carried here stands on the stored one: not a proof.)
    return None


def delta_in_place(
    offered: OfferedDelta,
    scratch: torch.Tensor,
    held: ServedBytes,
    *,
    checksum: bool = False,
) -> PiecesWrite:
    """The ``offered`` delta checked against the served bytes it applies to
    (``held.pieces``: their checksum taken where they lie, every position
    inside a slice) and ready to write into them (`PiecesWrite.write`), which
    the landing does after its own checks; nothing is written here. The
    delta's bytes are read into ``scratch`` (the chunk's receive buffer, of
    the chunk's size), which must stay untouched until the write; a delta
    for a chunk of another size is refused. ``checksum``: the result
    carries the chunk's ``ws1`` after the write (from the base's and the
    changed elements: proven). ``ValueError`` (a ``DeltaBaseMismatch`` when
    the served bytes are not the delta's base) leaves the caller to read
    the whole chunk, as `land_delta` does."""
    if held.pieces is None:
        raise ValueError("delta_in_place: the served bytes have no pieces")
    delta = _read_delta(offered, scratch, held.version)
    return delta_for_pieces(
        held.pieces,
        delta,
        nbytes=scratch.numel(),
        held_version=held.version,
        checksum_after=checksum,
    )


def _read_delta(offered: OfferedDelta, into: torch.Tensor, version: int) -> ChunkDelta:
    """The offered delta, its version checked against the held ``version``
    and its size against the chunk's (``into``, where its bytes are read)."""
    header = offered.header
    base_version = header.get("base_version") if isinstance(header, dict) else None
    if base_version != version:
        raise DeltaBaseMismatch(
            f"delta.base_version is {base_version!r} but this worker holds the "
            f"chunk of sync {version}"
        )
    if not 0 <= offered.nbytes < into.numel():
        raise ValueError(
            f"the producer offered a delta of {offered.nbytes} bytes for a chunk "
            f"of {into.numel()}: a delta must be smaller than its chunk"
        )
    if offered.nbytes:  # (nothing changed: an empty delta)
        offered.read_into(into[: offered.nbytes])
    return ChunkDelta.from_wire(header, into[: offered.nbytes])


def forget_rebuilt(held: KeptBytes | ServedBytes) -> None:
    """``land_delta`` rebuilt ``held`` but the result was refused (its
    checksum is not the producer's): its bytes and digest are not to be
    trusted, and the whole chunk ``HeldBases.record`` copies in next
    replaces them. (Nothing to forget of served bytes: nothing was kept.)"""
    if isinstance(held, ServedBytes):
        return
    held.copied_to = None
    held.digest = None
    held.pending = True


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two uint8 tensors of one length; between two
    host tensors through numpy's one-thread copy, which ran at about twice
    the speed of torch's pooled copy on this loaded 2-core host."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _address(t: torch.Tensor) -> tuple[torch.device, int, int]:
    return (t.device, t.data_ptr(), t.numel())
