# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for testing weight transfer without downloads: generated tiny models,
the same-engine fresh-load oracle and the Hugging Face greedy oracle. Shared by
tests, examples and benchmarks."""

from vllm.distributed.weight_transfer.testing.fresh_load import (
    WORKER_EXTENSION,
    FreshLoadOracle,
    assert_bit_identical,
    assert_serves_weights,
    http_worker_call,
    offline_worker_call,
    save_checkpoint,
)
from vllm.distributed.weight_transfer.testing.oracle import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPTS,
    GreedyResult,
    assert_same_greedy,
    completions_greedy,
    hf_greedy,
    logprob_atol,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.tiny_models import (
    TinyModelSpec,
    build_hf_model,
    build_tiny_model,
    default_cache_dir,
    load_hf_model,
    randomize_weights_,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROMPTS",
    "WORKER_EXTENSION",
    "FreshLoadOracle",
    "GreedyResult",
    "TinyModelSpec",
    "assert_bit_identical",
    "assert_same_greedy",
    "assert_serves_weights",
    "build_hf_model",
    "build_tiny_model",
    "completions_greedy",
    "default_cache_dir",
    "hf_greedy",
    "http_worker_call",
    "load_hf_model",
    "logprob_atol",
    "offline_worker_call",
    "randomize_weights_",
    "save_checkpoint",
    "vllm_greedy",
]
