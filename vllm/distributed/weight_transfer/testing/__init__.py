# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for testing weight transfer without downloads: generated tiny models and
the Hugging Face greedy oracle. Shared by tests, examples and benchmarks."""

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
    "GreedyResult",
    "TinyModelSpec",
    "assert_same_greedy",
    "build_hf_model",
    "build_tiny_model",
    "completions_greedy",
    "default_cache_dir",
    "hf_greedy",
    "load_hf_model",
    "logprob_atol",
    "randomize_weights_",
    "vllm_greedy",
]
