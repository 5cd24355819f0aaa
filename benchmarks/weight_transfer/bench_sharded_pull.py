# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt on CPU: bytes each worker pulls and its pull throughput, next to
a raw NIXL read of the same size in the same run.

The benchmark process is the trainer (one rank, direct NIXL producer) and holds
the model in Hugging Face form; vLLM runs it as an offline ``LLM`` with the
default executor, so every byte crosses a process boundary by NIXL READ. Before
each sync every weight is redrawn; after the last, vLLM's greedy output is
checked against a Hugging Face forward pass.

Run: ``python benchmarks/weight_transfer/bench_sharded_pull.py [--tp 2]
[--num-layers 8] [--rounds 3]``; the result goes to
``benchmarks/results/sharded_pull/<device>-tp<N>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

from _bench_common import (
    bench_model,
    git_commit,
    raw_nixl_read_s,
    result_path,
    run_record,
    write_json,
)

from vllm.distributed.weight_transfer.api import (
    CheckpointNamesSource,
    ShardedRDTTrainerInitInfo,
)
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.testing import (
    assert_same_greedy,
    hf_greedy,
    logprob_atol,
    randomize_weights_,
    vllm_greedy,
)

# The machine fields of this benchmark's results.
MACHINE_KEYS = ("cpu_count", "platform", "torch", "load_avg_1m")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="measured syncs")
    args = p.parse_args()
    if args.tp > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp))
        )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # receipts via RPC
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    bench = bench_model(args.num_layers)
    model_dir, model, nbytes = bench.dir, bench.model, bench.nbytes
    print(f"model {model_dir.name}: {nbytes / 2**30:.2f} GiB float32")

    llm = tiny_llm(model_dir, tensor_parallel_size=args.tp, backend="sharded_rdt")
    try:
        t0 = time.perf_counter()
        trainer = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(num_consumers=args.tp, rank=0),
            client=OfflineLLMWeightSyncClient(llm),
            source=CheckpointNamesSource(model),
        )
        init_s = time.perf_counter() - t0
        syncs: list[dict[str, Any]] = []
        for round_ in range(args.rounds + 1):
            randomize_weights_(model, seed=1000 + round_, std=0.02)
            t0 = time.perf_counter()
            trainer.send_weights()
            sync_s = time.perf_counter() - t0
            receipts = llm.collective_rpc(
                lambda w: w.weight_transfer_engine.last_receipt
            )
            syncs.append({"sync_s": sync_s, "receipts": receipts})
            print(
                f"sync {round_}{' (warmup)' if round_ == 0 else ''}: "
                f"{sync_s:.3f} s; "
                + "; ".join(
                    f"worker {r['consumer_id']} {r['bytes'] / 2**20:.1f} MiB in "
                    f"{r['seconds']:.3f} s"
                    for r in receipts
                )
            )
        assert_same_greedy(
            vllm_greedy(llm), hf_greedy(model), atol=logprob_atol("float32")
        )
        oracle_match = True
        trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()

    measured = syncs[1:]
    per_worker = []
    for w in range(args.tp):
        rs = [s["receipts"][w] for s in measured]
        pull_s = statistics.median(r["seconds"] for r in rs)
        per_worker.append(
            {
                "consumer_id": rs[0]["consumer_id"],
                "bytes": rs[0]["bytes"],
                "planned_bytes": rs[0]["planned_bytes"],
                "chunks": rs[0]["chunks"],
                "update_weights_s": [r["seconds"] for r in rs],
                "update_weights_median_s": pull_s,
                "update_weights_gib_s": rs[0]["bytes"] / pull_s / 2**30,
                "pull_s": [r["pull_seconds"] for r in rs],
                "land_s": [r["land_seconds"] for r in rs],
                "pull_only_gib_s": rs[0]["bytes"]
                / statistics.median(r["pull_seconds"] for r in rs)
                / 2**30,
            }
        )
    raw_bytes = per_worker[0]["bytes"]
    raw = raw_nixl_read_s(raw_bytes)
    result = {
        **run_record("sharded_rdt_cpu_pull", git_commit(), *MACHINE_KEYS),
        "model": {
            "dir": model_dir.name,
            "spec": dataclasses.asdict(bench.spec),
            "bytes": nbytes,
        },
        "vllm": {
            "tensor_parallel_size": args.tp,
            "dtype": "float32",
            "transport": "nixl (direct agents)",
        },
        "trainer_init_s": init_s,
        "warmup_sync_s": syncs[0]["sync_s"],
        "sync_s": [s["sync_s"] for s in measured],
        "sync_median_s": statistics.median(s["sync_s"] for s in measured),
        "per_worker": per_worker,
        "raw_nixl_read": {
            "bytes": raw_bytes,
            "seconds": raw,
            "best_gib_s": raw_bytes / min(raw) / 2**30,
        },
        "oracle_match": oracle_match,
    }
    out = result_path(__file__, f"tp{args.tp}")
    write_json(result, out)
    update = [round(w["update_weights_gib_s"], 3) for w in per_worker]
    pulls_only = [round(w["pull_only_gib_s"], 3) for w in per_worker]
    raw_gib_s = result["raw_nixl_read"]["best_gib_s"]
    print(
        f"per worker GiB/s: update_weights (pull+land+process) {update}, "
        f"pulls alone {pulls_only}; raw NIXL read of {raw_bytes / 2**20:.1f} MiB "
        f"{raw_gib_s:.2f} GiB/s; wrote {out}"
    )


if __name__ == "__main__":
    main()
