# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real CPU `LLM` configured for weight transfer starts and matches the HF oracle."""

import pytest

from vllm.distributed.weight_transfer.testing import (
    assert_same_greedy,
    hf_greedy,
    load_hf_model,
    logprob_atol,
    vllm_greedy,
)

pytestmark = pytest.mark.slow


def test_llm_with_ipc_config_generates_oracle_tokens(tiny_model_dir):
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="ipc"),
    )
    try:
        expected = hf_greedy(load_hf_model(tiny_model_dir))
        assert_same_greedy(vllm_greedy(llm), expected, atol=logprob_atol("float32"))
    finally:
        llm.llm_engine.engine_core.shutdown()
