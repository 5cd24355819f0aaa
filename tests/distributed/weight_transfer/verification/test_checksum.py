# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ws1`` payload checksum: definition, sensitivity, chunking invariance."""

import pytest
import torch

from vllm.distributed.weight_transfer.verification.checksum import (
    payload_checksum,
    tensor_checksum,
)

P = 2**31 - 1


def reference_ws1(data: bytes) -> str:
    """The definition in the module docstring, in plain Python."""
    padded = data + b"\0" * (-len(data) % 4)
    a = b = 0
    for j in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * j : 4 * j + 4], "little", signed=True)
        a += w
        b += (j + 1) * w
    return f"ws1:{len(data)}:{a % P:08x}{b % P:08x}"


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 4095, 4096, 4097, 3 * 4096 + 5])
def test_matches_the_definition(n):
    buf = random_bytes(n)
    assert payload_checksum(buf) == reference_ws1(bytes(buf.tolist()))


def test_extreme_words_are_exact():
    buf = torch.full((64 * 1024,), 0xFF, dtype=torch.uint8)
    buf[1::4] = 0x7F
    assert payload_checksum(buf) == reference_ws1(bytes(buf.tolist()))


def test_independent_of_chunk_size():
    buf = random_bytes(5 * 4096 * 3 + 123)
    sums = {
        payload_checksum(buf, chunk_bytes=c) for c in (4096, 8192, 3 * 4096, 1 << 20)
    }
    assert len(sums) == 1


def test_misaligned_slice_equals_its_copy():
    buf = random_bytes(3 * 4096 + 7)
    view = buf[3:]
    assert view.data_ptr() % 4 != 0
    assert payload_checksum(view, chunk_bytes=4096) == payload_checksum(view.clone())


def test_detects_every_single_byte_flip():
    buf = random_bytes(4096 + 6, seed=1)
    base = payload_checksum(buf)
    for i in range(buf.numel()):
        for delta in (1, 128, 255):
            flipped = buf.clone()
            flipped[i] = (int(flipped[i]) + delta) % 256
            assert payload_checksum(flipped) != base, (i, delta)


def test_detects_swapped_words_and_shifted_chunks():
    buf = random_bytes(4 * 4096, seed=2)
    base = payload_checksum(buf)
    swapped = buf.clone()
    swapped[0:4], swapped[8:12] = buf[8:12].clone(), buf[0:4].clone()
    assert payload_checksum(swapped) != base
    rotated = torch.roll(buf, 4096)
    assert payload_checksum(rotated) != base


def test_length_is_part_of_the_checksum():
    buf = random_bytes(10)
    padded = torch.cat([buf, torch.zeros(2, dtype=torch.uint8)])
    assert payload_checksum(buf) != payload_checksum(padded)


def test_tensor_checksum_reads_the_raw_bytes():
    t = torch.randn(33, 7, dtype=torch.float32)
    assert tensor_checksum(t) == payload_checksum(t.view(-1).view(torch.uint8))
    assert tensor_checksum(t.to(torch.bfloat16)) != tensor_checksum(t)


def test_rejects_non_byte_or_strided_input():
    with pytest.raises(ValueError, match="1-D contiguous uint8 tensor"):
        payload_checksum(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        tensor_checksum(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="multiple of 4096"):
        payload_checksum(torch.zeros(4, dtype=torch.uint8), chunk_bytes=100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_agree():
    buf = random_bytes(3 * 4096 * 17 + 3)
    assert payload_checksum(buf.cuda()) == payload_checksum(buf)
