# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writing a delta's new values into a chunk, and the chunk's ``ws1``
checksum after the write, from the base's checksum and the changed words
alone (``verification.checksum.checksum_after_change``): no pass over the
chunk. `pull.delta.apply_delta` checks a delta, then calls `write_changes`;
`pull.delta.delta_for_pieces` checks one against a chunk held in pieces
elsewhere, then calls `plan_pieces_write`, whose result writes later.

On a GPU the write is one index write and the words' changes are tensor
arithmetic. On the host numpy's one-thread gather and scatter do the same
(torch's thread pool stalls on a loaded 2-core host). A numba-compiled loop
was faster still (64 MiB bf16 at 1.4% changed: 11 ms against 41 ms) but is
not used: once numba had compiled in a process, a vLLM engine started later
in that process failed while scanning ``sys.modules`` for its Triton kernel
overrides, and forks from it failed with ENOMEM.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.verification.checksum import (
    checksum_after_change,
)

_P = 2**31 - 1  # the ``ws1`` modulus


def write_changes(
    words: torch.Tensor,
    delta_positions: torch.Tensor,
    delta_values: torch.Tensor,
    *,
    unit: int,
    base_digest: str | None,
) -> str | None:
    """Write ``delta_values`` at ``delta_positions`` of ``words`` (the chunk
    viewed as elements of the unit's integer dtype; positions checked by the
    caller) and return the chunk's ``ws1`` checksum after the write, given
    ``base_digest``, the checksum before it (None: write only, return
    None)."""
    elements = _elements(words)
    positions, values = _index(words.device, delta_positions, delta_values)
    old = elements[positions] if base_digest is not None else None
    _scatter(elements, positions, values)
    if base_digest is None:
        return None
    return _checksum_after(base_digest, old, values, positions, unit)


class PiecesWrite:
    """A delta's new values for a chunk whose bytes lie in separate pieces
    (the served tensors its slices landed in), split per piece and ready to
    write; ``checksum``: the chunk's ``ws1`` after the write (None when not
    asked for), known before anything is written."""

    def __init__(self, writes: list[tuple[Any, Any, Any]], checksum: str | None):
        self._writes = writes
        self.checksum = checksum

    def write(self) -> None:
        """Write the new values into the pieces."""
        for elements, positions, values in self._writes:
            _scatter(elements, positions, values)


def plan_pieces_write(
    pieces: list[tuple[int, torch.Tensor]],
    delta_positions: torch.Tensor,
    delta_values: torch.Tensor,
    *,
    unit: int,
    base_digest: str | None,
) -> PiecesWrite:
    """Split a delta over ``pieces`` (``(element offset in the chunk, the
    piece's elements in the unit's integer dtype)``, in offset order, on the
    delta's device) and take the chunk's checksum after the change from
    ``base_digest`` (None: none), reading the old values but writing
    nothing. Every position must lie in a piece (checked by the caller)."""
    positions, values = _index(delta_positions.device, delta_positions, delta_values)
    writes = []
    olds = []
    for first, piece in pieces:
        lo, hi = _searchsorted(positions, first, first + piece.numel())
        if lo == hi:
            continue
        elements = _elements(piece)
        local = positions[lo:hi] - first
        if base_digest is not None:
            olds.append(elements[local])
        writes.append((elements, local, values[lo:hi]))
    checksum = None
    if base_digest is not None:
        old = _joined(olds) if olds else values[:0]
        checksum = _checksum_after(base_digest, old, values, positions, unit)
    return PiecesWrite(writes, checksum)


def _elements(words: torch.Tensor) -> Any:
    """``words`` to index into: a numpy view on the host (numpy's one-thread
    gather and scatter: torch's thread pool stalls on a loaded host), the
    tensor elsewhere."""
    return words.numpy() if words.device.type == "cpu" else words


def _index(
    device: torch.device, positions: torch.Tensor, values: torch.Tensor
) -> tuple[Any, Any]:
    """Positions and values as ``_elements`` indexes with them on ``device``:
    numpy arrays on the host, int64 positions elsewhere (the index write takes
    a much slower path with int32)."""
    if device.type == "cpu":
        return positions.numpy(), values.numpy()
    return positions.long(), values


def _scatter(elements: Any, positions: Any, values: Any) -> None:
    if isinstance(elements, np.ndarray):
        elements[positions] = values
    else:
        elements.index_put_((positions,), values)


def _searchsorted(positions: Any, lo: int, hi: int) -> tuple[int, int]:
    """The range of the sorted ``positions`` within ``[lo, hi)``."""
    if isinstance(positions, np.ndarray):
        found = np.searchsorted(positions, [lo, hi])
        return int(found[0]), int(found[1])
    bounds = torch.tensor([lo, hi], dtype=positions.dtype, device=positions.device)
    start, end = torch.searchsorted(positions, bounds).tolist()
    return start, end


def _joined(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat(parts)


def _checksum_after(
    base_digest: str, old: Any, values: Any, positions: Any, unit: int
) -> str:
    word_positions, changes = _word_changes(old, values, positions, unit)
    return checksum_after_change(
        base_digest, _as_tensor(word_positions), _as_tensor(changes)
    )


def _word_changes(old: Any, new: Any, positions: Any, unit: int) -> tuple[Any, Any]:
    """For elements at ``positions`` that change from ``old`` to ``new``
    (numpy arrays or tensors of the unit's integer dtype): the index of the
    ``ws1`` word each part lies in and how much that word's signed
    little-endian value changes with it (int64). An element of 1 or 2 bytes
    counts unsigned, shifted to its byte offset, except the top one of its
    word, which counts signed; an 8-byte element is two words."""
    host = isinstance(old, np.ndarray)
    # Fresh int64 copies throughout: the arithmetic below runs in place.
    at = _int64_copy(positions)
    if unit == 8:
        word_dtype = np.int32 if host else torch.int32
        before, after = old.view(word_dtype), new.view(word_dtype)
        words = (at * 2).repeat(2) if host else (at * 2).repeat_interleave(2)
        words[1::2] += 1
        at, old, new, unit = words, before, after, 4
    before, after = _int64_copy(old), _int64_copy(new)
    if unit == 4:
        after -= before
        return at, after
    lanes = 4 // unit
    bits = 8 * unit
    lane = at & (lanes - 1)
    # Unsigned values, and the sign bits of the top elements, which stand
    # for -2**32 in the word on top of their unsigned value.
    before &= (1 << bits) - 1
    after &= (1 << bits) - 1
    signs = (after >> (bits - 1)) - (before >> (bits - 1))
    signs *= lane == lanes - 1
    after -= before
    lane *= bits
    after <<= lane
    signs <<= 32
    after -= signs
    at >>= lanes.bit_length() - 1
    return at, after


def _int64_copy(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a.astype(np.int64)
    return a.to(torch.int64, copy=True)


def _as_tensor(a: Any) -> torch.Tensor:
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a
