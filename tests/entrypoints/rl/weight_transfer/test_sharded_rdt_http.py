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
buffer into the served tensor, and never opens the layerwise reload."""

from __future__ import annotations

import pytest
import requests

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_serves_weights,
    build_tiny_model,
    load_hf_model,
    randomize_weights_,
)

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")


def test_serve_pulls_over_nixl_and_matches_the_oracle():
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sharded_rdt_trainer import (
        ShardedRDTTrainerInitInfo,
        ShardedRDTTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.sources import CheckpointNamesSource
    from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
    from vllm.distributed.weight_transfer.testing.server import serve

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    model = load_hf_model(model_dir, "float32")
    with serve(
        model_dir,
        weight_transfer_backend="sharded_rdt",
        weight_transfer_options={"landing": "planned", "cpu_linear": "plain"},
        tensor_parallel_size=2,
    ) as server:
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=2, stall_timeout_s=60.0, verify_checksums=True, rank=0
            ),
            client=HTTPVLLMWeightSyncClient(server.base_url),
            source=CheckpointNamesSource(model),
        )
        assert isinstance(engine, ShardedRDTTrainerWeightTransferEngine)
        try:
            for seed in (201, 202):
                randomize_weights_(model, seed)
                engine.send_weights(weight_version=f"seed-{seed}")
                assert requests.get(f"{server.base_url}/weight_info").json() == {
                    "weight_version": f"seed-{seed}"
                }
                assert engine.last_publication is not None
                verified = engine.last_publication.verified
                assert verified is not None
                assert verified.workers == (0, 1) and verified.checksums_verified > 0
                assert_serves_weights(
                    server.fresh_load_oracle(), model, dtype="float32"
                )
                states = http_worker_call(server.base_url)("planned_landing_state", [])
                for state in states["results"]:
                    assert state["still_bound"] and not state["reloaded"], state
                    assert any(
                        n.endswith("mlp.down_proj.weight")
                        for n in state["direct_names"]
                    )
        finally:
            engine.shutdown()
