# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staging on a CUDA worker, without vLLM: pinned host and device staging
kept by the pool from one update to the next, freed by an abort, never
handed out while a view still uses it, and the refusal at engine creation
measured against the GPU's own memory and ``gpu_memory_utilization``.
Needs an NVIDIA GPU; skipped without one (the commit itself goes through
vLLM's layerwise reload and is tested on vLLM CPU)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer.worker.staged import (
    StagedUpdate,
    StagingDoesNotFit,
    check_staging_fits_at_start,
    reserved_later,
)
from vllm.distributed.weight_transfer.worker.staging_pool import (
    StagingPool,
    buffer_kind,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _settled_gpu_memory():
    """These tests read the GPU's allocated and free memory: tensors an
    earlier test in the process left for the garbage collector, and blocks
    the caching allocator still holds, are released first, so none is freed
    between a reading and the check that uses it."""
    gc.collect()
    torch.cuda.synchronize(GPU)
    torch.cuda.empty_cache()
    yield


def staged(model: torch.nn.Module, where: str, pool: StagingPool) -> StagedUpdate:
    update = StagedUpdate(
        model,
        None,
        where=where,  # type: ignore[arg-type]
        model_device=GPU,
        process_while_staging=False,
        pool=pool,
    )
    update.start()
    return update


@pytest.mark.parametrize("where", ["host", "device"])
def test_staging_is_kept_between_updates_and_freed_by_an_abort(where):
    """Host staging next to a GPU is pinned; a committed update's buffers are
    reused by the next update; an abort frees every buffer."""
    model = torch.nn.Linear(256, 512).to(GPU)
    pool = StagingPool()
    sources = [torch.randn(512, 256, device=GPU), torch.randn(512, device=GPU)]
    renewed = [t * 2 for t in sources]  # the second update's tensors
    before = torch.cuda.memory_allocated(GPU)

    first = staged(model, where, pool)
    copies = [first.stage(t) for t in sources]
    assert all(c.is_pinned() for c in copies) == (where == "host")
    assert all(c.device.type == ("cpu" if where == "host" else "cuda") for c in copies)
    assert all(torch.equal(c.to(GPU), t) for c, t in zip(copies, sources, strict=True))
    first.finish()  # nothing deferred: the staging goes back to the pool
    del copies
    assert pool.reserved_bytes == sum(t.numel() * 4 for t in sources)

    second = staged(model, where, pool)
    again = [second.stage(t) for t in renewed]
    assert pool.reuses == 2 and pool.held_back == 0
    assert all(torch.equal(c.to(GPU), t) for c, t in zip(again, renewed, strict=True))
    del again
    second.abort("the trainer went away")
    assert pool.reserved_bytes == 0
    assert torch.cuda.memory_allocated(GPU) == before


def test_a_pinned_buffer_a_view_still_uses_is_never_handed_out_again():
    pool = StagingPool()
    kind = buffer_kind((1024,), torch.bfloat16, torch.device("cpu"), True)
    kept = pool.allocate(kind)
    view = kept[:16]
    del kept
    pool.end_update(())
    assert pool.held_back == 1 and pool.take(kind) is None
    del view


def test_the_kv_cache_share_of_the_gpu_counts_against_device_staging_at_start():
    """``gpu_memory_utilization`` of the GPU, less what the process holds,
    is what vLLM still takes for the KV cache; device staging must fit in
    what is left, host staging does not count it."""
    model = torch.nn.Linear(8192, 32768, bias=False, dtype=torch.bfloat16).to(GPU)
    weights = 8192 * 32768 * 2  # 512 MiB
    free, total = torch.cuda.mem_get_info(GPU)
    config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    later = reserved_later(GPU, config)
    assert later == int(0.5 * total) - torch.cuda.memory_reserved(GPU)

    # Leave ``room`` bytes next to the KV cache: twice the weights, then half.
    for room, fits in ((2 * weights, True), (weights // 2, False)):
        free, _ = torch.cuda.mem_get_info(GPU)
        held = torch.cuda.memory_reserved(GPU)
        config.gpu_memory_utilization = (free - room + held) / total
        if fits:
            assert check_staging_fits_at_start("device", model, GPU, config) == weights
        else:
            with pytest.raises(StagingDoesNotFit, match="for the KV cache"):
                check_staging_fits_at_start("device", model, GPU, config)
            # Host staging next to the GPU is not where the KV cache goes.
            assert check_staging_fits_at_start("host", model, GPU, config) == weights
