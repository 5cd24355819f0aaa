# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The chunk delta codec: exact round trips, the whole-or-delta rule, and every
refusal leaving the target byte for byte unchanged."""

import dataclasses

import pytest
import torch

from vllm.distributed.weight_transfer.pull import delta as delta_mod
from vllm.distributed.weight_transfer.pull.delta import (
    ChunkDelta,
    DeltaBaseMismatch,
    apply_delta,
    check_delta,
    encode_delta,
    encoded_nbytes,
)
from vllm.distributed.weight_transfer.verification.checksum import payload_checksum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _pair(dtype: torch.dtype, rate: float, n: int = 4096, device: str = "cpu"):
    """A base chunk of ``n`` elements of ``dtype`` and a copy with about
    ``rate`` of its elements changed (each changed element flips a bit)."""
    g = torch.Generator().manual_seed(0)
    unit = dtype.itemsize
    raw = torch.randint(0, 256, (n * unit,), dtype=torch.uint8, generator=g)
    base = raw.view(dtype)
    words = raw.clone().view(delta_mod.VALUE_DTYPES[unit])
    changed = torch.rand(n, generator=g) < rate
    words[changed] ^= 1
    new = words.view(dtype)
    return _bytes(base).to(device), _bytes(new).to(device), int(changed.sum())


def _delta(positions, values, *, nbytes=64, unit=2, version=3, digest=None):
    return ChunkDelta(
        base_version=version,
        base_digest=digest or f"ws1:{nbytes}:{0:016x}",
        nbytes=nbytes,
        unit=unit,
        positions=torch.tensor(positions, dtype=torch.int32),
        values=torch.tensor(values, dtype=delta_mod.VALUE_DTYPES[unit]),
    )


def _refused(target: torch.Tensor, fn, match: str, error=ValueError):
    """``fn`` raises ``error`` matching ``match`` and leaves ``target`` as it
    was."""
    before = target.clone()
    with pytest.raises(error, match=match):
        fn()
    assert torch.equal(target, before)


# ---------------------------------------------------------------------------
# round trips and the whole-or-delta rule


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.float64],
)
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.3, 1.0])
def test_round_trip_is_exact_or_whole_is_chosen(dtype, rate, device):
    base, new, changed = _pair(dtype, rate, device=device)
    unit = dtype.itemsize
    delta = encode_delta(base, new, unit=unit, base_version=7)
    if encoded_nbytes(changed, base.numel(), unit) >= base.numel():
        assert delta is None
        return
    assert delta is not None
    assert delta.count == changed
    assert delta.positions.dtype == torch.int32
    assert delta.base_digest == payload_checksum(base)
    target = base.clone()
    apply_delta(target, delta, held_version=7)
    assert torch.equal(target, new)
    # the same through the wire form
    header, buffer = delta.to_wire()
    parsed = ChunkDelta.from_wire(header, buffer.cpu().numpy().tobytes())
    target = base.clone()
    apply_delta(target, ChunkDelta.from_wire(header, buffer), held_version=7)
    assert torch.equal(target, new)
    assert torch.equal(parsed.positions.to(device), delta.positions)
    assert torch.equal(parsed.values.to(device), delta.values)


def test_nan_payloads_and_signed_zeros_round_trip_bit_for_bit():
    bits = [0x7FC00001, 0x7FC00002, 0xFFC00001, 0x00000000, 0x80000000, 0x3F800000]
    base = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    new_bits = [0x7FC00002, 0x7FC00001, 0x7FC00001, 0x80000000, 0x00000000]
    new = torch.tensor(new_bits + [0x3F800000], dtype=torch.int64).to(torch.int32)
    new = new.view(torch.float32)
    base_b = _bytes(base).clone()
    new_b = _bytes(new).clone()
    padding = torch.zeros(4 * 64, dtype=torch.uint8)  # room for 5 changes
    base_b, new_b = torch.cat([base_b, padding]), torch.cat([new_b, padding])
    delta = encode_delta(base_b, new_b, unit=4, base_version=0)
    assert delta is not None and delta.positions.tolist() == [0, 1, 2, 3, 4]
    header, buffer = delta.to_wire()
    target = base_b.clone()
    apply_delta(target, ChunkDelta.from_wire(header, buffer), held_version=0)
    assert torch.equal(target, new_b)


def test_unchanged_chunk_gives_an_empty_delta_that_applies_as_a_no_op():
    base, _, _ = _pair(torch.bfloat16, 0.0)
    delta = encode_delta(base, base.clone(), unit=2, base_version=1)
    assert delta is not None and delta.count == 0 and delta.encoded_nbytes == 0
    header, buffer = delta.to_wire()
    assert buffer.numel() == 0 and header["count"] == 0
    target = base.clone()
    apply_delta(target, ChunkDelta.from_wire(header, b""), held_version=1)
    assert torch.equal(target, base)


def test_whole_wins_at_equal_size():
    # 30 bf16 elements (60 bytes); each change costs 4 + 2 bytes.
    base = torch.zeros(60, dtype=torch.uint8)
    for k, expect_delta in ((9, True), (10, False)):
        new = base.clone()
        new.view(torch.int16)[:k] = 1
        delta = encode_delta(base, new, unit=2, base_version=0)
        assert (delta is not None) == expect_delta
        if delta is not None:
            assert delta.encoded_nbytes == 54


def test_encoding_across_slabs_matches_one_pass(monkeypatch):
    base, new, changed = _pair(torch.bfloat16, 0.05, n=10_000)
    one = encode_delta(base, new, unit=2, base_version=0)
    monkeypatch.setattr(delta_mod, "CPU_SLAB_BYTES", 1024)
    sliced = encode_delta(base, new, unit=2, base_version=0)
    assert one is not None and sliced is not None and sliced.count == changed
    assert torch.equal(one.positions, sliced.positions)
    assert torch.equal(one.values, sliced.values)
    # a chunk that changed everywhere stops at the first slab past the limit
    assert encode_delta(base, _bytes(~base), unit=2, base_version=0) is None


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_word_and_element_comparisons_agree(dtype):
    """Aligned chunks are compared 8 bytes at a time, others element by
    element; both find the same changes."""
    base, new, _ = _pair(dtype, 0.05, n=2048)
    wide = encode_delta(base, new, unit=dtype.itemsize, base_version=0)
    shift = dtype.itemsize if dtype.itemsize < 8 else 0
    backing = torch.zeros(2, base.numel() + 8, dtype=torch.uint8)
    old_at = backing[0, shift : shift + base.numel()]
    new_at = backing[1, shift : shift + base.numel()]
    old_at.copy_(base)
    new_at.copy_(new)
    assert old_at.data_ptr() % 8 != 0
    narrow = encode_delta(old_at, new_at, unit=dtype.itemsize, base_version=0)
    assert wide is not None and narrow is not None
    assert torch.equal(wide.positions, narrow.positions)
    assert torch.equal(wide.values, narrow.values)


def test_large_chunks_take_int64_positions(monkeypatch):
    monkeypatch.setattr(delta_mod, "_INT32_ELEMENTS", 16)
    base = torch.zeros(64, dtype=torch.uint8)
    new = base.clone()
    new[40] = 9
    delta = encode_delta(base, new, unit=1, base_version=0)
    assert delta is not None and delta.positions.dtype == torch.int64
    target = base.clone()
    apply_delta(target, ChunkDelta.from_wire(*delta.to_wire()), held_version=0)
    assert torch.equal(target, new)


# ---------------------------------------------------------------------------
# refusals: the base


@pytest.fixture
def chunk():
    """A bf16 base, its next version, and the delta between them (version 5)."""
    base, new, _ = _pair(torch.bfloat16, 0.02, n=1024)
    delta = encode_delta(base, new, unit=2, base_version=5)
    assert delta is not None and delta.count > 1
    return base, new, delta


def test_replayed_delta_is_refused_by_the_digest(chunk):
    base, new, delta = chunk
    target = base.clone()
    apply_delta(target, delta, held_version=5)
    _refused(
        target,
        lambda: apply_delta(target, delta, held_version=5),
        r"delta\.base_digest.*pull the whole chunk",
        DeltaBaseMismatch,
    )
    assert torch.equal(target, new)


def test_byte_changed_out_of_band_is_refused(chunk):
    base, _, delta = chunk
    target = base.clone()
    target[17] ^= 0x40
    _refused(
        target,
        lambda: apply_delta(target, delta, held_version=5),
        r"delta\.base_digest",
        DeltaBaseMismatch,
    )


def test_wrong_base_version_or_digest_is_refused(chunk):
    base, _, delta = chunk
    target = base.clone()
    _refused(
        target,
        lambda: apply_delta(target, delta, held_version=4),
        r"delta\.base_version is 5 but the target holds version 4; pull the whole",
        DeltaBaseMismatch,
    )
    other = f"ws1:{base.numel()}:{1:016x}"
    _refused(
        target,
        lambda: apply_delta(target, delta, held_version=5, held_digest=other),
        r"delta\.base_digest",
        DeltaBaseMismatch,
    )
    with pytest.raises(DeltaBaseMismatch, match=r"delta\.base_digest"):
        check_delta(
            delta, target_nbytes=base.numel(), held_version=5, held_digest=other
        )


def test_target_of_another_size_or_misaligned_is_refused(chunk):
    base, _, delta = chunk
    longer = torch.cat([base, torch.zeros(2, dtype=torch.uint8)])
    _refused(
        longer,
        lambda: apply_delta(longer, delta, held_version=5),
        r"delta\.nbytes is 2048 but the target chunk has 2050",
    )
    backing = torch.cat([torch.zeros(1, dtype=torch.uint8), base])
    odd = backing[1:]
    _refused(backing, lambda: apply_delta(odd, delta, held_version=5), "aligned")
    _refused(
        base,
        lambda: apply_delta(base.view(torch.int16), delta, held_version=5),
        "target must be a 1-D contiguous uint8",
    )


# ---------------------------------------------------------------------------
# refusals: the positions and values


@pytest.mark.parametrize(
    "positions, match",
    [
        ([1, -2, 5], r"delta\.positions holds a negative position \(-2\) at index 1"),
        ([1, 32], r"delta\.positions holds position 32 at index 1, outside"),
        ([1, 5, 3], r"delta\.positions are not sorted: index 2"),
        ([1, 5, 5], r"delta\.positions holds a duplicate: index 2"),
    ],
)
def test_bad_positions_are_refused_before_any_write(positions, match):
    target = torch.arange(64, dtype=torch.uint8)
    digest = payload_checksum(target)
    delta = _delta(positions, [7] * len(positions), digest=digest)
    _refused(target, lambda: apply_delta(target, delta, held_version=3), match)
    # and on parse
    header, buffer = delta.to_wire()
    with pytest.raises(ValueError, match=match):
        ChunkDelta.from_wire(header, buffer)


def test_positions_changed_after_construction_are_checked_at_apply():
    target = torch.arange(64, dtype=torch.uint8)
    delta = _delta([1, 2], [7, 7], digest=payload_checksum(target))
    delta.positions[1] = 99
    _refused(target, lambda: apply_delta(target, delta, held_version=3), "outside")


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(values=torch.tensor([1], dtype=torch.int16)), r"delta\.values has 1"),
        (
            dict(positions=torch.tensor([1, 2], dtype=torch.int64)),
            r"delta\.positions must be a 1-D contiguous int32",
        ),
        (
            dict(values=torch.tensor([1, 2], dtype=torch.float16)),
            r"delta\.values must be a 1-D contiguous int16",
        ),
        (
            dict(positions=torch.tensor([[1, 2]], dtype=torch.int32)),
            r"delta\.positions must be a 1-D",
        ),
        (dict(positions=[1, 2]), r"delta\.positions must be a tensor"),
        (dict(unit=3), r"delta\.unit is 3"),
        (dict(unit=2.0), r"delta\.unit is 2\.0"),
        (dict(unit=4, nbytes=6), r"delta\.unit is 4 but the chunk's 6 bytes"),
        (dict(base_version=-1), r"delta\.base_version must be an integer >= 0"),
        (dict(base_version=True), r"delta\.base_version"),
        (dict(nbytes=0), r"delta\.nbytes must be an integer >= 1"),
        (dict(base_digest="sha:abc"), r"delta\.base_digest is 'sha:abc'"),
        (
            dict(base_digest=f"ws1:65:{0:016x}"),
            r"delta\.base_digest is the checksum of 65 bytes but delta\.nbytes is 64",
        ),
        (
            dict(
                positions=torch.arange(11, dtype=torch.int32),
                values=torch.zeros(11, dtype=torch.int16),
            ),
            r"66 bytes, not smaller than the whole chunk \(64 bytes\); an oversized",
        ),
    ],
)
def test_malformed_fields_are_refused_naming_the_field(fields, match):
    good = dict(
        base_version=3,
        base_digest=f"ws1:64:{0:016x}",
        nbytes=64,
        unit=2,
        positions=torch.tensor([1, 2], dtype=torch.int32),
        values=torch.tensor([1, 2], dtype=torch.int16),
    )
    with pytest.raises(ValueError, match=match):
        ChunkDelta(**{**good, **fields})


def test_fields_swapped_after_construction_are_checked_at_apply():
    """A frozen delta whose tensor was swapped behind its back is checked
    again at apply."""
    target = torch.arange(64, dtype=torch.uint8)
    delta = _delta([1, 2], [7, 7], digest=payload_checksum(target))
    object.__setattr__(delta, "values", torch.tensor([7], dtype=torch.int16))
    _refused(
        target,
        lambda: apply_delta(target, delta, held_version=3),
        r"delta\.values has 1 entries but delta\.positions has 2",
    )


# ---------------------------------------------------------------------------
# refusals: the wire


def _wire(chunk):
    _, _, delta = chunk
    return delta.to_wire()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h: h.pop("count"), r"delta header is missing field\(s\) \['count'\]"),
        (lambda h: h.update(extra=1), r"unknown field\(s\) \['extra'\]"),
        (lambda h: h.update(format=2), r"delta\.format is 2"),
        (lambda h: h.update(format=True), r"delta\.format must be an integer"),
        (lambda h: h.update(count="9"), r"delta\.count must be an integer"),
        (lambda h: h.update(count=h["count"] + 1), r"delta\.buffer_nbytes is"),
        (lambda h: h.update(count=10_000), r"oversized"),
        (lambda h: h.update(unit=4), r"delta\.buffer_nbytes is"),
        (lambda h: h.update(unit=5), r"delta\.unit is 5"),
        (lambda h: h.update(nbytes=-1), r"delta\.nbytes must be an integer >= 1"),
        (lambda h: h.update(positions_dtype="int64"), r"delta\.positions_dtype"),
        (lambda h: h.update(positions_dtype="bogus"), r"delta\.positions_dtype"),
        (lambda h: h.update(values_offset=0), r"delta\.values_offset is 0"),
        (lambda h: h.update(base_version=None), r"delta\.base_version"),
        (lambda h: h.update(base_digest=5), r"delta\.base_digest is 5"),
    ],
)
def test_malformed_headers_are_refused_naming_the_field(chunk, change, match):
    header, buffer = _wire(chunk)
    header = dict(header)
    change(header)
    with pytest.raises(ValueError, match=match):
        ChunkDelta.from_wire(header, buffer)


def test_partial_and_overlong_buffers_are_refused(chunk):
    header, buffer = _wire(chunk)
    for cut in (buffer[:-1], buffer[: header["values_offset"]], buffer[:0]):
        with pytest.raises(ValueError, match=r"delta\.buffer has .* partial"):
            ChunkDelta.from_wire(header, cut)
    longer = torch.cat([buffer, torch.zeros(2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"delta\.buffer has .* overlong"):
        ChunkDelta.from_wire(header, longer)
    with pytest.raises(ValueError, match=r"delta\.buffer must be a 1-D contiguous"):
        ChunkDelta.from_wire(header, buffer.view(torch.int16))
    with pytest.raises(ValueError, match=r"delta\.buffer must be a uint8 tensor"):
        ChunkDelta.from_wire(header, [0] * buffer.numel())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delta header must be a JSON object"):
        ChunkDelta.from_wire([header], buffer)


def test_misaligned_wire_buffer_is_parsed_from_a_copy(chunk):
    base, new, delta = chunk
    header, buffer = delta.to_wire()
    backing = torch.cat([torch.zeros(1, dtype=torch.uint8), buffer])
    parsed = ChunkDelta.from_wire(header, backing[1:])
    target = base.clone()
    apply_delta(target, parsed, held_version=5)
    assert torch.equal(target, new)


def test_encode_refuses_mismatched_inputs():
    a = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must match in length"):
        encode_delta(a, torch.zeros(6, dtype=torch.uint8), unit=2, base_version=0)
    with pytest.raises(ValueError, match="new must be a 1-D contiguous uint8"):
        encode_delta(a, a.view(torch.int16), unit=2, base_version=0)
    with pytest.raises(ValueError, match=r"delta\.unit is 3"):
        encode_delta(a, a.clone(), unit=3, base_version=0)
    assert encode_delta(a[:0], a[:0], unit=2, base_version=0) is None


def test_the_probe_compares_only_the_leading_bytes_and_the_slabs_still_decide(
    monkeypatch,
):
    """A chunk larger than a slab is probed over its first ``PROBE_BYTES``
    only (a whole 1 GiB device slab cost as much as the encode): changes past
    the probe are still found by the slabs, which send a chunk changed all
    over whole, and a sparse delta comes out exact."""
    from vllm.distributed.weight_transfer.pull import delta as codec

    monkeypatch.setattr(codec, "PROBE_BYTES", 64 * 1024)
    nbytes = 4 * codec.CPU_SLAB_BYTES
    base = torch.zeros(nbytes, dtype=torch.uint8)
    behind = base.clone()
    behind[codec.PROBE_BYTES :] = 1  # unchanged where the probe looks
    assert encode_delta(base, behind, unit=2, base_version=0) is None
    sparse = base.clone()
    sparse[codec.PROBE_BYTES :: 4096] = 7
    delta = encode_delta(base, sparse, unit=2, base_version=0)
    assert delta is not None and delta.count == len(
        range(codec.PROBE_BYTES, nbytes, 4096)
    )
    target = base.clone()
    apply_delta(target, delta, held_version=0)
    assert torch.equal(target, sparse)


def test_a_chunk_changed_all_over_stops_after_its_first_slab(monkeypatch):
    """Sending whole is always exact, so the encoder stops comparing once
    the slabs seen so far project a delta larger than the chunk; a chunk
    whose few changes all sit in its first slab is still encoded."""
    from vllm.distributed.weight_transfer.pull import delta as codec

    nbytes = 4 * codec.CPU_SLAB_BYTES
    base = torch.zeros(nbytes, dtype=torch.uint8)
    calls = []
    real = torch.nonzero

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", counting)
    assert encode_delta(base, base + 1, unit=2, base_version=0) is None
    assert not calls  # the probe of the first slab counts without listing
    front = base.clone()
    front[: nbytes // 64] = 1  # 1/64 of the chunk, all in the first slab
    delta = encode_delta(base, front, unit=2, base_version=0)
    assert delta is not None and delta.count == nbytes // 128


# -- a chunk held in pieces (the served tensors a chunk's slices landed in) --

# (byte offset, length) of each piece in a 4096-byte chunk; the rest is the
# chunk's zero padding. Lengths of whole bf16 elements, some not whole words.
PIECES = [(0, 1000), (1008, 6), (1024, 2048), (3088, 1000)]


def _in_pieces(dtype, rate, device="cpu"):
    """A packed base and new chunk whose padding is zero (as a producer
    packs), and the base's pieces as separate tensors."""
    base, new, _ = _pair(dtype, rate, n=4096 // dtype.itemsize, device=device)
    padding = torch.ones_like(base, dtype=torch.bool)
    for offset, size in PIECES:
        padding[offset : offset + size] = False
    base[padding] = 0
    new[padding] = 0
    pieces = [(o, base[o : o + n].clone()) for o, n in PIECES]
    return base, new, pieces


def _laid_out(pieces, nbytes=4096):
    out = torch.zeros(nbytes, dtype=torch.uint8, device=pieces[0][1].device)
    for offset, piece in pieces:
        out[offset : offset + piece.numel()] = piece
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.2])
def test_a_delta_written_into_pieces_equals_one_applied_to_the_whole_chunk(
    rate, device
):
    base, new, pieces = _in_pieces(torch.bfloat16, rate, device)
    assert delta_mod.pieces_checksum(4096, pieces) == payload_checksum(base)
    delta = encode_delta(base, new, unit=2, base_version=5)
    assert delta is not None
    unproven = delta_mod.delta_for_pieces(
        [(o, p.clone()) for o, p in pieces],
        delta,
        nbytes=4096,
        held_version=5,
        checksum_after=False,
    )
    assert unproven.checksum is None
    plan = delta_mod.delta_for_pieces(pieces, delta, nbytes=4096, held_version=5)
    # Checked and split, nothing written yet; the checksum is the new bytes'.
    assert torch.equal(_laid_out(pieces), base)
    assert plan.checksum == payload_checksum(new)
    plan.write()
    assert torch.equal(_laid_out(pieces), new)


def test_pieces_that_are_not_the_base_or_a_position_in_the_padding_are_refused():
    base, new, pieces = _in_pieces(torch.bfloat16, 0.05)
    delta = encode_delta(base, new, unit=2, base_version=5)
    assert delta is not None
    laid_out = _laid_out(pieces)
    # A byte of a piece changed out of band: its checksum is not the base's.
    pieces[2][1][7] ^= 4
    with pytest.raises(DeltaBaseMismatch, match="delta.base_digest"):
        delta_mod.delta_for_pieces(pieces, delta, nbytes=4096, held_version=5)
    pieces[2][1][7] ^= 4
    with pytest.raises(DeltaBaseMismatch, match="delta.base_version"):
        delta_mod.delta_for_pieces(pieces, delta, nbytes=4096, held_version=4)
    # A position in the padding between pieces (bytes 1006-1007 are padding:
    # element 503), with a digest that matches: refused, naming it.
    bad = ChunkDelta(
        base_version=5,
        base_digest=delta.base_digest,
        nbytes=4096,
        unit=2,
        positions=torch.tensor([10, 503], dtype=torch.int32),
        values=torch.tensor([1, 1], dtype=torch.int16),
    )
    with pytest.raises(
        ValueError, match=r"delta.positions holds position 503 .*padding"
    ):
        delta_mod.delta_for_pieces(pieces, bad, nbytes=4096, held_version=5)
    # A size other than the chunk's, its digest made to agree: refused, named.
    longer = dataclasses.replace(
        delta,
        nbytes=4112,
        base_digest=delta.base_digest.replace("ws1:4096:", "ws1:4112:"),
    )
    with pytest.raises(ValueError, match="delta.nbytes is 4112"):
        delta_mod.delta_for_pieces(pieces, longer, nbytes=4096, held_version=5)
    assert torch.equal(_laid_out(pieces), laid_out)


def test_pieces_must_start_words_and_lie_in_order():
    piece = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not start a word"):
        delta_mod.pieces_checksum(64, [(2, piece)])
    with pytest.raises(ValueError, match="does not start a word"):
        delta_mod.pieces_checksum(64, [(16, piece), (8, piece)])
    with pytest.raises(ValueError, match="does not start a word"):
        delta_mod.pieces_checksum(64, [(60, piece)])
    delta = _delta(
        [1], [7], nbytes=64, digest=payload_checksum(torch.zeros(64, dtype=torch.uint8))
    )
    with pytest.raises(ValueError, match="not a contiguous"):
        delta_mod.delta_for_pieces([(2, piece)], delta, nbytes=64, held_version=3)
