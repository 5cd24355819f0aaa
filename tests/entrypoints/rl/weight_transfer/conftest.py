# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures the Ray-driven sharded_rdt engine tests share."""

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A Ray session for the module's actors."""
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
