# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt under ``vllm serve`` (default executor, TP=2) driven over HTTP: the
worker init info travels as JSON through ``/init_weight_transfer_engine``, each
worker pulls its half over direct NIXL, and ``/v1/completions`` then matches a
Hugging Face forward pass of the trainer's weights."""

from __future__ import annotations

import pytest

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_same_greedy,
    build_tiny_model,
    completions_greedy,
    hf_greedy,
    load_hf_model,
    logprob_atol,
    randomize_weights_,
)

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")


def test_serve_pulls_over_nixl_and_matches_the_oracle():
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sharded_rdt_trainer import (
        ShardedRDTTrainerInitInfo,
    )
    from vllm.distributed.weight_transfer.sources import CheckpointNamesSource
    from vllm.distributed.weight_transfer.testing.server import serve

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    model = load_hf_model(model_dir, "float32")
    with serve(
        model_dir, weight_transfer_backend="sharded_rdt", tensor_parallel_size=2
    ) as server:
        engine = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(num_consumers=2, stall_timeout_s=60.0, rank=0),
            client=HTTPVLLMWeightSyncClient(server.base_url),
            source=CheckpointNamesSource(model),
        )
        try:
            for seed in (201, 202):
                randomize_weights_(model, seed)
                engine.send_weights()
                assert_same_greedy(
                    completions_greedy(server.base_url, server.model),
                    hf_greedy(model),
                    atol=logprob_atol("float32"),
                )
        finally:
            engine.shutdown()
