# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end over HTTP with a mixture-of-experts model: a trainer in this
process updates a ``vllm serve`` of Qwen3-MoE at TP 2 through the ``ipc``
backend, and after every update the server serves bit for bit what a fresh
vLLM load of the trainer's weights serves, and the same greedy output as a
Hugging Face forward pass of them (fp32). The test starts its own server."""

from __future__ import annotations

import pytest

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    build_tiny_model,
    load_hf_model,
    randomize_weights_,
)
from vllm.distributed.weight_transfer.testing.serve_state import assert_serves
from vllm.distributed.weight_transfer.testing.server import serve

pytestmark = pytest.mark.slow


def test_moe_tensor_parallel_update():
    """Qwen3-MoE at TP=2: experts travel under checkpoint names, each TP worker
    reads the same shared-memory buffer and keeps its shard."""
    from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3_moe"))
    model = load_hf_model(model_dir, "float32")
    with serve(model_dir, tensor_parallel_size=2) as moe_server:
        assert_serves(moe_server, model)
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=True),
            client=HTTPVLLMWeightSyncClient(moe_server.base_url, timeout=120),
            source=CheckpointNamesSource(model),
        )
        for seed in (5, 6):
            randomize_weights_(model, seed=seed)
            trainer.send_weights()
            assert_serves(moe_server, model)
