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
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

pytestmark = pytest.mark.slow


def test_llm_with_ipc_config_generates_oracle_tokens(tiny_model_dir):

    llm = tiny_llm(tiny_model_dir)
    try:
        expected = hf_greedy(load_hf_model(tiny_model_dir))
        assert_same_greedy(vllm_greedy(llm), expected, atol=logprob_atol("float32"))
    finally:
        llm.llm_engine.engine_core.shutdown()
