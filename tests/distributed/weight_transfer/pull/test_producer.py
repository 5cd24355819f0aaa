# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-rank producer over the in-process transport: what consumers read is
the replayed slice of the live tensors, groups stay resident only until every
live consumer has read them, and every failure ends the sync with an error."""

import threading
import time

import pytest
import torch

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.pull.chunks import (
    PullPlan,
    build_pull_plan,
)
from vllm.distributed.weight_transfer.pull.producer import (
    Producer,
    ProducerError,
)
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.pull.transport import (
    InProcessServer,
    InProcessTransport,
)

NAMES = ["embed.weight"] + [f"layers.{i}.w" for i in range(4)] + ["head.weight"]
GROUP_LENS = [1, 1, 1, 1, 1, 1]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(6, 4, generator=gen) for n in NAMES}


def _plan(rank_rows: tuple[int, int]):
    """A worker that keeps rows [start, start+n) of every tensor, transposed."""
    start, n = rank_rows
    copies = []
    for name in NAMES:
        chain = (ViewOp("narrow", (0, start, n)), ViewOp("t"))
        spec = SliceSpec(name, chain, (4, n), "float32")
        module, param = name.rsplit(".", 1)
        copies.append(
            SliceCopy(spec, Region(module, param, 0, (4, n), (n, 1), "float32"))
        )
    return build_plan(worker=f"rows {start}", names=NAMES, copies=copies)


def _producer(**kw) -> Producer:
    args: dict = dict(
        rank=0,
        names=NAMES,
        group_lens=GROUP_LENS,
        served_names=NAMES,
        num_slots=2,
        gather_lookahead=1,
        stall_timeout_s=5.0,
    )
    args.update(kw)
    return Producer(**args)


def _pull_all(link, pulls: PullPlan, out: dict, delay: float = 0.0):
    for chunk in pulls.chunks:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
        link.pull(chunk, buf)
        for packed in chunk.slices:
            raw = buf[packed.offset : packed.offset + packed.spec.nbytes]
            out[packed.spec.source] = (
                raw.view(torch.float32).view(packed.spec.shape).clone()
            )
        time.sleep(delay)


def _consumers(producer, plans):
    server = InProcessServer(producer)
    links = []
    router = RdtRouter(1, len(plans))
    pulls = [build_pull_plan(p, router, cid) for cid, p in enumerate(plans)]
    for cid, pp in enumerate(pulls):
        link = InProcessTransport().connect(0, server.endpoint())
        link.register(cid, pp.for_producer(0), pp.digest(0))
        links.append(link)
    return server, links, pulls


def _serve(producer, tensors, on_publish=None, sync_id=None):
    producer.begin_sync(range(producer_live(producer)), sync_id)
    for gi, name in enumerate(NAMES):
        producer.wait_credit()
        producer.publish(gi, {name: tensors[name]})
        if on_publish:
            on_publish(gi)
    producer.end_sync()


def producer_live(producer):
    return len(producer._consumers)


def _run(producer, links, pulls, tensors, delay=0.0, on_publish=None, sync_id=None):
    results: list[dict] = [{} for _ in links]
    errors = []

    def consume(i):
        try:
            _pull_all(links[i], pulls[i], results[i], delay)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(links))]
    for t in threads:
        t.start()
    try:
        _serve(producer, tensors, on_publish, sync_id)
    finally:
        for t in threads:
            t.join(10)
    return results, errors


def test_consumers_read_the_replayed_slices_of_live_tensors():
    producer = _producer()
    _, links, pulls = _consumers(producer, [_plan((0, 3)), _plan((3, 3))])
    for seed in (1, 2):  # a second sync after in-place updates
        tensors = _tensors(seed)
        results, errors = _run(producer, links, pulls, tensors)
        assert not errors
        for name in NAMES:
            assert torch.equal(results[0][name], tensors[name][:3].t())
            assert torch.equal(results[1][name], tensors[name][3:].t())


def test_at_most_lookahead_plus_one_groups_resident():
    producer = _producer(gather_lookahead=1)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    seen = []
    _run(
        producer,
        links,
        pulls,
        _tensors(0),
        delay=0.01,
        on_publish=lambda gi: seen.append(len(producer.resident_groups)),
    )
    assert max(seen) <= 2
    assert producer.max_resident <= 2


def test_shared_serve_slots_pack_once_for_identical_plans():
    producer = _producer(workers_per_replica=1)
    plans = [_plan((0, 3)), _plan((0, 3))]
    _, links, pulls = _consumers(producer, plans)
    tensors = _tensors(3)
    results, errors = _run(producer, links, pulls, tensors)
    assert not errors
    assert torch.equal(results[1]["head.weight"], tensors["head.weight"][:3].t())
    assert producer.packed_bytes == pulls[0].payload_bytes  # packed once


def test_sharers_with_different_plans_are_refused():
    producer = _producer(workers_per_replica=1)
    with pytest.raises(ValueError, match="share its serve buffer"):
        _consumers(producer, [_plan((0, 3)), _plan((3, 3))])


def test_misrouted_and_unknown_names_are_refused_at_registration():
    producer = _producer(served_names=NAMES[:3])
    with pytest.raises(ValueError, match="routed to the wrong producer"):
        _consumers(producer, [_plan((0, 3))])
    pulls = build_pull_plan(_plan((0, 3)), RdtRouter(1, 1), 0)
    producer = _producer(
        names=NAMES[:5], group_lens=GROUP_LENS[:5], served_names=NAMES[:5]
    )
    with pytest.raises(ValueError, match="unknown checkpoint tensor"):
        producer.register(0, pulls.chunks, pulls.digest(0))


@pytest.mark.serial
def test_a_stalled_consumer_fails_the_sync_within_the_timeout():
    producer = _producer(stall_timeout_s=1.0)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    started = time.monotonic()
    with pytest.raises(ProducerError, match="no progress for 1.0s"):
        _serve(producer, _tensors(0))  # nobody pulls
    assert time.monotonic() - started < 3.0
    # the next sync starts clean
    results, errors = _run(producer, links, pulls, _tensors(1))
    assert not errors and len(results[0]) == len(NAMES)


def test_a_failing_trainer_wakes_waiting_consumers():
    producer = _producer(stall_timeout_s=30.0)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    producer.begin_sync([0])
    errors = []
    t = threading.Thread(
        target=lambda: errors.append(
            pytest.raises(ProducerError, _pull_all, links[0], pulls[0], {})
        )
    )
    t.start()
    time.sleep(0.2)
    producer.fail("trainer rank 0: source exploded")
    t.join(5)
    assert not t.is_alive()
    assert "source exploded" in str(errors[0].value)


def test_only_live_consumers_are_waited_for():
    producer = _producer()
    _, links, pulls = _consumers(producer, [_plan((0, 3)), _plan((3, 3))])
    producer.begin_sync([1])
    result: dict = {}
    t = threading.Thread(target=_pull_all, args=(links[1], pulls[1], result))
    t.start()
    tensors = _tensors(4)
    for gi, name in enumerate(NAMES):
        producer.wait_credit()
        producer.publish(gi, {name: tensors[name]})
    producer.end_sync()
    t.join(5)
    assert len(result) == len(NAMES)
    with pytest.raises(ProducerError, match="not live"):
        producer.begin_sync([1])
        try:
            links[0].pull(
                pulls[0].chunks[0],
                torch.empty(pulls[0].chunks[0].nbytes, dtype=torch.uint8),
            )
        finally:
            producer.fail("test over")


@pytest.mark.serial
def test_a_sync_that_failed_before_the_first_pull_is_reported_at_once():
    producer = _producer(stall_timeout_s=30.0)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    producer.begin_sync([0], sync_id=7)
    producer.fail("trainer rank 0: source exploded")
    started = time.monotonic()
    with pytest.raises(ProducerError, match="source exploded"):
        producer.pack(0, 0, sync_id=7)
    assert time.monotonic() - started < 1.0
    with pytest.raises(ProducerError, match="sync ids must increase"):
        producer.begin_sync([0], sync_id=7)
    links[0].sync_id = 8  # the next sync is served normally
    results, errors = _run(producer, links, pulls, _tensors(2))
    assert not errors and len(results[0]) == len(NAMES)


@pytest.mark.serial
def test_an_abort_for_a_sync_not_yet_begun_fails_it_when_it_begins():
    # A worker refuses the update (say, its manifest check) before this
    # trainer rank calls begin_sync: the abort must not be lost.
    producer = _producer(stall_timeout_s=30.0)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    links[0].sync_id = 4
    links[0].abort("ManifestMismatch: head.weight")
    producer.begin_sync([0], sync_id=4)
    started = time.monotonic()
    with pytest.raises(ProducerError, match="head.weight"):
        producer.wait_credit()
        producer.publish(0, {NAMES[0]: _tensors(1)[NAMES[0]]})
        producer.wait_credit()
        producer.publish(1, {NAMES[1]: _tensors(1)[NAMES[1]]})
        producer.wait_credit()
    assert time.monotonic() - started < 5.0
    # the next sync is unaffected
    links[0].sync_id = 5
    producer.begin_sync([0], sync_id=5)
    producer.fail("end the test sync")  # nothing pending for sync 6
    links[0].sync_id = 6
    results, errors = _run(producer, links, pulls, _tensors(2), sync_id=6)
    assert not errors and len(results[0]) == len(NAMES)


@pytest.mark.serial
def test_a_stall_waiting_for_the_next_sync_names_the_stall_not_an_old_abort():
    # A worker refuses a malformed update after sync 1 ended, naming sync 1
    # (its link's last sync id); its next update waits for a sync that never
    # begins. The producer's stall must report that wait, not the old abort.
    producer = _producer(stall_timeout_s=1.0)
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    results, errors = _run(producer, links, pulls, _tensors(1), sync_id=1)
    assert not errors and len(results[0]) == len(NAMES)
    links[0].abort("update_info has unknown field(s) ['bogus']")
    started = time.monotonic()
    with pytest.raises(ProducerError, match="no progress for 1.0s") as info:
        producer.pack(0, 0)
    assert "bogus" not in str(info.value)
    assert time.monotonic() - started < 3.0


def test_checksums_cover_the_packed_bytes_and_sharers_get_the_same_one():
    from vllm.distributed.weight_transfer.verification import payload_checksum

    producer = _producer(workers_per_replica=1, checksums=True)
    _, links, pulls = _consumers(producer, [_plan((0, 3)), _plan((0, 3))])
    seen: list[list[tuple[str | None, str]]] = [[], []]
    real_pull = [link.pull for link in links]
    for i, link in enumerate(links):

        def pull(chunk, into, next_chunk=None, i=i):
            pulled = real_pull[i](chunk, into, next_chunk)
            seen[i].append((pulled.checksum, payload_checksum(into)))
            return pulled

        link.pull = pull
    _, errors = _run(producer, links, pulls, _tensors(4))
    assert not errors
    assert producer.packed_bytes == pulls[0].payload_bytes  # packed once
    for got in seen:
        assert len(got) == len(pulls[0].chunks)
        assert all(theirs == mine for theirs, mine in got)
    assert [c for c, _ in seen[0]] == [c for c, _ in seen[1]]
    with pytest.raises(ProducerError, match="between pack and read_done"):
        producer.packed_checksum(0, 0)  # read and released


def test_checksums_off_by_default_and_receipts_reach_the_inbox():
    from vllm.distributed.weight_transfer.verification import Receipt, coverage_digest

    producer = _producer()
    _, links, pulls = _consumers(producer, [_plan((0, 3))])
    producer.begin_sync([0])
    producer.publish(0, {NAMES[0]: _tensors(5)[NAMES[0]]})
    packed = producer.pack(0, 0)
    assert packed.checksum is None and producer.packed_checksum(0, 0) is None
    producer.fail("test over")
    receipt = Receipt(
        publication_id="cd" * 16,
        model_version=1,
        worker_rank=0,
        worker_device="cpu:toy:0",
        manifest_digest=coverage_digest(()),
        scope="full",
        tensors_landed=0,
        bytes_landed=0,
        expected_bytes=0,
        complete=True,
        coverage=coverage_digest(()),
    )
    links[0].deliver_receipt(receipt.to_dict())
    assert producer.receipts.collect(receipt.publication_id, [0], 1.0) == [receipt]
