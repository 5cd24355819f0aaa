# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The planner inside a real TP=2 CPU engine's workers.

Baking must not change what the engine generates, and a weight update that lands
the replayed plan through the production path (the producer's ``pack_chunk``,
the engine's ``ChunkLander`` inside a ``LayerwiseReloadSession``) must leave the
engine exactly where ``load_weights`` of the same tensors through the same
session does (tokens and logprobs).
Dense Qwen3 only: on CPU, vLLM's MoE kernels lose their prepacked layout on any
layerwise reload (cpu-feasibility.md section 7), with or without the planner.
"""

import functools

import pytest

from vllm.distributed.weight_transfer.testing import vllm_greedy
from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import (
    worker_bake,
    worker_update,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    engine = tiny_llm(
        tiny_model_dir, tensor_parallel_size=2, backend=None, skip_tokenizer_init=True
    )
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        mp.undo()


def _update(llm, seed, via_plan):
    llm.collective_rpc(functools.partial(worker_update, seed=seed, via_plan=via_plan))
    return vllm_greedy(llm)


def test_bake_then_plan_updates_match_load_weights_updates(llm):
    original = vllm_greedy(llm)

    baked = llm.collective_rpc(worker_bake)
    assert [r["restore_mismatches"] for r in baked] == [[], []]
    assert baked[0]["digest"] != baked[1]["digest"]
    assert vllm_greedy(llm) == original

    assert _update(llm, seed=None, via_plan=True) == original

    by_plan = _update(llm, seed=7, via_plan=True)
    _update(llm, seed=None, via_plan=False)
    by_load_weights = _update(llm, seed=7, via_plan=False)
    assert by_plan == by_load_weights
    assert by_plan.tokens != original.tokens
