# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ray Direct Transport between real Ray actors on CPU: a producer actor serves
packed chunks through a ``tensor_transport="nixl"`` method to a consumer actor
created with ``enable_tensor_transport=True``, resolved by name; the producer's
checksums match the bytes received, and a receipt the consumer delivers is
what the trainer collects."""

from __future__ import annotations

import time

import pytest
import torch

from vllm.distributed.weight_transfer.testing.sharded_rdt_procs import (
    toy_names,
    toy_pull_plan,
    toy_tensors,
)
from vllm.distributed.weight_transfer.verification import (
    Receipt,
    coverage_digest,
)

pytestmark = [pytest.mark.slow, pytest.mark.nixl]
ray = pytest.importorskip("ray")
pytest.importorskip("nixl")

LAYERS, ROWS, COLS, KEEP = 3, 32, 16, 8
RECEIPT = Receipt(
    publication_id="ab" * 16,
    model_version=3,
    worker_rank=0,
    worker_device="cpu:toy:0",
    manifest_digest=coverage_digest(()),
    scope="full",
    tensors_landed=5,
    bytes_landed=2560,
    expected_bytes=2560,
    complete=True,
    coverage=coverage_digest(()),
    checksums_verified=5,
)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace="sharded-rdt-test")
    yield
    ray.shutdown()


def test_rdt_pulls_between_ray_actors(ray_cluster):
    from vllm.distributed.weight_transfer.pull.ray import RdtProducerServer
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        ToyRdtConsumer,
    )

    names = toy_names(LAYERS)
    server = RdtProducerServer(
        dict(
            rank=0,
            names=names,
            group_lens=[1] * len(names),
            served_names=names,
            stall_timeout_s=60.0,
            checksums=True,
        ),
        name="rdt-test-producer",
        namespace="sharded-rdt-test",
        max_concurrency=8,
    )
    try:
        pulls = toy_pull_plan(LAYERS, ROWS, COLS, KEEP)
        consumer = ray.remote(num_cpus=0, enable_tensor_transport=True)(
            ToyRdtConsumer
        ).remote()
        ref = consumer.pull_all.remote(
            "rdt-test-producer",
            "sharded-rdt-test",
            [c.to_json() for c in pulls.chunks],
            pulls.digest(0),
            checksums=True,
            receipt=RECEIPT.to_dict(),
        )
        tensors = toy_tensors(LAYERS, ROWS, COLS, seed=5)
        deadline = time.monotonic() + 120
        while True:  # the consumer registers before the sync may begin
            try:
                server.begin_sync([0])
                break
            except Exception as e:
                if "have not registered" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for gi, name in enumerate(names):
            server.wait_credit()
            server.publish(gi, {name: tensors[name]})
        server.end_sync()
        got = ray.get(ref, timeout=120)
        for name in names:
            assert torch.equal(got[name], tensors[name][:KEEP])
        # The receipt the consumer delivered, read through the actor's inbox.
        assert server.receipts.collect(RECEIPT.publication_id, [0], 30) == [RECEIPT]
        server.receipts.discard(RECEIPT.publication_id)
    finally:
        server.close()


def test_a_second_sync_over_ray_moves_deltas_and_lands_exact_bytes(ray_cluster):
    """With deltas on, the produce method returns the delta (and its header)
    instead of the packed chunk; the consumer applies it to the bytes it
    landed last sync and gets the exact new bytes. A consumer that holds no
    base reads the whole chunk through the actor's whole-chunk method."""
    from vllm.distributed.weight_transfer.pull.ray import RdtProducerServer
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        ToyRdtConsumer,
    )

    names = toy_names(LAYERS)
    server = RdtProducerServer(
        dict(
            rank=0,
            names=names,
            group_lens=[1] * len(names),
            served_names=names,
            stall_timeout_s=60.0,
            checksums=True,
            delta_bases_bytes=1 << 20,
        ),
        name="rdt-delta-producer",
        namespace="sharded-rdt-test",
        max_concurrency=8,
    )
    pulls = toy_pull_plan(LAYERS, ROWS, COLS, KEEP)
    whole = sum(c.nbytes for c in pulls.chunks)

    def sync(consumer, sync_id: int, tensors) -> dict:
        ref = consumer.pull_sync.remote(sync_id)
        server.begin_sync([0], sync_id)
        for gi, name in enumerate(names):
            server.wait_credit()
            server.publish(gi, {name: tensors[name]})
        server.end_sync()
        got = ray.get(ref, timeout=120)
        for name in names:
            assert torch.equal(got["tensors"][name], tensors[name][:KEEP]), name
        return got

    def attach(consumer) -> None:
        ray.get(
            consumer.attach.remote(
                "rdt-delta-producer",
                "sharded-rdt-test",
                [c.to_json() for c in pulls.chunks],
                pulls.digest(0),
                1 << 20,
            ),
            timeout=60,
        )

    try:
        make = ray.remote(num_cpus=0, enable_tensor_transport=True)(ToyRdtConsumer)
        consumer = make.remote()
        attach(consumer)
        tensors = toy_tensors(LAYERS, ROWS, COLS, seed=5)
        first = sync(consumer, 1, tensors)
        assert first["deltas"] == [None] * len(pulls.chunks)
        assert first["read_bytes"] == whole
        for step, changed in enumerate([3, 0]):  # a few elements, then none
            tensors = {n: t.clone() for n, t in tensors.items()}
            for t in tensors.values():
                t.view(-1)[:changed] += 1
            got = sync(consumer, 2 + step, tensors)
            assert got["deltas"] == ["applied"] * len(pulls.chunks), got["deltas"]
            assert got["read_bytes"] < whole // 10
        # A fresh consumer holds nothing: the offered deltas go unused and it
        # reads every chunk whole (the producer still kept them for it).
        ray.kill(consumer)
        consumer = make.remote()
        attach(consumer)
        for t in tensors.values():
            t.view(-1)[-2:] -= 1
        got = sync(consumer, 4, tensors)
        assert got["deltas"] == [None] * len(pulls.chunks)
        assert got["read_bytes"] == whole
    finally:
        server.close()
