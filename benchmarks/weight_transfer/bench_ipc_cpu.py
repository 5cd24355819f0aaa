# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: full weight sync of a >= 1 GiB model into a CPU ``vllm.LLM`` over ``ipc``.

A generated Qwen3 (1.09 GiB of float32 weights by default; nothing downloaded)
is served by an offline ``LLM`` with ``weight_transfer_config=ipc``. The
trainer, this process, holds the same model in Hugging Face form and calls
``send_weights()`` through ``OfflineLLMWeightSyncClient``: the bytes go through
a packed shared-memory buffer into the workers' layerwise reload.

Printed and written to ``benchmarks/results/ipc_cpu/<device>-tp<N>.json``:

* ``sync_s``: wall time of each ``send_weights()`` (start -> update* ->
  finish, including vLLM's layerwise reload); the first round is a warm-up and
  is reported separately.
* ``sync_gb_s``: model bytes / median sync time (GB = 1e9 bytes);
  ``sync_min_s`` / ``sync_gb_s_best``: the fastest sync, less sensitive to
  other jobs on a shared machine.
* ``memcpy_s`` / ``memcpy_gb_s``: one ``torch.Tensor.copy_`` of the same
  number of bytes between two preallocated flat tensors in this process,
  measured in the same run (median of 5); ``ratio_sync_over_memcpy`` compares
  the two. A sync copies every byte at least twice (trainer -> shared memory,
  shared memory -> vLLM's weights), so 2x is the floor.
* ``sync_phases_s``: per sync, the time spent inside each client call
  (``start_weight_update``, ``update_weights`` summed over chunks,
  ``finish_weight_update``: the workers' side) and ``trainer_side``, the rest
  (reading the source and packing the shared-memory buffer).
* ``trainer_peak_rss_bytes`` (``getrusage`` max RSS of this process) before and
  after the syncs, and the growth; the shared-memory buffer's pages count once
  touched, so the growth is about ``buffer_nbytes``. The memcpy baseline runs
  after this measurement so that its two buffers do not hide the growth.
* ``child_rss_bytes``: RSS of vLLM's processes (engine core, worker) after the
  syncs; a worker's RSS counts the weights, the KV cache and the mapped buffer.
* ``oracle_match``: vLLM's greedy tokens/logprobs equal a Hugging Face forward
  pass of the trainer's weights after the last sync.

Run: ``python benchmarks/weight_transfer/bench_ipc_cpu.py [--tp 2] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

from _bench_common import (
    REPO,
    TimedClient,
    bench_model,
    child_rss_bytes,
    device_tag,
    emit_json,
    git_commit,
    max_rss_bytes,
    median_memcpy_s,
    run_record,
    sync_times_s,
)

# The machine fields of this benchmark's results (no ``mem_total_bytes``).
MACHINE_KEYS = (
    "cpu_count",
    "platform",
    "python",
    "torch",
    "omp_num_threads",
    "load_avg_1m",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="measured syncs")
    # 18 layers: 292 M parameters, 1.17 GB (1.09 GiB) of float32 weights.
    p.add_argument("--num-layers", type=int, default=18)
    p.add_argument(
        "--buffer-mib",
        type=int,
        default=None,
        help="packed buffer cap (default: the backend's, 1024 MiB)",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    commit = git_commit()  # the code this run imports
    if args.tp > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp))
        )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.testing import (
        assert_same_greedy,
        hf_greedy,
        logprob_atol,
        randomize_weights_,
        vllm_greedy,
    )
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    # Every weight touched once, so the RSS baseline below holds the model.
    bench = bench_model(args.num_layers, touch=True)
    model_dir, model, nbytes = bench.dir, bench.model, bench.nbytes
    print(
        f"model {model_dir.name}: {bench.params / 1e6:.0f} M params, "
        f"{nbytes / 2**30:.2f} GiB float32 (ready in {bench.build_s:.1f} s)"
    )

    t0 = time.perf_counter()
    llm = tiny_llm(model_dir, tensor_parallel_size=args.tp, backend="ipc")
    llm_start_s = time.perf_counter() - t0
    print(f"LLM up in {llm_start_s:.1f} s (TP={args.tp})")

    init_kwargs = {}
    if args.buffer_mib is not None:
        init_kwargs["packed_buffer_size_bytes"] = args.buffer_mib * 2**20
    rss_before = max_rss_bytes()
    try:
        client = TimedClient(OfflineLLMWeightSyncClient(llm))
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=True, **init_kwargs),
            client=client,
            source=ModuleSource(model),
        )
        assert isinstance(trainer, IPCTrainerWeightTransferEngine)
        times, phases = [], []
        for round_ in range(args.rounds + 1):
            randomize_weights_(model, seed=100 + round_, std=0.02)
            client.reset()
            t0 = time.perf_counter()
            trainer.send_weights()
            times.append(time.perf_counter() - t0)
            split = client.split_s(times[-1])
            phases.append(split)
            label = " (warm-up)" if round_ == 0 else ""
            print(f"sync {round_}{label}: {times[-1]:.3f} s {split}")
        rss_after = max_rss_bytes()
        workers_rss = child_rss_bytes()
        memcpy_s = median_memcpy_s(nbytes)
        print(f"memcpy of {nbytes / 1e9:.2f} GB: {memcpy_s:.3f} s")
        try:
            assert_same_greedy(
                vllm_greedy(llm), hf_greedy(model), atol=logprob_atol("float32")
            )
            oracle_match = True
        except AssertionError as e:
            print(f"oracle mismatch: {e}")
            oracle_match = False
        plan = trainer.last_plan
    finally:
        llm.llm_engine.engine_core.shutdown()

    measured = times[1:]
    sync_median = statistics.median(measured)
    result = {
        **run_record("ipc_cpu_full_sync", commit, *MACHINE_KEYS),
        "model": {
            "dir": model_dir.name,
            "spec": dataclasses.asdict(bench.spec),
            "params": bench.params,
            "bytes": nbytes,
            "tensors": len(list(model.parameters())),
        },
        "vllm": {"tensor_parallel_size": args.tp, "dtype": "float32"},
        "transfer": {
            "packed": True,
            "buffer_nbytes": plan.buffer_nbytes if plan else None,
            "chunks": len(plan.chunks) if plan else None,
        },
        "llm_start_s": round(llm_start_s, 2),
        **sync_times_s(times),
        "sync_phases_s": phases[1:],
        "sync_median_s": round(sync_median, 4),
        "sync_min_s": round(min(measured), 4),
        "sync_gb_s": round(nbytes / sync_median / 1e9, 3),
        "sync_gb_s_best": round(nbytes / min(measured) / 1e9, 3),
        "memcpy_s": round(memcpy_s, 4),
        "memcpy_gb_s": round(nbytes / memcpy_s / 1e9, 3),
        "ratio_sync_over_memcpy": round(sync_median / memcpy_s, 2),
        "trainer_peak_rss_bytes_before_sync": rss_before,
        "trainer_peak_rss_bytes": rss_after,
        "trainer_peak_rss_growth_bytes": rss_after - rss_before,
        "child_rss_bytes": workers_rss,
        "oracle_match": oracle_match,
    }
    path = args.out / "ipc_cpu" / f"{device_tag()}-tp{args.tp}.json"
    emit_json(result, path)
    print(f"wrote {path}")
    return 0 if oracle_match else 1


if __name__ == "__main__":
    sys.exit(main())
