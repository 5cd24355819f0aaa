# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt under ``vllm serve`` (default executor, TP=2) driven over HTTP: the
worker init info travels as JSON through ``/init_weight_transfer_engine``, each
worker pulls its half over direct NIXL, and ``/v1/completions`` then serves bit
for bit what a fresh vLLM load of the trainer's weights serves, and matches a
Hugging Face forward pass of them. Checksums are on: every
pulled chunk is verified, both workers' receipts come back through the
producer, and ``/weight_info`` shows the step once they verified.

The server lands planned (``"landing": "planned"`` with plain CPU linear
layers): every layer of the dense model keeps its bytes through vLLM's
processing, so each worker copies every pulled byte once, from its receive
buffer into the served tensor, and never opens the layerwise reload.

One server per module; the tests run in file order, each trainer's sync
leaving the server's weights equal to the module's trainer model. The update
guard's refusals hold for this backend too: decoy bodies around the
trainer's real message and another publication's prepare, sent mid-sync, are
refused while the old weights serve, and the sync lands the new ones."""

from __future__ import annotations

from typing import Any

import pytest

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_serves_weights,
    build_tiny_model,
    load_hf_model,
    randomize_weights_,
)
from vllm.distributed.weight_transfer.testing.serve_state import weight_info

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(TinyModelSpec(arch="qwen3"))


@pytest.fixture(scope="module")
def server(model_dir):
    from vllm.distributed.weight_transfer.testing.server import serve

    with serve(
        model_dir,
        weight_transfer_backend="sharded_rdt",
        weight_transfer_options={"landing": "planned", "cpu_linear": "plain"},
        tensor_parallel_size=2,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def model(model_dir):
    return load_hf_model(model_dir, "float32")


def sharded_rdt_trainer(server: Any, model: Any, client: Any = None) -> Any:
    """A trainer of ``model`` for both workers, checksums on, its plan sent
    to ``server`` through ``client`` (default: plain HTTP)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
        ShardedRDTTrainerInitInfo,
        ShardedRDTTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

    engine = WeightTransferTrainerFactory.trainer_init(
        ShardedRDTTrainerInitInfo(
            num_consumers=2, stall_timeout_s=120.0, verify_checksums=True, rank=0
        ),
        client=client or HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        source=CheckpointNamesSource(model),
    )
    assert isinstance(engine, ShardedRDTTrainerWeightTransferEngine)
    return engine


def test_serve_pulls_over_nixl_and_matches_the_oracle(server, model):
    from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call

    engine = sharded_rdt_trainer(server, model)
    try:
        for seed in (201, 202):
            randomize_weights_(model, seed)
            engine.send_weights(weight_version=f"seed-{seed}")
            assert weight_info(server) == {"weight_version": f"seed-{seed}"}
            assert engine.last_publication is not None
            verified = engine.last_publication.verified
            assert verified is not None
            assert verified.workers == (0, 1) and verified.checksums_verified > 0
            assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
            states = http_worker_call(server.base_url)("planned_landing_state", [])
            for state in states["results"]:
                assert state["still_bound"] and not state["reloaded"], state
                assert any(
                    n.endswith("mlp.down_proj.weight") for n in state["direct_names"]
                )
    finally:
        engine.shutdown()


def test_decoys_and_a_stray_prepare_mid_sync_are_refused(server, model):
    """Issue findings 3 and 9 over ``sharded_rdt``, in place: after the start,
    the trainer's real message inside a list next to a message of another
    kind (abort, prepare, adapter) is 422 and the same through
    ``/collective_rpc update_weights`` is 403, before the workers; each time
    the server serves exactly the old weights under the old label. Once the
    workers pulled and landed the new weights (generation held), another
    publication's prepare is 409 naming both ids and closes nothing: the
    sync commits and serves the trainer's new weights exactly."""
    from test_ipc_verified_llm import StrayPrepare

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.testing.guard_decoys import (
        SendsDecoysFirst,
        assert_decoys_refused,
    )

    before = server.greedy()
    label = weight_info(server)
    randomize_weights_(model, seed=203)
    stray = StrayPrepare(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), after=1
    )
    client = SendsDecoysFirst(stray, server)
    engine = sharded_rdt_trainer(server, model, client)
    try:
        engine.send_weights(weight_version="after-the-decoys")
    finally:
        engine.shutdown()

    assert_decoys_refused(client, before, label)
    assert stray.refusal is not None and "HTTP 409" in stray.refusal, stray.refusal
    assert f"names publication '{StrayPrepare.STRAY_ID}'" in stray.refusal
    assert f"open update is publication {stray.publication_id}" in stray.refusal
    assert weight_info(server) == {"weight_version": "after-the-decoys"}
    assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
