# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark (CUDA): what keeping pinned host staging between syncs saves.

A staged update with ``staging="host"`` on a CUDA engine receives each tensor
into pinned host memory. Before the worker kept its staging
(``staging_pool.StagingPool``), every sync allocated and pinned that memory
again and freed it after the commit (emptying PyTorch's pinned-host cache, so
the memory really went back). This script stages a Qwen3-8B-sized shard
(bfloat16, TP=1, the layout of ``bench_staged_commit_cuda.py``, 16.4 GB) from
the GPU into host staging, several syncs in a row, both ways:

* ``fresh``: per sync, ``torch.empty(..., pin_memory=True)`` per tensor, the
  device-to-host copy, then free and empty the pinned cache (what a staged
  update did before the pool);
* ``pooled``: the fork's ``StagingPool``: the first sync allocates, every
  later one takes the kept buffers back (``take``), copies, and hands them
  back at the commit (``end_update``).

It prints the per-sync time of each part and ``pooled_over_fresh`` (a later
sync's staging time with the pool over without it), and checks that every
staged byte equals its source.

Run (on the GPU machine): ``python3 benchmarks/weight_transfer/
bench_staging_pool_cuda.py --out benchmarks/results/staging_pool_cuda/h200.json``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _bench_common import emit_json, result_path, utc_now
from bench_staged_commit_cuda import layout

from vllm.distributed.weight_transfer.worker.staging_pool import (
    StagingPool,
    buffer_kind,
)


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def stage_once(
    sources: list[torch.Tensor],
    buffers: Callable[[], list[torch.Tensor]],
    release: Callable[[], None],
) -> tuple[dict[str, float], bool]:
    """One sync's host staging: get the buffers, copy every source into its
    buffer, check the copies, let the buffers go; the time of each part."""
    t0 = _sync()
    staging = buffers()
    t1 = _sync()
    for dst, src in zip(staging, sources, strict=True):
        dst.copy_(src, non_blocking=True)
    t2 = _sync()
    ok = all(torch.equal(d.cuda(), s) for d, s in zip(staging, sources, strict=True))
    t3 = _sync()
    del staging
    release()
    t4 = _sync()
    return {"allocate_s": t1 - t0, "copy_s": t2 - t1, "free_s": t4 - t3}, ok


def stage_fresh(sources: list[torch.Tensor]) -> tuple[dict[str, float], bool]:
    """Without a pool: allocate and pin, copy, free and empty the pinned
    cache."""
    return stage_once(
        sources,
        lambda: [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in sources],
        torch._C._host_emptyCache,
    )


def stage_pooled(
    pool: StagingPool, sources: list[torch.Tensor]
) -> tuple[dict[str, float], bool]:
    """Through the pool: take (or allocate the first time), copy, keep for
    the next sync."""
    cpu = torch.device("cpu")

    def buffers() -> list[torch.Tensor]:
        out = []
        for s in sources:
            kind = buffer_kind(s.shape, s.dtype, cpu, True)
            kept = pool.take(kind)
            out.append(kept if kept is not None else pool.allocate(kind))
        return out

    return stage_once(sources, buffers, lambda: pool.end_update(()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--out", default=str(result_path(__file__)))
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sources = [
        torch.randn(
            (rows, *shape[1:]), dtype=torch.float32, device=dev, generator=gen
        ).to(torch.bfloat16)
        for _, shape, parts in layout()
        for _, _, rows in parts
    ]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    print(f"{len(sources)} tensors, {nbytes / 1e9:.2f} GB staged per sync")

    runs: dict[str, list[dict[str, float]]] = {"fresh": [], "pooled": []}
    exact = True
    for _ in range(args.syncs):
        parts, ok = stage_fresh(sources)
        runs["fresh"].append(parts)
        exact &= ok
    pool = StagingPool()
    for _ in range(args.syncs):
        parts, ok = stage_pooled(pool, sources)
        runs["pooled"].append(parts)
        exact &= ok
    assert pool.reuses == len(sources) * (args.syncs - 1), pool.reuses
    pool.drop()
    torch._C._host_emptyCache()

    def summary(rows: list[dict[str, float]]) -> dict[str, object]:
        later = rows[1:]  # the pool's first sync allocates like a fresh one
        total = [sum(r.values()) for r in later]
        return {
            "per_sync": [{k: round(v, 4) for k, v in r.items()} for r in rows],
            "later_syncs_total_median_s": round(statistics.median(total), 4),
            "later_syncs_copy_median_s": round(
                statistics.median(r["copy_s"] for r in later), 4
            ),
            "copy_gb_per_s": round(
                nbytes / statistics.median(r["copy_s"] for r in later) / 1e9, 1
            ),
        }

    fresh, pooled = summary(runs["fresh"]), summary(runs["pooled"])
    doc = {
        "benchmark": "staging_pool_pinned_host_cuda",
        "time_utc": utc_now(),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shard": "Qwen3-8B shapes, bfloat16, TP=1",
        "tensors": len(sources),
        "bytes": nbytes,
        "fresh": fresh,
        "pooled": pooled,
        "pooled_over_fresh": round(
            float(pooled["later_syncs_total_median_s"])  # type: ignore[arg-type]
            / float(fresh["later_syncs_total_median_s"]),  # type: ignore[arg-type]
            4,
        ),
        "bit_exact": exact,
    }
    emit_json(doc, args.out)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
