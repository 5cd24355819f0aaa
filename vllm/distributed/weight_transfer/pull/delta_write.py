# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Writing a delta's new values into a chunk, and the chunk's ``ws1``
checksum after the write, from the base's checksum and the changed words
alone (``verification.checksum.checksum_after_change``): no pass over the
chunk. `pull.delta.apply_delta` checks a delta, then calls `write_changes`.

On a GPU the write is one index write and the words' changes are tensor
arithmetic. On the host a numba-compiled loop writes each element and sums
its word's change in one pass; where numba is missing, numpy's one-thread
gather and scatter (torch's thread pool stalls on a loaded 2-core host).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.verification.checksum import (
    checksum_after_change,
    checksum_plus,
)

_P = 2**31 - 1  # the ``ws1`` modulus


def write_changes(
    words: torch.Tensor,
    delta_positions: torch.Tensor,
    delta_values: torch.Tensor,
    *,
    unit: int,
    base_digest: str,
) -> str:
    """Write ``delta_values`` at ``delta_positions`` of ``words`` (the chunk
    viewed as elements of the unit's integer dtype; positions checked by the
    caller) and return the chunk's ``ws1`` checksum after the write, given
    ``base_digest``, the checksum before it."""
    if words.device.type == "cpu":
        elements: Any = words.numpy()
        positions: Any = delta_positions.numpy()
        values: Any = delta_values.numpy()
        kernel = (
            _host_apply_kernel()
            if words.numel() * words.element_size() < 4 * _P
            else None
        )
        if kernel is not None:
            # One compiled loop writes each element and sums its word's
            # change: a few times faster than the array operations below.
            add_a, add_b = kernel(elements, positions, values, unit)
            return checksum_plus(base_digest, int(add_a), int(add_b))
        # numpy's one-thread gather and scatter: torch's thread pool stalls
        # on a loaded host.
        old = elements[positions]
        elements[positions] = values
    else:
        positions = delta_positions.long()
        values = delta_values
        old = words[positions]
        # int64 indices: the index write takes a much slower path with int32.
        words.index_put_((positions,), values)
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


_HOST_APPLY: list[Any] = []  # the compiled host kernel, or None without numba


def _host_apply_kernel() -> Any:
    """The host apply kernel (compiled by numba on first use, cached on
    disk), or None where numba is missing: then the array path runs."""
    if not _HOST_APPLY:
        try:
            import numba
        except ImportError:
            _HOST_APPLY.append(None)
        else:
            _HOST_APPLY.append(
                numba.njit(nogil=True, cache=True)(_apply_and_sum_changes)
            )
    return _HOST_APPLY[0]


def _apply_and_sum_changes(
    elements: Any, positions: Any, values: Any, unit: int
) -> tuple[Any, Any]:
    """Write ``values`` at ``positions`` of ``elements`` (numpy arrays; the
    unit's integer dtype) and return the two sums `checksum_plus` takes:
    the changes of the ``ws1`` words the writes touch, and those changes
    weighted by word index + 1, each product folded mod ``P``. The words'
    shares are those of `_word_changes`; a chunk below ``2**31`` words keeps
    every product within int64. Compiled by numba (the loop is plain
    Python otherwise, and far too slow to call)."""
    add_a: Any = 0
    add_b: Any = 0
    lanes = 4 // unit if unit < 8 else 1
    top = lanes - 1
    shift = 2 if unit == 1 else (1 if unit == 2 else 0)
    bits = 8 * unit
    mask = (1 << bits) - 1 if unit < 8 else 0
    for i in range(positions.shape[0]):
        p = np.int64(positions[i])
        old = np.int64(elements[p])
        new = np.int64(values[i])
        elements[p] = values[i]
        if unit == 8:
            # Two words: the low half (signed), then the high half.
            low = (((new & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000) - (
                ((old & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
            )
            weighted = (2 * p + 1) * low
            add_a += low
            add_b += (weighted & _P) + (weighted >> 31)
            change = (new >> 32) - (old >> 32)
            weighted = (2 * p + 2) * change
        elif unit == 4:
            change = new - old
            weighted = (p + 1) * change
        else:
            lane = p & top
            before = old & mask
            after = new & mask
            change = (after - before) << (bits * lane)
            if lane == top:
                change -= ((after >> (bits - 1)) - (before >> (bits - 1))) << 32
            weighted = ((p >> shift) + 1) * change
        add_a += change
        add_b += (weighted & _P) + (weighted >> 31)
    return add_a, add_b


def _int64_copy(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a.astype(np.int64)
    return a.to(torch.int64, copy=True)


def _as_tensor(a: Any) -> torch.Tensor:
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a
