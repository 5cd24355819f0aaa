# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Process-wide settings for running real vLLM engines on small CPU machines."""

import os
from collections.abc import Iterator

import pytest

# Two OpenMP threads per engine (its KV cache size is in testing.tiny_engine's
# TINY_ENGINE_ARGS). TP=2 tests override the thread binding ("0|1") because
# "auto" needs one NUMA node per worker.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# OpenMP threads sleep when a parallel region ends instead of spinning: `make
# test` runs two test processes on two cores, and a spinning thread takes the
# core the other process's engine needs (test_ipc_llm + test_quantized_llm in
# two workers: 243 s against 268 and 285 s spinning).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Folder of the default tiny dense Qwen3 (generated once, then cached)."""
    from vllm.distributed.weight_transfer.testing import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A Ray session for the module's actors (the Ray-driven sharded_rdt engine
    tests)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def trainer_pool(ray_cluster):
    """Trainer-rank actors kept for the whole module (`TrainerPool`)."""
    from vllm.distributed.weight_transfer.testing.trainer_pool import TrainerPool

    pool = TrainerPool()
    yield pool
    pool.close()
