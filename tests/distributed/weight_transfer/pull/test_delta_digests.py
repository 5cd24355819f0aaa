# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checksums both sides keep of their delta bases without a pass over
the bytes: ``apply_delta`` returns the checksum after its write, the
producer's kept copies and the worker's held copies carry it from sync to
sync, and a held copy whose stored checksum is unknown or stale still ends
exact (through the whole chunk when it is not the delta's base)."""

import pytest
import torch

from vllm.distributed.weight_transfer.pull.delta import apply_delta, encode_delta
from vllm.distributed.weight_transfer.pull.delta_bases import HeldBases, KeptBytes
from vllm.distributed.weight_transfer.verification import payload_checksum

from .test_delta_bases import (  # _close_pairs: the autouse fixture, active here too
    Pair,
    _close_pairs,  # noqa: F401
    _same,
    _step,
    _weights,
)


def _changed(base: torch.Tensor, unit: int, every: int, seed: int) -> torch.Tensor:
    """``base`` with every ``every``-th element (of ``unit`` bytes) set to
    random bits, the last element included."""
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    elements = new.numel() // unit
    picked = torch.cat([torch.arange(0, elements, every), torch.tensor([elements - 1])])
    for i in picked.tolist():
        new[i * unit : (i + 1) * unit] = torch.randint(
            0, 256, (unit,), dtype=torch.uint8, generator=g
        )
    return new


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
@pytest.mark.parametrize("nbytes", [8 * 1024, 8 * 1024 + 2, 8 * 1024 + 8])
@pytest.mark.parametrize("every", [7, 97])
def test_apply_delta_returns_the_checksum_of_the_bytes_it_leaves(unit, nbytes, every):
    """Every unit, a partial last word (2 bytes past a multiple of 4), dense
    and sparse changes, the last element among them."""
    if nbytes % unit:
        pytest.skip("the chunk is not a whole number of elements")
    g = torch.Generator().manual_seed(unit * 1000 + every)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = _changed(base, unit, every, seed=every)
    digest = payload_checksum(base)
    delta = encode_delta(base, new, unit=unit, base_version=1, base_digest=digest)
    assert delta is not None
    target = base.clone()
    after = apply_delta(target, delta, held_version=1, held_digest=digest)
    assert torch.equal(target, new)
    assert after == payload_checksum(new)


def test_apply_delta_of_an_empty_delta_returns_the_base_checksum():
    base = torch.arange(64, dtype=torch.uint8)
    delta = encode_delta(base, base.clone(), unit=2, base_version=3)
    assert delta is not None and delta.count == 0
    assert apply_delta(base, delta, held_version=3) == payload_checksum(base)


def _kept_digests_are_exact(pair: Pair) -> None:
    bases = pair.producer.bases
    assert bases is not None
    for entry in bases._entries.values():
        assert entry.digest is None or entry.digest == payload_checksum(entry.data)
    for entry in pair.held._entries.values():
        assert entry.digest is None or entry.digest == payload_checksum(entry.data)


@pytest.mark.parametrize("checksums", [True, False])
def test_kept_and_held_checksums_follow_the_bytes_over_many_syncs(checksums):
    pair = Pair(checksums=checksums)
    weights = _weights(0)
    pair.sync_once(weights)
    for step in range(1, 6):
        weights = _step(weights, step)
        results, landed = pair.sync_once(weights)
        assert [r.delta for r in results] == ["applied", "applied"]
        assert _same(landed, weights)
        _kept_digests_are_exact(pair)
    # After the first delta every digest is known on both sides.
    bases = pair.producer.bases
    assert bases is not None
    assert all(e.digest for e in bases._entries.values())
    assert all(e.digest for e in pair.held._entries.values())


@pytest.mark.parametrize("checksums", [True, False])
def test_a_stale_stored_checksum_refuses_the_delta_and_reads_the_whole_chunk(
    checksums,
):
    pair = Pair(checksums=checksums)
    w1 = _weights(0)
    pair.sync_once(w1)
    w2 = _step(w1, 3)
    pair.sync_once(w2)

    def stale(index, held):
        entry = held.base(index)
        assert entry.digest is not None
        entry.digest = f"ws1:{entry.data.numel()}:{1:016x}"

    w3 = _step(w2, 2)
    results, landed = pair.sync_once(w3, corrupt=stale)
    assert all("checksum" in r.delta for r in results), results
    assert [r.read_bytes for r in results] == [c.nbytes for c in pair.chunks]
    assert _same(landed, w3)
    again, landed = pair.sync_once(_step(w3, 1))
    assert [r.delta for r in again] == ["applied", "applied"]
    assert _same(landed, _step(w3, 1))


@pytest.mark.parametrize("checksums", [True, False])
def test_an_unknown_stored_checksum_is_computed_from_the_held_bytes(checksums):
    pair = Pair(checksums=checksums)
    w1 = _weights(0)
    pair.sync_once(w1)
    pair.sync_once(_step(w1, 3))

    def unknown_and_flipped(index, held):
        entry = held.base(index)
        entry.digest = None
        entry.data[5] ^= 0x10

    results, landed = pair.sync_once(_step(w1, 4), corrupt=unknown_and_flipped)
    assert all("checksum" in r.delta for r in results), results
    assert _same(landed, _step(w1, 4))


def test_a_flipped_held_byte_behind_a_stored_checksum_is_caught_by_the_producers():
    """The stored checksum says the held copy is the base, but a byte of it
    changed out of band: the rebuilt chunk's checksum is not the producer's,
    so the delta is refused and the whole chunk read."""
    pair = Pair()  # its producer has checksums on
    w1 = _weights(0)
    pair.sync_once(w1)
    pair.sync_once(_step(w1, 3))

    def flip(index, held):
        held.base(index).data[-3] ^= 0x01  # an element the delta keeps

    w3 = _step(w1, 5)
    results, landed = pair.sync_once(w3, corrupt=flip)
    assert all("producer's checksum" in r.delta for r in results), results
    assert _same(landed, w3)
    _kept_digests_are_exact(pair)


def test_a_rebuilt_chunk_is_recorded_without_a_copy_and_an_unrecorded_one_dropped():
    pair = Pair()
    w1 = _weights(0)
    pair.sync_once(w1)
    results, _ = pair.sync_once(_step(w1, 3))
    assert [r.delta for r in results] == ["applied", "applied"]
    entry = pair.held.base(0)
    assert isinstance(entry, KeptBytes) and entry.copied_to is None
    assert entry.version == pair.sync
    # A rebuild whose pull failed before ``record``: not a base after commit.
    entry.copied_to = (torch.device("cpu"), 1, 1)
    pair.held.commit()
    assert pair.held.base(0) is None
    assert pair.held.base(1) is not None


def test_record_copies_a_buffer_other_than_the_one_rebuilt():
    held = HeldBases(1 << 20)
    data = torch.arange(256, dtype=torch.uint8)
    held.record(0, data, 1)
    held.commit()
    entry = held.base(0)
    assert isinstance(entry, KeptBytes)
    entry.copied_to = (torch.device("cpu"), data.data_ptr() + 1, data.numel())
    other = torch.flip(data, [0]).contiguous()
    held.record(0, other, 2)
    assert torch.equal(held._entries[0].data, other)
    assert held._entries[0].digest is None


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
def test_word_changes_agree_on_numpy_arrays_and_tensors(unit):
    """The apply's checksum step runs on numpy arrays on CPU and on tensors
    elsewhere: both give the same words and changes."""
    from vllm.distributed.weight_transfer.pull.delta import VALUE_DTYPES
    from vllm.distributed.weight_transfer.pull.delta_write import _word_changes

    g = torch.Generator().manual_seed(unit)
    dtype = VALUE_DTYPES[unit]
    old = torch.randint(0, 256, (64 * unit,), dtype=torch.uint8, generator=g)
    new = torch.randint(0, 256, (64 * unit,), dtype=torch.uint8, generator=g)
    old, new = old.view(dtype), new.view(dtype)
    positions = torch.arange(0, 640, 10, dtype=torch.int32)
    words_np, changes_np = _word_changes(
        old.numpy(), new.numpy(), positions.numpy(), unit
    )
    words_t, changes_t = _word_changes(old, new, positions, unit)
    assert torch.equal(torch.from_numpy(words_np), words_t)
    assert torch.equal(torch.from_numpy(changes_np), changes_t)
    assert positions.tolist() == list(range(0, 640, 10))  # not changed in place


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
def test_the_host_apply_writes_the_new_bytes_and_their_checksum(unit):
    g = torch.Generator().manual_seed(unit + 40)
    base = torch.randint(
        0, 256, (4096 + 2 * (unit < 4),), dtype=torch.uint8, generator=g
    )
    new = _changed(base, unit, 11, seed=unit)
    delta = encode_delta(base, new, unit=unit, base_version=1)
    assert delta is not None
    target = base.clone()
    after = apply_delta(target, delta, held_version=1)
    assert torch.equal(target, new)
    assert after == payload_checksum(new)
