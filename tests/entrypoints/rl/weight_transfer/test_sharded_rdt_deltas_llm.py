# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt delta syncs end to end on vLLM CPU over NIXL: a Ray trainer
with ``delta_bases_gb`` set serves an offline ``LLM``; after the first sync
each chunk whose changed elements encode smaller than the chunk travels as a
delta against what the worker landed, and after every sync vLLM serves bit
for bit what a fresh vLLM load of the trainer's weights serves."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator

import pytest

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_bit_identical,
    assert_same_greedy,
    build_tiny_model,
    logprob_atol,
)

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
pytest.importorskip("nixl")

DELTA_GB = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(ray_cluster):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        stop_llm_host,
    )

    model_dir = str(build_tiny_model(TinyModelSpec(arch="qwen3")))
    config = WeightTransferConfig(backend="sharded_rdt")
    llm = ray.remote(num_cpus=0)(LLMHost).remote(
        model_dir, tp=1, weight_transfer_config=config
    )
    ray.get(llm.pids.remote())
    yield llm, model_dir
    stop_llm_host(llm)


@contextlib.contextmanager
def _trainer(model_dir: str) -> Iterator:
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        TrainerRank,
    )

    rank = ray.remote(num_cpus=0)(TrainerRank).remote(model_dir, 0, 1, _free_port())
    try:
        yield rank
    finally:
        ray.get(rank.shutdown.remote())
        ray.kill(rank)


def _assert_serves_trainer(llm, rank) -> None:
    served = ray.get(llm.greedy.remote())
    with tempfile.TemporaryDirectory(prefix="fresh-load-") as checkpoint:
        ray.get(rank.save_checkpoint.remote(checkpoint))
        expected = ray.get(llm.fresh_load_greedy.remote(checkpoint))
    assert_bit_identical(served, expected)
    assert_same_greedy(
        served, ray.get(rank.greedy.remote()), atol=logprob_atol("float32")
    )


def test_delta_syncs_move_only_changed_bytes_and_serve_the_trainers_weights(engine):
    llm, model_dir = engine
    with _trainer(model_dir) as rank:
        ray.get(rank.init.remote(llm, num_consumers=1, delta_bases_gb=DELTA_GB))
        ray.get(rank.randomize.remote(11))
        ray.get(rank.send.remote())
        _assert_serves_trainer(llm, rank)
        (first,) = ray.get(llm.receipts.remote())
        assert first["delta_chunks"] == 0
        assert first["read_bytes"] >= first["planned_bytes"]
        for step in range(3):
            ray.get(rank.nudge.remote(step, 0.01))
            ray.get(rank.send.remote())
            _assert_serves_trainer(llm, rank)
            (receipt,) = ray.get(llm.receipts.remote())
            assert receipt["delta_chunks"] > 0, receipt
            assert receipt["delta_refused"] == 0, receipt
            assert receipt["bytes"] == receipt["planned_bytes"]
            # 1% of fp32 elements changed: 8 bytes each against 4 whole.
            assert receipt["read_bytes"] < 0.1 * receipt["planned_bytes"], receipt
