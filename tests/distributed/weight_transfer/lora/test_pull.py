# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Adapter pulls over NIXL (``lora_pull``) without an engine: a trainer's
``AdapterServer`` and workers' ``AdapterPuller``s in one process, talking over
real NIXL agents and the authenticated control socket.

The contract: every worker reads exactly the trainer's packed bytes; the
producer packs once for all of them; a receipt goes back through the
producer; a failure on either side makes the other side raise at once, naming
the cause, instead of waiting for its deadline; malformed pull info and
payload layouts are refused before any view is made."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.lora.pull import (
    AdapterPull,
    AdapterPuller,
    AdapterServer,
    payload_views,
)
from vllm.distributed.weight_transfer.pull.producer import Producer
from vllm.distributed.weight_transfer.verification import (
    Receipt,
    TrainerPublication,
)

pytest.importorskip("nixl")

CPU = torch.device("cpu")


def _payload(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.fixture
def server():
    server = AdapterServer(host="127.0.0.1", stall_timeout_s=10.0, device=CPU)
    yield server
    server.close()


@pytest.fixture
def pullers():
    made = [AdapterPuller(CPU) for _ in range(2)]
    yield made
    for puller in made:
        puller.close()


def _pull_copy(puller: AdapterPuller, pull: AdapterPull) -> torch.Tensor:
    return puller.pull(pull).clone()


def _push(server, pullers, payload, *, workers=None, stop=None):
    """One push: the trainer serves while every puller pulls; returns what
    each puller read (copies) and the trainer's error, if any."""
    pull = server.open_push(payload.numel())
    stop = stop or threading.Event()
    with ThreadPoolExecutor(len(pullers) + 1) as pool:
        serving = pool.submit(
            server.serve, pull, payload, workers or len(pullers), stop
        )
        reads = [pool.submit(_pull_copy, p, pull) for p in pullers]
        got = [r.result(timeout=30) for r in reads]
        serving.result(timeout=30)
    return pull, got


def test_every_worker_reads_the_trainer_bytes_push_after_push(server, pullers):
    for seed, nbytes in ((0, 4096), (1, 1000), (2, 300_000)):
        payload = _payload(nbytes, seed)
        _, got = _push(server, pullers, payload)
        for read in got:
            assert torch.equal(read, payload)
    # One shared serve slot, packed once per push for both workers.
    assert server._server.producer.packed_bytes == 300_000


def test_a_receipt_goes_back_through_the_producer(server, pullers):
    pub = TrainerPublication.open(
        backend="sharded_rdt",
        model_version=1,
        metas=[ParamMeta("a.lora_A.weight", torch.float32, (2, 4))],
        trainer_devices=["cpu"],
        channel="producer",
        inbox=server.receipts,
    )
    _push(server, pullers, _payload(2048, 3))
    receipt = Receipt.failure(pub.header, 1, "cpu", "refused", weights_intact=True)
    pullers[1].deliver_receipt(receipt.to_dict())
    got = server.receipts.read(pub.header.publication_id)
    assert [r.worker_rank for r in got.values()] == [1]
    assert "refused" in (next(iter(got.values())).error or "")


@pytest.mark.serial
def test_a_trainer_that_gives_up_wakes_waiting_workers_at_once(server, pullers):
    pull = server.open_push(1024)
    errors = []

    def pull_and_fail():
        try:
            pullers[0].pull(pull)
        except Exception as e:
            errors.append(e)

    worker = threading.Thread(target=pull_and_fail)
    worker.start()
    time.sleep(0.5)  # registered, now waiting for the sync to begin
    started = time.monotonic()
    server.fail(pull, "the trainer's update_weights failed")
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert time.monotonic() - started < 5.0
    assert errors and "update_weights failed" in str(errors[0])
    # The next push is clean.
    payload = _payload(512, 4)
    _, got = _push(server, pullers, payload)
    assert all(torch.equal(read, payload) for read in got)


@pytest.mark.serial
def test_a_worker_failing_mid_pull_fails_the_push_everywhere_at_once(
    server, pullers, monkeypatch
):
    def no_memory(nbytes):
        raise MemoryError("no room for the adapter")

    monkeypatch.setattr(pullers[1], "_buffer_for", no_memory)
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        _push(server, pullers, _payload(4096, 7))
    assert time.monotonic() - started < 5.0
    assert "no room for the adapter" in str(failure.value)
    monkeypatch.undo()
    payload = _payload(4096, 8)  # the next push is clean
    _, got = _push(server, pullers, payload)
    assert all(torch.equal(read, payload) for read in got)


def test_a_missing_worker_fails_the_push_at_the_deadline_naming_the_count(pullers):
    server = AdapterServer(host="127.0.0.1", stall_timeout_s=1.0, device=CPU)
    try:
        # The worker that did register hears the trainer's reason at once.
        with pytest.raises(RuntimeError, match="1 of 2 workers registered"):
            _push(server, pullers[:1], _payload(256, 5), workers=2)
    finally:
        server.close()


def test_a_stopped_serve_returns_without_serving(server):
    pull = server.open_push(128)
    stop = threading.Event()
    stop.set()
    server.serve(pull, _payload(128, 6), 3, stop)  # nobody registered


def test_fail_sync_before_begin_raises_in_a_waiting_consumer():
    producer = Producer(
        rank=0, names=["x"], group_lens=[1], served_names=["x"], stall_timeout_s=10
    )
    chunk = AdapterPull(
        endpoint={"transport": "nixl"}, sync_id=1, nbytes=16, stall_timeout_s=1
    ).chunk()
    # A chunk of another source name is refused: the producer serves "x".
    with pytest.raises(ValueError, match="unknown checkpoint tensor"):
        producer.register(7, [chunk], "digest")
    assert producer.registered() == frozenset()
    producer.forget_consumers()


@pytest.mark.parametrize(
    "data, match",
    [
        ({"endpoint": {"transport": "rdt"}}, "lacks"),
        (
            {
                "endpoint": {"transport": "rdt"},
                "sync_id": 1,
                "nbytes": 8,
                "stall_timeout_s": 1,
            },
            "'nixl' only",
        ),
        (
            {
                "endpoint": {"transport": "nixl"},
                "sync_id": 0,
                "nbytes": 8,
                "stall_timeout_s": 1,
            },
            "sync_id",
        ),
        (
            {
                "endpoint": {"transport": "nixl"},
                "sync_id": 1,
                "nbytes": True,
                "stall_timeout_s": 1,
            },
            "nbytes",
        ),
        (
            {
                "endpoint": {"transport": "nixl"},
                "sync_id": 1,
                "nbytes": 8,
                "stall_timeout_s": 0,
            },
            "stall_timeout_s",
        ),
        ([1, 2], "must be an object"),
    ],
)
def test_malformed_pull_info_is_refused(data, match):
    with pytest.raises(ValueError, match=match):
        AdapterPull.from_dict(data)


def _layout(**changes):
    message = {
        "names": ["a", "b"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[2, 3], [4]],
        "offsets": [0, 64],
        "tensor_sizes": [24, 8],
    }
    message.update(changes)
    return message


def test_payload_views_read_each_tensor_in_place():
    payload = torch.zeros(72, dtype=torch.uint8)
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.tensor([1.5, -2.0, 3.0, 0.25], dtype=torch.bfloat16)
    payload[:24].view(torch.float32).copy_(a.flatten())
    payload[64:72].view(torch.bfloat16).copy_(b)
    views = dict(payload_views(payload, _layout()))
    assert torch.equal(views["a"], a) and torch.equal(views["b"], b)
    assert views["a"].data_ptr() == payload.data_ptr()  # views, not copies


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"names": ["a"]}, "lists 1 names"),
        ({"tensor_sizes": [24, 9]}, "holds 8 B"),
        ({"offsets": [0, 66]}, "does not fit"),
        ({"offsets": [0, 70]}, "does not fit"),
        ({"shapes": [[2, -3], [4]]}, "has shape"),
        ({"offsets": [0, -2]}, "has offset"),
        ({"dtype_names": ["float32", "complex4"]}, "'b': dtype name is 'complex4'"),
        ({"names": "ab"}, "must be a list"),
    ],
)
def test_a_malformed_payload_layout_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        payload_views(torch.zeros(72, dtype=torch.uint8), _layout(**changes))
