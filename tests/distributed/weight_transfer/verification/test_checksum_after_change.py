# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``checksum_after_change``: the ``ws1`` checksum of edited bytes from the
old checksum and the changed words only, equal to a full recomputation."""

import pytest
import torch

from vllm.distributed.weight_transfer.verification.checksum import (
    checksum_after_change,
    checksum_words,
    payload_checksum,
)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def edit_and_update(buf: torch.Tensor, byte_positions: torch.Tensor, seed: int):
    """Overwrite ``buf`` at ``byte_positions`` with random bytes; return the
    checksum before, the incremental one after, and the recomputed one."""
    before = payload_checksum(buf)
    words = torch.unique(byte_positions // 4)
    old = checksum_words(buf, words)
    g = torch.Generator().manual_seed(seed + 1)
    buf[byte_positions] = torch.randint(
        0, 256, (byte_positions.numel(),), dtype=torch.uint8, generator=g
    )
    new = checksum_words(buf, words)
    return (
        before,
        checksum_after_change(before, words, new - old),
        (payload_checksum(buf)),
    )


@pytest.mark.parametrize("n", [1, 3, 4, 7, 4096, 4099, 3 * 4096 + 5, 1 << 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_edits_match_a_full_recomputation(n, seed):
    buf = random_bytes(n, seed)
    g = torch.Generator().manual_seed(seed + 10)
    count = max(1, n // 50)
    positions = torch.randint(0, n, (count,), generator=g)
    # The last byte (the partial last word when n % 4) and the first.
    positions = torch.cat([positions, torch.tensor([0, n - 1])])
    _, incremental, full = edit_and_update(buf, positions, seed)
    assert incremental == full


def test_misaligned_buffer_and_extreme_words():
    backing = random_bytes(4 * 1024 + 3, 5)
    buf = backing[1:]  # not 4-byte aligned, length not a multiple of 4
    assert buf.data_ptr() % 4
    words = torch.tensor([0, 1, 2, 3, buf.numel() // 4])
    old = checksum_words(buf, words)
    before = payload_checksum(buf)
    # Most negative, most positive and -1 words, and a partial last word.
    buf[0:4] = torch.tensor([0x00, 0x00, 0x00, 0x80], dtype=torch.uint8)
    buf[4:8] = torch.tensor([0xFF, 0xFF, 0xFF, 0x7F], dtype=torch.uint8)
    buf[8:12] = 0xFF
    buf[-1] = 0xFF
    new = checksum_words(buf, words)
    assert old.dtype == new.dtype == torch.int64
    assert int(new[0]) == -(2**31) and int(new[1]) == 2**31 - 1
    assert int(new[2]) == -1
    assert checksum_after_change(before, words, new - old) == payload_checksum(buf)


def test_words_match_the_aligned_and_byte_by_byte_paths():
    buf = random_bytes(4096, 3)
    words = torch.arange(0, 1024, 7)
    aligned = checksum_words(buf, words)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])[1:]
    assert shifted.data_ptr() % 4  # the byte-by-byte path
    assert torch.equal(aligned, checksum_words(shifted, words))
    odd = torch.cat([buf, torch.zeros(1, dtype=torch.uint8)])
    assert torch.equal(aligned, checksum_words(odd, words))  # the slow path
    assert torch.equal(aligned, buf.view(torch.int32)[words].long())


def test_no_change_and_listed_unchanged_words_keep_the_checksum():
    buf = random_bytes(4096 + 2, 4)
    before = payload_checksum(buf)
    empty = torch.empty(0, dtype=torch.int64)
    assert checksum_after_change(before, empty, empty) == before
    words = torch.tensor([0, 5, 1024])
    same = checksum_words(buf, words)
    assert checksum_after_change(before, words, same - same) == before


def test_refuses_bad_input():
    buf = random_bytes(64, 6)
    before = payload_checksum(buf)
    one = torch.tensor([0])
    w = checksum_words(buf, one)
    with pytest.raises(ValueError, match="outside the 16 words"):
        checksum_after_change(before, torch.tensor([16]), w)
    with pytest.raises(ValueError, match="not a ws1 checksum"):
        checksum_after_change("crc:64:0", one, w)
    with pytest.raises(ValueError, match="1 word positions but 0 changes"):
        checksum_after_change(before, one, w[:0])
