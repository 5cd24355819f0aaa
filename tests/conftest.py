# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Process-wide settings for running real vLLM engines on small CPU machines."""

import os

import pytest

# Two OpenMP threads per engine (its KV cache size is in testing.tiny_engine's
# TINY_ENGINE_ARGS). TP=2 tests override the thread binding ("0|1") because
# "auto" needs one NUMA node per worker.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Folder of the default tiny dense Qwen3 (generated once, then cached)."""
    from vllm.distributed.weight_transfer.testing import build_tiny_model

    return build_tiny_model()
