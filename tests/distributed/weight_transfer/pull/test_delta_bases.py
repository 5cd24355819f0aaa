# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deltas between a producer and a consumer over the in-process transport:
what each side keeps, when a delta is offered and used, and that every
refusal reads the whole chunk and still lands the producer's exact bytes."""

import threading

import pytest
import torch

from vllm.distributed.weight_transfer.plan.ops import SliceSpec
from vllm.distributed.weight_transfer.pull.chunks import make_chunk
from vllm.distributed.weight_transfer.pull.delta_bases import (
    HeldBases,
    KeptBytes,
    OfferedDelta,
    PublishedBases,
    land_delta,
)
from vllm.distributed.weight_transfer.pull.producer import Producer
from vllm.distributed.weight_transfer.pull.transport import (
    InProcessServer,
    InProcessTransport,
)
from vllm.distributed.weight_transfer.verification import payload_checksum

NAMES = ["a", "b"]
SHAPE = (64, 32)


def _chunks():
    """One chunk per name: bf16 ``a`` and fp32 ``b`` (units 2 and 4)."""
    return [
        make_chunk(
            group=0, producer=0, seq=0, specs=[SliceSpec("a", (), SHAPE, "bfloat16")]
        ),
        make_chunk(
            group=1, producer=0, seq=1, specs=[SliceSpec("b", (), SHAPE, "float32")]
        ),
    ]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(SHAPE, generator=gen).to(torch.bfloat16),
        "b": torch.randn(SHAPE, generator=gen),
    }


def _step(weights: dict[str, torch.Tensor], changed: int) -> dict[str, torch.Tensor]:
    """``weights`` with the first ``changed`` elements of each tensor moved."""
    out = {k: v.clone() for k, v in weights.items()}
    for v in out.values():
        v.view(-1)[:changed] += 1
    return out


# Every `Pair` a test made, closed after it (`_close_pairs`): the in-process
# registry would keep each producer, and its serve buffers' reserved memory,
# for the rest of the pytest process, where later forks then fail (ENOMEM).
_OPEN_PAIRS: list["Pair"] = []


@pytest.fixture(autouse=True)
def _close_pairs():
    yield
    while _OPEN_PAIRS:
        _OPEN_PAIRS.pop().close()


class ServedChunks:
    """`ReadBack` over a stand-in for the served tensors: each chunk's
    bytes as last landed, in tensors of their own."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def land(self, index: int, data: torch.Tensor) -> None:
        self.tensors[index] = data.clone()

    def can_read_back(self, index: int) -> bool:
        return True

    def read_back(self, index: int, into: torch.Tensor) -> None:
        into.copy_(self.tensors[index])

    def pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        return [(0, self.tensors[index])]


class Pair:
    """A producer with deltas on and one consumer holding bases; with
    ``checksums`` off the worker's stored checksums are all that checks a
    delta's base. ``served``: the consumer keeps no copies but reads each
    chunk back from what it landed (`ServedChunks`); ``in_place``: and
    writes deltas there."""

    def __init__(
        self,
        limit: int = 1 << 20,
        held_limit: int = 1 << 20,
        device: str = "cpu",
        checksums: bool = True,
        served: bool = False,
        in_place: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.producer = Producer(
            rank=0,
            names=NAMES,
            group_lens=[1, 1],
            served_names=NAMES,
            stall_timeout_s=5.0,
            checksums=checksums,
            delta_bases_bytes=limit,
            device=self.device,
        )
        self.chunks = _chunks()
        self.server = InProcessServer(self.producer)
        self.link = InProcessTransport().connect(0, self.server.endpoint())
        self.link.register(0, self.chunks, _digest(self.chunks))
        self.served = ServedChunks() if served else None
        self.held = HeldBases(held_limit, served=self.served)
        self.held.write_served = in_place
        self.sync = 0
        _OPEN_PAIRS.append(self)

    def close(self) -> None:
        self.link.close()
        self.server.close()
        self.producer.close()

    def sync_once(self, weights, corrupt=None, commit: bool = True):
        """One sync of ``weights``; returns (what each pull brought, the
        bytes landed per chunk). ``corrupt(index, held)`` runs before each
        pull."""
        self.sync += 1
        self.link.sync_id = self.sync
        # As the worker does from the publication header.
        self.link.checksums = self.producer.settings.checksums
        results, landed = [], []

        def trainer():
            self.producer.begin_sync([0], self.sync)
            for group, name in enumerate(NAMES):
                self.producer.wait_credit()
                self.producer.publish(group, {name: weights[name]})
            self.producer.end_sync()

        thread = threading.Thread(target=trainer)
        thread.start()
        for i, chunk in enumerate(self.chunks):
            if corrupt is not None:
                corrupt(i, self.held)
            into = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
            result = self.link.pull(chunk, into, None, self.held.base(i))
            self.held.record(i, into, self.sync)
            if result.in_place is not None:
                # The served bytes were checked; written now, as a landing.
                assert self.served is not None
                result.in_place.write()
                into = self.served.tensors[i]
            elif self.served is not None:
                self.served.land(i, into)
            want = payload_checksum(into) if self.producer.settings.checksums else None
            assert result.checksum == want
            results.append(result)
            landed.append(into.cpu())
        thread.join(10)
        if commit:
            self.held.commit()
        else:
            self.held.discard_pending()
        return results, landed


def _digest(chunks):
    from vllm.distributed.weight_transfer.pull.chunks import chunks_digest

    return chunks_digest(chunks)


def _expected(weights) -> list[torch.Tensor]:
    return [weights[n].contiguous().view(-1).view(torch.uint8) for n in NAMES]


def _same(landed, weights) -> bool:
    return all(
        torch.equal(a, b) for a, b in zip(landed, _expected(weights), strict=True)
    )


def test_a_second_sync_moves_only_the_changed_elements_and_lands_them_exactly():
    pair = Pair()
    w1 = _weights(0)
    first, landed = pair.sync_once(w1)
    assert [r.delta for r in first] == [None, None]  # nothing held yet
    assert _same(landed, w1)
    w2 = _step(w1, 5)
    second, landed = pair.sync_once(w2)
    assert [r.delta for r in second] == ["applied", "applied"]
    assert _same(landed, w2)
    whole = sum(c.nbytes for c in pair.chunks)
    # 5 changed elements per chunk: int32 positions and 2- or 4-byte values.
    assert sum(r.read_bytes for r in second) < whole // 50
    assert pair.producer.deltas_offered == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serve_and_receive_buffers_on_a_gpu_apply_deltas_exactly():
    """Producer serve buffers and the worker's receive buffer on the GPU:
    deltas encode on the GPU against the producer's copies there, apply on
    the device from the worker's host copies, and a flipped held byte still
    reads the whole chunk."""
    pair = Pair(device="cuda")
    w1 = _weights(0)
    pair.sync_once({k: v.cuda() for k, v in w1.items()})
    w2 = _step(w1, 5)
    results, landed = pair.sync_once({k: v.cuda() for k, v in w2.items()})
    assert [r.delta for r in results] == ["applied", "applied"]
    assert _same(landed, w2)
    # The producer compares on the GPU, next to its serve buffers; the
    # worker keeps its copies in host memory.
    assert pair.producer.bases is not None
    assert all(e.data.is_cuda for e in pair.producer.bases._entries.values())
    assert all(not e.data.is_cuda for e in pair.held._entries.values())

    # A byte past the elements the step moves: the delta does not overwrite
    # it, so the rebuilt chunk is not the producer's and is read whole.
    def flip(index, held):
        held.base(index).data[40] ^= 0x04

    w3 = _step(w2, 2)
    results, landed = pair.sync_once({k: v.cuda() for k, v in w3.items()}, flip)
    assert all("checksum" in r.delta for r in results), results
    assert _same(landed, w3)


def test_an_unchanged_sync_is_an_empty_delta_and_a_fully_changed_one_travels_whole():
    pair = Pair()
    w1 = _weights(0)
    pair.sync_once(w1)
    same, landed = pair.sync_once(w1)
    assert [r.delta for r in same] == ["applied", "applied"]
    assert _same(landed, w1)
    w3 = _weights(1)
    whole, landed = pair.sync_once(w3)
    assert [r.delta for r in whole] == [None, None]  # none offered
    assert [r.read_bytes for r in whole] == [c.nbytes for c in pair.chunks]
    assert _same(landed, w3)


@pytest.mark.parametrize(
    "damage",
    ["flip_held_byte", "older_version", "failed_update"],
)
def test_a_worker_without_the_exact_base_reads_whole_chunks_and_ends_exact(damage):
    pair = Pair()
    w1 = _weights(0)
    pair.sync_once(w1)
    w2 = _step(w1, 3)
    if damage == "failed_update":
        # The update that landed w2 failed: its bytes are not bases.
        pair.sync_once(w2, commit=False)
        assert pair.held.base(0) is None
        results, landed = pair.sync_once(_step(w2, 4))
        assert [r.delta for r in results] == [None, None]
        assert _same(landed, _step(w2, 4))
        return

    def corrupt(index, held):
        base = held.base(index)
        if damage == "flip_held_byte":
            base.data[7] ^= 0x01
        else:
            base.version -= 1

    results, landed = pair.sync_once(w2, corrupt=corrupt)
    assert all(r.delta and r.delta != "applied" for r in results)
    word = "checksum" if damage == "flip_held_byte" else "base_version"
    assert all(word in r.delta for r in results), results
    assert [r.read_bytes for r in results] == [c.nbytes for c in pair.chunks]
    assert _same(landed, w2)
    # The whole chunks became the bases: the next sync is a delta again.
    again, landed = pair.sync_once(_step(w2, 2))
    assert [r.delta for r in again] == ["applied", "applied"]
    assert _same(landed, _step(w2, 2))


def test_a_missed_sync_still_applies_when_the_producer_kept_the_workers_base():
    pair = Pair()
    w1 = _weights(0)
    pair.sync_once(w1)
    # The worker is not live in sync 2: the producer packs nothing for it,
    # so its kept bytes stay those of sync 1.
    pair.sync += 1
    pair.producer.begin_sync([], pair.sync)
    for group, name in enumerate(NAMES):
        pair.producer.publish(group, {name: _step(w1, 1)[name]})
    pair.producer.end_sync()
    results, landed = pair.sync_once(_step(w1, 6))
    assert [r.delta for r in results] == ["applied", "applied"]
    assert _same(landed, _step(w1, 6))


def test_stores_past_their_limit_keep_nothing_and_those_chunks_travel_whole():
    a_bytes = _chunks()[0].nbytes
    pair = Pair(limit=a_bytes)  # room for chunk 0 only on the producer
    w1 = _weights(0)
    pair.sync_once(w1)
    assert pair.producer.bases is not None
    assert pair.producer.bases.used_bytes == a_bytes
    results, landed = pair.sync_once(_step(w1, 2))
    assert [r.delta for r in results] == ["applied", None]
    assert _same(landed, _step(w1, 2))
    pair = Pair(held_limit=a_bytes)  # the worker keeps chunk 0 only
    pair.sync_once(w1)
    results, _ = pair.sync_once(_step(w1, 2))
    assert [r.delta for r in results] == ["applied", None]


def test_registering_another_plan_forgets_the_kept_bytes():
    bases = PublishedBases(1 << 20)
    out = torch.empty(1024, dtype=torch.uint8)
    packed = torch.arange(256, dtype=torch.uint8)
    assert bases.offer((0, 0), packed, 1, out, unit=1) is None
    assert bases.offer((1, 0), packed, 1, out, unit=1) is None
    bases.forget(0)
    assert len(bases) == 1 and bases.used_bytes == 256


def _committed(data: torch.Tensor) -> KeptBytes:
    """A worker's committed copy of ``data`` as sync 1's chunk 0."""
    held = HeldBases(1 << 20)
    held.record(0, data, 1)
    held.commit()
    base = held.base(0)
    assert isinstance(base, KeptBytes)
    return base


def _encoded(base, new, unit):
    from vllm.distributed.weight_transfer.pull.delta import encode_delta

    delta = encode_delta(base, new, unit=unit, base_version=1)
    assert delta is not None
    return delta.to_wire()


def _offer(header, wire):
    return OfferedDelta(header, wire.numel(), lambda into: into.copy_(wire))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("format", 2, "delta.format"),
        ("base_digest", "ws1:4096:0000000000000000", "checksum"),
        ("base_digest", "md5:abc", "base_digest"),
        ("nbytes", 4094, "delta.nbytes"),
        ("unit", 3, "delta.unit"),
        ("count", 10**9, "delta.count"),
        ("positions_dtype", "int64", "positions_dtype"),
        ("values_offset", 0, "values_offset"),
        ("buffer_nbytes", 1, "buffer_nbytes"),
        ("base_version", "1", "base_version"),
        ("extra", 1, "extra|unknown"),
    ],
)
def test_every_bad_header_field_is_refused_before_the_held_bytes_are_used(
    field, value, match
):
    """``land_delta`` refuses (ValueError naming the field) and the caller
    then reads the whole chunk; the held bytes are never written."""
    base = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    new = base.clone()
    new[100:110] += 1
    header, wire = _encoded(base, new, unit=2)
    header[field] = value
    held = _committed(base)
    kept = held.data.clone()
    into = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        land_delta(_offer(header, wire), into, held)
    assert torch.equal(held.data, kept)


def test_a_partial_or_oversized_delta_is_refused():
    base = torch.zeros(4096, dtype=torch.uint8)
    new = base.clone()
    new[::512] = 1
    header, wire = _encoded(base, new, unit=1)
    held = _committed(base)
    into = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="partial|buffer"):
        land_delta(_offer(header, wire[:-1]), into, held)
    huge = OfferedDelta(header, 4096, lambda i: None)
    with pytest.raises(ValueError, match="smaller than its chunk"):
        land_delta(huge, into, held)
    land_delta(_offer(header, wire), into, held)
    assert torch.equal(into, new)


def test_a_refused_delta_over_the_link_reads_the_whole_chunk(monkeypatch):
    """A producer whose delta header is wrong (here: another base digest)
    still serves the exact bytes: the consumer refuses the delta and reads
    the whole chunk, which the producer holds until ``read_done``."""
    pair = Pair()
    w1 = _weights(0)
    pair.sync_once(w1)
    real = PublishedBases.offer

    def lying_offer(self, *args, **kwargs):
        header = real(self, *args, **kwargs)
        if header is not None:
            header["base_digest"] = f"ws1:{header['nbytes']}:{'0' * 16}"
        return header

    monkeypatch.setattr(PublishedBases, "offer", lying_offer)
    results, landed = pair.sync_once(_step(w1, 3))
    assert all("checksum" in r.delta for r in results), results
    assert _same(landed, _step(w1, 3))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("checksums", [True, False])
def test_deltas_rebuilt_from_the_served_bytes_keep_no_copy_and_end_exact(
    monkeypatch, checksums, in_place
):
    """A worker that reads its bases back from the served tensors keeps no
    bytes; its deltas apply there, exactly: rebuilt in the receive buffer
    from the bytes read back, or (``in_place``) checked where the served
    bytes lie and written there. A served byte changed out of band is
    refused by the base's checksum, the chunk read whole, and the next
    sync deltas again. With payload checksums the rebuilt chunk's checksum
    follows from the base's (taken from the served bytes) and the changed
    elements: no second pass over the chunk."""
    from vllm.distributed.weight_transfer.pull import transport

    passes: list[int] = []
    counted = transport.payload_checksum

    def counting(buf: torch.Tensor) -> str:
        passes.append(buf.numel())
        return counted(buf)

    monkeypatch.setattr(transport, "payload_checksum", counting)
    pair = Pair(served=True, checksums=checksums, in_place=in_place)
    w1 = _weights(0)
    results, landed = pair.sync_once(w1)
    assert [r.delta for r in results] == [None, None]
    w2 = _step(w1, 3)
    results, landed = pair.sync_once(w2)
    assert [r.delta for r in results] == ["applied", "applied"]
    assert [r.in_place is not None for r in results] == [in_place] * 2
    assert passes == []
    assert _same(landed, w2)
    assert pair.held.used_bytes == 0 and pair.held.served_chunks == 2
    assert all(
        r.read_bytes < c.nbytes for r, c in zip(results, pair.chunks, strict=True)
    )

    served = pair.served
    assert served is not None

    def flip(index, _held):
        if index == 0:
            served.tensors[0][5] ^= 0x10

    w3 = _step(w2, 4)
    results, landed = pair.sync_once(w3, corrupt=flip)
    assert results[1].delta == "applied"
    assert results[0].delta and "checksum" in results[0].delta, results
    assert results[0].read_bytes == pair.chunks[0].nbytes
    assert _same(landed, w3)
    again, landed = pair.sync_once(_step(w3, 2))
    assert [r.delta for r in again] == ["applied", "applied"]
    assert _same(landed, _step(w3, 2))


def test_served_bases_follow_commits_and_failed_updates():
    """A served chunk becomes a base only when its update commits; a failed
    update leaves no base (its bytes may be half landed), and a chunk that
    can no longer be read back (the lander changed) is refused, not
    guessed."""
    pair = Pair(served=True)
    w1 = _weights(0)
    pair.sync_once(w1)
    w2 = _step(w1, 3)
    pair.sync_once(w2, commit=False)
    assert pair.held.base(0) is None and pair.held.base(1) is None
    results, landed = pair.sync_once(_step(w2, 4))
    assert [r.delta for r in results] == [None, None]
    assert _same(landed, _step(w2, 4))

    def unreadable(_index, _into):
        raise ValueError("chunk 0 cannot be read back from served tensors")

    assert pair.served is not None
    pair.served.read_back = unreadable  # type: ignore[method-assign]
    results, landed = pair.sync_once(_step(w2, 5))
    assert all("cannot be read back" in r.delta for r in results), results
    assert _same(landed, _step(w2, 5))
