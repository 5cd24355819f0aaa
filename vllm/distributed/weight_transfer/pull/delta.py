# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A chunk's changed elements only: encode, check, apply, and the wire form.

A chunk is a contiguous byte range (``nbytes``) read as elements of ``unit``
bytes (1, 2, 4 or 8: the itemsize of the chunk's dtype). A ``ChunkDelta``
turns one version of those bytes (the *base*) into the next: the sorted,
unique positions of the elements that differ, and their new values as bit
patterns (an integer dtype of the unit's size, so NaN payloads and -0.0 travel
exactly). It names the base it applies to by version and by the ``ws1``
checksum of the base bytes (``verification.checksum``).

Invariant: ``apply_delta`` writes into its target only after every check has
passed, so a refused delta leaves the target byte for byte as it was. Refusals
are ``ValueError``s that name the field; ``DeltaBaseMismatch`` (a
``ValueError``) says the target does not hold the delta's base, and the
caller should take the whole chunk instead.

The three steps::

    delta = encode_delta(base, new, unit=2, base_version=v)  # None: send whole
    header, buffer = delta.to_wire()
    ... the header (JSON) and the buffer (bytes) travel ...
    delta = ChunkDelta.from_wire(header, buffer)  # checked on parse
    digest = apply_delta(target, delta, held_version=v)  # checked, written
    # digest: the target's ws1 checksum after the write, from its base's
    # checksum and the changed elements alone

Encoding size: ``count * (position bytes + unit)``, position bytes being 4
(int32) when the chunk has at most 2**31 elements, else 8. ``encode_delta``
returns None when the whole chunk is no larger; a delta at least as large as
its chunk is refused everywhere as oversized. Positions and values (rather
than a bitmap) keep the apply to one vectorized index write whose cost
follows the number of changed elements, not the chunk's size.

Plain data and torch only: nothing here knows who serves or lands a chunk.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.pull.delta_write import (
    PiecesWrite,
    plan_pieces_write,
    write_changes,
)
from vllm.distributed.weight_transfer.verification.checksum import (
    ALGORITHM,
    payload_checksum,
    pieces_checksum,
)

WIRE_FORMAT = 1
# Element size in bytes -> the integer dtype that carries its bit patterns.
VALUE_DTYPES: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
# The values start at a multiple of this offset in the wire buffer, so both
# parts can be viewed in place whatever the unit.
WIRE_ALIGN = 16
# Bytes compared per pass while encoding: on CPU a slab stays in cache;
# elsewhere one pass over the chunk is cheapest (each pass synchronizes once).
CPU_SLAB_BYTES = 1024 * 1024
# On CPU the comparison runs through numpy on the tensors' memory: its
# single-threaded loops run a 1 GB chunk at 2-3 GB/s on one core, where torch's
# thread pool stalls on a loaded host (both cores busy) and ran the same
# slabs at about 0.5 GB/s (``benchmarks/weight_transfer/bench_delta_codec.py``).
_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
DEVICE_SLAB_BYTES = 1024 * 1024 * 1024
# A chunk larger than one slab first has its leading bytes compared element by
# element, up to this many: a chunk changed all over is sent whole after that
# short pass. Probing a whole device slab cost as much as the encode itself
# (Qwen3-30B-A3B's 1.25 GB layer chunks encoded at 0.21 TB/s on an H100,
# against 0.69 TB/s for a 1 GiB chunk, which needs no probe).
PROBE_BYTES = 64 * 1024 * 1024
_INT32_ELEMENTS = 2**31
# A slab with more than 1 in this many words changed is compared element by
# element (for bf16: above about 3% of the elements changed).
_DENSE_WORDS = 8
_DIGEST_RE = re.compile(rf"{ALGORITHM}:([0-9]+):[0-9a-f]{{16}}")
_HEADER_FIELDS = (
    "format",
    "base_version",
    "base_digest",
    "nbytes",
    "unit",
    "count",
    "positions_dtype",
    "values_offset",
    "buffer_nbytes",
)


class DeltaBaseMismatch(ValueError):
    """The target does not hold the bytes a delta applies to: take the whole
    chunk instead."""


def positions_dtype(nbytes: int, unit: int) -> torch.dtype:
    """The dtype of a delta's positions for a chunk of ``nbytes`` bytes:
    int32 when every element index fits, else int64."""
    return torch.int32 if nbytes // unit <= _INT32_ELEMENTS else torch.int64


def encoded_nbytes(count: int, nbytes: int, unit: int) -> int:
    """Bytes of a delta with ``count`` changed elements (positions and values)."""
    return count * (positions_dtype(nbytes, unit).itemsize + unit)


@dataclass(frozen=True, eq=False)
class ChunkDelta:
    """The changed elements of one chunk against the base it applies to.

    ``positions`` are element indices (units, not bytes), strictly increasing;
    ``values[i]`` is the new bit pattern of element ``positions[i]``. Both are
    1-D, contiguous and on one device. Construction checks the fields' types,
    sizes and agreement (no pass over the tensors); ``check_delta`` also checks
    the positions themselves and the base.
    """

    base_version: int
    base_digest: str
    nbytes: int
    unit: int
    positions: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        _check_structure(self)

    @property
    def count(self) -> int:
        """How many elements change."""
        return self.positions.numel()

    @property
    def encoded_nbytes(self) -> int:
        """Bytes of positions and values (what the whole chunk is weighed
        against)."""
        return self.positions.nbytes + self.values.nbytes

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def on(self, device: torch.device, *, copy: bool = False) -> ChunkDelta:
        """This delta with its positions and values on ``device``; ``copy``:
        in memory of their own even there (a delta parsed in place from a
        buffer about to be overwritten)."""
        if device == self.device and not copy:
            return self
        return dataclasses.replace(
            self,
            positions=self.positions.to(device, copy=copy),
            values=self.values.to(device, copy=copy),
        )

    def to_wire(self) -> tuple[dict[str, Any], torch.Tensor]:
        """A JSON-safe header and one flat uint8 buffer on the delta's device:
        the positions at offset 0, the values at ``header["values_offset"]``
        (zero padding between)."""
        values_offset = _values_offset(self.positions.nbytes)
        buffer = torch.zeros(
            values_offset + self.values.nbytes, dtype=torch.uint8, device=self.device
        )
        buffer[: self.positions.nbytes].copy_(self.positions.view(torch.uint8))
        buffer[values_offset:].copy_(self.values.view(torch.uint8))
        header = {
            "format": WIRE_FORMAT,
            "base_version": self.base_version,
            "base_digest": self.base_digest,
            "nbytes": self.nbytes,
            "unit": self.unit,
            "count": self.count,
            "positions_dtype": dtype_name(self.positions.dtype),
            "values_offset": values_offset,
            "buffer_nbytes": buffer.numel(),
        }
        return header, buffer

    @classmethod
    def from_wire(
        cls, header: object, buffer: torch.Tensor | bytes | bytearray | memoryview
    ) -> ChunkDelta:
        """The delta a ``to_wire`` header and buffer describe, after every
        check ``check_delta`` makes that needs no target. The positions and
        values are views into ``buffer`` (a copy if it is a bytes object or
        not 16-byte aligned)."""
        h = check_fields(header, _HEADER_FIELDS, _HEADER_FIELDS, "delta header")
        if check_int(h["format"], "delta.format") != WIRE_FORMAT:
            raise ValueError(
                f"delta.format is {h['format']!r}; this reader knows {WIRE_FORMAT}"
            )
        nbytes = check_int(h["nbytes"], "delta.nbytes", minimum=1)
        unit = _check_unit(h["unit"], nbytes)
        count = check_int(h["count"], "delta.count")
        _check_not_oversized(count, nbytes, unit, "delta.count")
        pos_dtype = dtype_from_name(h["positions_dtype"], "delta.positions_dtype")
        if pos_dtype != positions_dtype(nbytes, unit):
            raise ValueError(
                f"delta.positions_dtype is {h['positions_dtype']!r} but a chunk of "
                f"{nbytes // unit} elements takes "
                f"{dtype_name(positions_dtype(nbytes, unit))}"
            )
        positions_nbytes = count * pos_dtype.itemsize
        values_offset = _values_offset(positions_nbytes)
        for name, want in (
            ("values_offset", values_offset),
            ("buffer_nbytes", values_offset + count * unit),
        ):
            got = check_int(h[name], f"delta.{name}")
            if got != want:
                raise ValueError(
                    f"delta.{name} is {got} but delta.count={count} positions of "
                    f"{dtype_name(pos_dtype)} and values of {unit} bytes make {want}"
                )
        buf = _as_flat_bytes(buffer)
        if buf.numel() != values_offset + count * unit:
            raise ValueError(
                f"delta.buffer has {buf.numel()} bytes but the header says "
                f"{values_offset + count * unit}: a partial or overlong buffer"
            )
        delta = cls(
            base_version=h["base_version"],
            base_digest=h["base_digest"],
            nbytes=nbytes,
            unit=unit,
            positions=buf[:positions_nbytes].view(pos_dtype),
            values=buf[values_offset:].view(VALUE_DTYPES[unit]),
        )
        _check_positions(delta)
        return delta


def encode_delta(
    base: torch.Tensor,
    new: torch.Tensor,
    *,
    unit: int,
    base_version: int,
    base_digest: str | None = None,
) -> ChunkDelta | None:
    """The delta from ``base`` to ``new`` (1-D contiguous uint8 tensors of one
    length on one device), or None when the whole chunk is no larger than the
    delta. ``base_digest`` is the ``ws1`` checksum of ``base``, computed here
    when not given. Elements are compared as bit patterns, 8 bytes at a time
    where the chunk allows it (then the changed words, element by element), a
    slab at a time, stopping as soon as the delta outgrows the chunk, or
    as soon as the slabs compared so far, projected over the chunk, make it
    outgrow the chunk (then None, though a delta whose changes crowd into
    the first slabs might have fit)."""
    for name, t in (("base", base), ("new", new)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"encode_delta: {name} must be a 1-D contiguous uint8 tensor, got "
                f"dtype {t.dtype}, shape {tuple(t.shape)}"
            )
    if base.numel() != new.numel() or base.device != new.device:
        raise ValueError(
            f"encode_delta: base ({base.numel()} bytes on {base.device}) and new "
            f"({new.numel()} bytes on {new.device}) must match in length and device"
        )
    nbytes = base.numel()
    if nbytes == 0:
        return None
    unit = _check_unit(unit, nbytes)
    value_dtype = VALUE_DTYPES[unit]
    pos_dtype = positions_dtype(nbytes, unit)
    cost = pos_dtype.itemsize + unit  # encoded bytes per changed element
    # Words of 8 bytes (``lanes`` elements each) when both chunks allow it:
    # comparing and finding the changed ones is then several times cheaper.
    wide = nbytes % 8 == 0 and base.data_ptr() % 8 == 0 and new.data_ptr() % 8 == 0
    word_dtype = torch.int64 if wide else value_dtype
    lanes = word_dtype.itemsize // unit
    _view_units(base, word_dtype, "base")
    _view_units(new, word_dtype, "new")
    ops: _Ops = _NumpyOps() if base.device.type == "cpu" else _TorchOps()
    old_words = ops.view(ops.array(base), word_dtype)
    new_words = ops.view(ops.array(new), word_dtype)
    slab_bytes = CPU_SLAB_BYTES if base.device.type == "cpu" else DEVICE_SLAB_BYTES
    slab = max(1, slab_bytes // word_dtype.itemsize)
    positions: list[Any] = []
    values: list[Any] = []
    count = 0
    total_words = len(old_words)
    if slab < total_words:
        # Probe: the leading words' changed elements, counted without listing
        # them; a chunk changed all over is sent whole after this short pass.
        probed = min(slab, max(1, PROBE_BYTES // word_dtype.itemsize))
        old_elems = ops.view(old_words[:probed], value_dtype)
        new_elems = ops.view(new_words[:probed], value_dtype)
        changed_there = ops.count(old_elems != new_elems)
        if _outgrows(changed_there * cost, nbytes, probed, total_words):
            return None
    mask = ops.mask(min(slab, total_words), base.device)
    for start in range(0, total_words, slab):
        stale, fresh = old_words[start : start + slab], new_words[start : start + slab]
        words = ops.nonzero(ops.ne(stale, fresh, mask[: len(stale)]))
        # Each changed word holds at least one changed element.
        seen = min(start + slab, total_words)
        if _outgrows((count + len(words)) * cost, nbytes, seen, total_words):
            return None
        if not len(words):
            continue
        if lanes == 1:
            changed, index = fresh[words], words + start
        elif len(words) * _DENSE_WORDS > len(fresh):
            # Many words changed: comparing the slab element by element is
            # cheaper than picking the changed words' elements.
            new_elems = ops.view(fresh, value_dtype)
            hits = ops.nonzero(ops.view(stale, value_dtype) != new_elems)
            changed, index = new_elems[hits], hits + start * lanes
        else:
            # The changed words' elements, compared one by one: ``hits`` are
            # indices into the flattened ``[changed words, lanes]`` grid.
            new_lanes = ops.view(fresh[words], value_dtype)
            old_lanes = ops.view(stale[words], value_dtype)
            hits = ops.nonzero(old_lanes != new_lanes)
            changed = new_lanes[hits]
            index = (words[hits // lanes] + start) * lanes + hits % lanes
        count += len(changed)
        if _outgrows(count * cost, nbytes, seen, total_words):
            return None
        values.append(changed)
        positions.append(ops.cast(index, pos_dtype))
    if base_digest is None:
        base_digest = payload_checksum(base)
    return ChunkDelta(
        base_version=base_version,
        base_digest=base_digest,
        nbytes=nbytes,
        unit=unit,
        positions=ops.joined(positions, pos_dtype, base.device),
        values=ops.joined(values, value_dtype, base.device),
    )


class _Ops:
    """The array operations ``encode_delta`` runs a slab through, on one kind
    of array (numpy's for a CPU chunk, torch's elsewhere); indexing,
    comparisons and integer arithmetic are written the same for both."""

    def array(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def view(self, a: Any, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def mask(self, n: int, device: torch.device) -> Any:
        raise NotImplementedError

    def ne(self, a: Any, b: Any, out: Any) -> Any:
        raise NotImplementedError

    def nonzero(self, mask: Any) -> Any:
        raise NotImplementedError

    def count(self, mask: Any) -> int:
        raise NotImplementedError

    def cast(self, a: Any, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def joined(
        self, parts: list[Any], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        raise NotImplementedError


class _NumpyOps(_Ops):
    def array(self, t: torch.Tensor) -> Any:
        return t.numpy()

    def view(self, a: Any, dtype: torch.dtype) -> Any:
        return a.view(_NUMPY_DTYPES[dtype])

    def mask(self, n: int, device: torch.device) -> Any:
        return np.empty(n, dtype=np.bool_)

    def ne(self, a: Any, b: Any, out: Any) -> Any:
        return np.not_equal(a, b, out=out)

    def nonzero(self, mask: Any) -> Any:
        return np.flatnonzero(mask)

    def count(self, mask: Any) -> int:
        return int(np.count_nonzero(mask))

    def cast(self, a: Any, dtype: torch.dtype) -> Any:
        return a.astype(_NUMPY_DTYPES[dtype], copy=False)

    def joined(
        self, parts: list[Any], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if not parts:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))


class _TorchOps(_Ops):
    def array(self, t: torch.Tensor) -> Any:
        return t

    def view(self, a: Any, dtype: torch.dtype) -> Any:
        return a.view(dtype)

    def mask(self, n: int, device: torch.device) -> Any:
        return torch.empty(n, dtype=torch.bool, device=device)

    def ne(self, a: Any, b: Any, out: Any) -> Any:
        return torch.ne(a, b, out=out)

    def nonzero(self, mask: Any) -> Any:
        return torch.nonzero(mask).view(-1)

    def count(self, mask: Any) -> int:
        return int(mask.sum())

    def cast(self, a: Any, dtype: torch.dtype) -> Any:
        return a.to(dtype)

    def joined(
        self, parts: list[Any], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _cat(parts, dtype, device)


def _outgrows(encoded: int, nbytes: int, seen: int, total: int) -> bool:
    """Whether a delta already ``encoded`` bytes long after comparing
    ``seen`` of the chunk's ``total`` words is not worth finishing: it is
    no smaller than the chunk, or projected over the whole chunk it would be
    (sending whole is always exact; the projection bounds the cost of a
    chunk that changed all over, at the price of sending whole a chunk whose
    changes crowd into its first slabs)."""
    return encoded >= nbytes or (seen < total and encoded * total >= nbytes * seen)


def check_delta(
    delta: ChunkDelta,
    *,
    target_nbytes: int,
    held_version: int,
    held_digest: str,
) -> None:
    """Refuse ``delta`` (``ValueError`` naming the field) unless it is well
    formed, fits a chunk of ``target_nbytes`` bytes, and applies to what the
    target holds: version ``held_version`` with checksum ``held_digest``
    (``DeltaBaseMismatch`` otherwise). Reads the positions once; writes
    nothing."""
    _check_structure(delta)
    if delta.nbytes != target_nbytes:
        raise ValueError(
            f"delta.nbytes is {delta.nbytes} but the target chunk has "
            f"{target_nbytes} bytes"
        )
    _check_positions(delta)
    _check_base(delta, held_version, held_digest)


def apply_delta(
    target: torch.Tensor,
    delta: ChunkDelta,
    *,
    held_version: int,
    held_digest: str | None = None,
    checksum_after: bool = True,
) -> str | None:
    """Write ``delta`` into ``target`` (the chunk's bytes: a 1-D contiguous
    uint8 tensor on the delta's device) in place, after ``check_delta``, and
    return the ``ws1`` checksum of ``target`` after the write.
    ``held_digest`` is the checksum of the bytes the caller believes
    ``target`` holds; None computes it from ``target`` (one more pass over the
    chunk, which also catches bytes changed out of band). The checksum
    returned follows from the base's and the changed words alone
    (`checksum_after_change`): it is exact when ``target`` held the bytes
    ``held_digest`` names. ``checksum_after=False``: the caller has no use
    for it; only the values are written, and None is returned. On any
    refusal the target is unchanged."""
    if target.dtype != torch.uint8 or target.dim() != 1 or not target.is_contiguous():
        raise ValueError(
            f"apply_delta: target must be a 1-D contiguous uint8 tensor, got dtype "
            f"{target.dtype}, shape {tuple(target.shape)}"
        )
    if target.device != delta.device:
        raise ValueError(
            f"delta.positions are on {delta.device} but the target is on "
            f"{target.device}"
        )
    # Cheap checks first: the digest of the target is a pass over the chunk.
    _check_structure(delta)
    if delta.nbytes != target.numel():
        raise ValueError(
            f"delta.nbytes is {delta.nbytes} but the target chunk has "
            f"{target.numel()} bytes"
        )
    words = _view_units(target, VALUE_DTYPES[delta.unit], "target")
    _check_positions(delta)
    _check_base(delta, held_version, held_digest)
    if held_digest is None:
        _check_base(delta, held_version, payload_checksum(target))
    if not delta.count:
        return delta.base_digest if checksum_after else None
    return write_changes(
        words,
        delta.positions,
        delta.values,
        unit=delta.unit,
        base_digest=delta.base_digest if checksum_after else None,
    )


def delta_for_pieces(
    pieces: list[tuple[int, torch.Tensor]],
    delta: ChunkDelta,
    *,
    nbytes: int,
    held_version: int,
    checksum_after: bool = True,
) -> PiecesWrite:
    """``delta`` checked against a chunk of ``nbytes`` bytes which are not in
    one buffer but in ``pieces`` (``(byte offset in the chunk, 1-D
    contiguous uint8 tensor)``, in offset order; the bytes between and after
    them are the chunk's zero padding), and split over them, ready to write
    (`PiecesWrite.write`). Everything ``apply_delta`` checks is checked
    here, the base's checksum taken from the pieces themselves; a position
    in the padding is refused too (a producer packs zeros there). Nothing is
    written. ``checksum_after``: the result's ``checksum`` is the chunk's
    ``ws1`` after the write, from the base's and the changed elements."""
    _check_structure(delta)
    if delta.nbytes != nbytes:
        raise ValueError(
            f"delta.nbytes is {delta.nbytes} but the target chunk has {nbytes} bytes"
        )
    unit = delta.unit
    for offset, piece in pieces:
        if (
            piece.dtype != torch.uint8
            or piece.dim() != 1
            or not piece.is_contiguous()
            or piece.device != delta.device
            or offset % max(unit, 4)
            or piece.numel() % unit
            or piece.data_ptr() % unit
        ):
            raise ValueError(
                f"delta_for_pieces: the piece at offset {offset} ({piece.numel()} "
                f"bytes of {piece.dtype} on {piece.device}) is not a contiguous, "
                f"{unit}-byte aligned uint8 run on the delta's device"
            )
    _check_positions(delta)
    _check_base(delta, held_version, None)
    _check_base(delta, held_version, pieces_checksum(delta.nbytes, pieces))
    elements = VALUE_DTYPES[unit]
    runs = [(offset // unit, piece.view(elements)) for offset, piece in pieces]
    _check_in_pieces(delta, runs)
    return plan_pieces_write(
        runs,
        delta.positions,
        delta.values,
        unit=unit,
        base_digest=delta.base_digest if checksum_after else None,
    )


# ---------------------------------------------------------------------------
# checks


def _check_unit(unit: object, nbytes: int) -> int:
    if isinstance(unit, bool) or not isinstance(unit, int) or unit not in VALUE_DTYPES:
        raise ValueError(f"delta.unit is {unit!r}; it must be one of 1, 2, 4, 8")
    if nbytes % unit:
        raise ValueError(
            f"delta.unit is {unit} but the chunk's {nbytes} bytes are not a "
            "multiple of it"
        )
    return unit


def _check_not_oversized(count: int, nbytes: int, unit: int, field: str) -> None:
    size = encoded_nbytes(count, nbytes, unit)
    if size >= nbytes:
        raise ValueError(
            f"{field}: {count} changed elements encode to {size} bytes, "
            f"not smaller than the whole chunk ({nbytes} bytes); an oversized "
            "delta is refused: send the whole chunk"
        )


def _check_structure(delta: ChunkDelta) -> None:
    """Types, sizes and agreement of the fields; no pass over the tensors."""
    check_int(delta.base_version, "delta.base_version")
    nbytes = check_int(delta.nbytes, "delta.nbytes", minimum=1)
    unit = _check_unit(delta.unit, nbytes)
    _check_digest(delta.base_digest, nbytes, "delta.base_digest")
    for name, t, want in (
        ("positions", delta.positions, positions_dtype(nbytes, unit)),
        ("values", delta.values, VALUE_DTYPES[unit]),
    ):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"delta.{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != want or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"delta.{name} must be a 1-D contiguous {dtype_name(want)} tensor "
                f"for a chunk of {nbytes} bytes in units of {unit}, got dtype "
                f"{dtype_name(t.dtype)}, shape {tuple(t.shape)}"
            )
    if delta.values.numel() != delta.positions.numel():
        raise ValueError(
            f"delta.values has {delta.values.numel()} entries but delta.positions "
            f"has {delta.positions.numel()}"
        )
    if delta.values.device != delta.positions.device:
        raise ValueError(
            f"delta.values are on {delta.values.device} but delta.positions are "
            f"on {delta.positions.device}"
        )
    _check_not_oversized(delta.positions.numel(), nbytes, unit, "delta.positions")


def _check_positions(delta: ChunkDelta) -> None:
    """Every position in ``0 .. nbytes // unit - 1``, strictly increasing
    (sorted, no duplicates). One synchronization when they are; the
    offending index is then found by a second look."""
    p = delta.positions
    if p.numel() == 0:
        return
    elements = delta.nbytes // delta.unit
    later, earlier = p[1:], p[:-1]
    # Strictly increasing positions have their least first and greatest last.
    first, last, not_increasing = torch.stack(
        [p[0].long(), p[-1].long(), (later <= earlier).any().long()]
    ).tolist()
    if not_increasing:
        lo, hi = torch.aminmax(p)
        first, last = int(lo), int(hi)
    if first < 0:
        raise ValueError(
            f"delta.positions holds a negative position ({first}) at index "
            f"{_first(p < 0)}"
        )
    if last >= elements:
        raise ValueError(
            f"delta.positions holds position {last} at index {_first(p >= elements)}, "
            f"outside the chunk's {elements} elements"
        )
    if not_increasing and bool((later < earlier).any()):
        raise ValueError(
            "delta.positions are not sorted: index "
            f"{_first(later < earlier) + 1} is smaller than the one before it"
        )
    if not_increasing:
        raise ValueError(
            "delta.positions holds a duplicate: index "
            f"{_first(later == earlier) + 1} repeats the one before it"
        )


def _check_in_pieces(delta: ChunkDelta, runs: list[tuple[int, torch.Tensor]]) -> None:
    """Every position (sorted, checked) within one of ``runs`` (element
    offset, elements, in order); else the first one outside, named. One
    search of the runs' bounds in the positions when they all are."""
    p = delta.positions
    if not p.numel():
        return
    bounds = torch.tensor(
        [b for first, run in runs for b in (first, first + run.numel())],
        dtype=p.dtype,
        device=p.device,
    )
    found = torch.searchsorted(p, bounds)
    if int((found[1::2] - found[0::2]).sum()) == p.numel():
        return
    inside = torch.zeros(p.numel(), dtype=torch.bool, device=p.device)
    for first, run in runs:
        inside |= (p >= first) & (p < first + run.numel())
    at = _first(~inside)
    raise ValueError(
        f"delta.positions holds position {int(p[at])} at index {at}, in the "
        "chunk's padding between its slices, which a producer packs as zeros"
    )


def _check_base(delta: ChunkDelta, held_version: int, held_digest: str | None) -> None:
    if delta.base_version != held_version:
        raise DeltaBaseMismatch(
            f"delta.base_version is {delta.base_version} but the target holds "
            f"version {held_version}; pull the whole chunk instead"
        )
    if held_digest is not None and delta.base_digest != held_digest:
        raise DeltaBaseMismatch(
            f"delta.base_digest is {delta.base_digest} but the target's bytes "
            f"checksum to {held_digest}; pull the whole chunk instead"
        )


def _check_digest(value: object, nbytes: int, where: str) -> str:
    match = _DIGEST_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(
            f"{where} is {value!r}, not a {ALGORITHM} checksum "
            f"('{ALGORITHM}:<bytes>:<16 hex digits>')"
        )
    if int(match.group(1)) != nbytes:
        raise ValueError(
            f"{where} is the checksum of {match.group(1)} bytes but delta.nbytes "
            f"is {nbytes}"
        )
    return value  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# helpers


def _values_offset(positions_nbytes: int) -> int:
    return -(-positions_nbytes // WIRE_ALIGN) * WIRE_ALIGN


def _view_units(buf: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``buf`` (uint8) as elements of ``dtype``, in place."""
    if buf.data_ptr() % dtype.itemsize:
        raise ValueError(
            f"{name} starts at address {buf.data_ptr():#x}, not aligned to the "
            f"{dtype.itemsize}-byte unit; pass an aligned buffer"
        )
    return buf.view(dtype)


def _as_flat_bytes(buffer: object) -> torch.Tensor:
    if isinstance(buffer, bytes | bytearray | memoryview):
        raw = bytearray(buffer)
        if not raw:
            return torch.empty(0, dtype=torch.uint8)
        # A copy: the tensor owns aligned memory, and the caller's bytes stay
        # its own.
        return torch.frombuffer(raw, dtype=torch.uint8).clone()
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(
            f"delta.buffer must be a uint8 tensor or bytes, got {type(buffer).__name__}"
        )
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"delta.buffer must be a 1-D contiguous uint8 tensor, got dtype "
            f"{buffer.dtype}, shape {tuple(buffer.shape)}"
        )
    if buffer.data_ptr() % WIRE_ALIGN:
        return buffer.clone()
    return buffer


def _cat(
    parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _first(mask: torch.Tensor) -> int:
    """Index of the first True in ``mask``."""
    return int(torch.nonzero(mask).view(-1)[0])
