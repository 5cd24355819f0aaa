# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: trainer-side int8 codes into an engine serving a pre-quantized
W8A8 int8 checkpoint, against the bfloat16 sync of the same model unquantized,
in one run.

A generated Qwen3 (the CPU benchmarks' 18-layer shape: 1.17 GB of float32
weights, 0.58 GB in bfloat16; nothing downloaded) is served twice by an
offline ``LLM`` in bfloat16 over ``ipc``, one engine after the other:

* ``int8_codes``: from a compressed-tensors W8A8 int8 checkpoint written from
  the trainer's weights (``testing.int8_checkpoint``); the trainer sends
  ``Int8ChannelCodes``: each linear weight as int8 codes and per-row float32
  scales, quantized on the trainer; the embeddings, norms and LM head as
  bfloat16. The workers land them through vLLM's reload of the int8 layers
  (its oneDNN handles rebuilt);
* ``bf16``: from the unquantized checkpoint; the trainer sends every weight
  cast to bfloat16 (the engine's dtype), landed through the reload.

Each mode syncs a warm-up and ``--rounds`` rounds (the weights changed before
each). Printed and written to ``benchmarks/results/int8_sync_cpu/<device>.json``: per
mode the bytes moved (the manifest's total), the sync times, the time inside
the client calls (the workers' side) and the rest (the trainer: reading,
casting or quantizing, packing); ``int8_codes`` over ``bf16`` for bytes and
median time; and ``int8_same_as_fresh_load``: after the last sync the int8
engine serves, bit for bit, what it serves after loading a checkpoint of the
same codes fresh.

Run: ``python benchmarks/weight_transfer/bench_int8_sync_cpu.py [--rounds 3]
[--num-layers 18]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _bench_common import (
    TimedClient,
    bench_model,
    cast_source,
    emit_json,
    git_commit,
    result_path,
    rounded,
    run_record,
    sync_times_s,
)

MODES = ("int8_codes", "bf16")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="measured rounds")
    p.add_argument("--num-layers", type=int, default=18)
    p.add_argument("--out", type=Path, default=result_path(__file__))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    commit = git_commit()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm.distributed.weight_transfer.api import (
        Int8ChannelCodes,
        IPCTrainerInitInfo,
    )
    from vllm.distributed.weight_transfer.base import (
        ModuleSource,
        WeightSource,
    )
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.testing import (
        FreshLoadOracle,
        assert_bit_identical,
        offline_worker_call,
        randomize_weights_,
        vllm_greedy,
    )
    from vllm.distributed.weight_transfer.testing.int8_checkpoint import (
        save_int8_checkpoint,
    )
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    bench = bench_model(args.num_layers, touch=True)
    model = bench.model
    print(bench.describe())

    def int8_codes() -> WeightSource:
        # The tensors it does not quantize go in the engine's dtype too.
        return Int8ChannelCodes(cast_source(ModuleSource(model)), dtype=torch.bfloat16)

    sources: dict[str, Callable[[], WeightSource]] = {
        "int8_codes": int8_codes,
        "bf16": lambda: cast_source(ModuleSource(model)),
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    starts: dict[str, float] = {}
    moved: dict[str, int] = {}
    same_as_fresh_load = False
    with tempfile.TemporaryDirectory(prefix="int8-bench-") as tmp:
        checkpoints = {
            "int8_codes": save_int8_checkpoint(
                bench.dir, int8_codes(), Path(tmp) / "c"
            ),
            "bf16": bench.dir,
        }
        for mode in MODES:
            t0 = time.perf_counter()
            llm = tiny_llm(checkpoints[mode], dtype="bfloat16", backend="ipc")
            starts[mode] = round(time.perf_counter() - t0, 2)
            print(f"[{mode}] LLM up in {starts[mode]:.1f} s")
            try:
                source = sources[mode]()
                moved[mode] = sum(
                    m.dtype.itemsize * math.prod(m.shape) for m in source.metadata()
                )
                client = TimedClient(OfflineLLMWeightSyncClient(llm))
                trainer = WeightTransferTrainerFactory.trainer_init(
                    IPCTrainerInitInfo(rank=0, packed=True),
                    client=client,
                    source=source,
                )
                for round_ in range(args.rounds + 1):
                    randomize_weights_(model, seed=100 + round_, std=0.02)
                    client.reset()
                    t0 = time.perf_counter()
                    trainer.send_weights()
                    took = time.perf_counter() - t0
                    workers = sum(client.seconds.values())
                    times[mode].append(took)
                    phases[mode].append(
                        rounded({"workers": workers, "trainer": took - workers})
                    )
                    label = " (warm-up)" if round_ == 0 else ""
                    print(f"{mode} round {round_}{label}: {took:.3f} s")
                if mode == "int8_codes":
                    llm.reset_prefix_cache()
                    served = vllm_greedy(llm)
                    oracle = FreshLoadOracle(
                        offline_worker_call(llm), functools.partial(vllm_greedy, llm)
                    )
                    fresh = save_int8_checkpoint(
                        bench.dir, int8_codes(), Path(tmp) / "oracle"
                    )
                    try:
                        assert_bit_identical(served, oracle.from_checkpoint(fresh))
                        same_as_fresh_load = True
                    except AssertionError as e:
                        print(f"int8 engine differs from a fresh load: {e}")
                trainer.shutdown()
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm

    modes: dict[str, Any] = {}
    for mode in MODES:
        measured = times[mode][1:]
        modes[mode] = {
            "bytes_moved": moved[mode],
            "llm_start_s": starts[mode],
            **sync_times_s(times[mode]),
            "sync_median_s": round(statistics.median(measured), 4),
            "sync_min_s": round(min(measured), 4),
            "phases_s": phases[mode][1:],
        }
    doc = {
        **run_record("int8_sync_cpu", commit),
        "model": {
            "dir": bench.dir.name,
            "spec": dataclasses.asdict(bench.spec),
            "float32_bytes": bench.nbytes,
        },
        "vllm": {
            "dtype": "bfloat16",
            "int8_codes": "compressed-tensors W8A8 int8 checkpoint",
            "bf16": "unquantized",
            "tp": 1,
        },
        "modes": modes,
        "int8_codes_bytes_over_bf16": round(moved["int8_codes"] / moved["bf16"], 4),
        "int8_codes_time_over_bf16": round(
            modes["int8_codes"]["sync_median_s"] / modes["bf16"]["sync_median_s"], 3
        ),
        "int8_same_as_fresh_load": same_as_fresh_load,
    }
    emit_json(doc, str(args.out))
    return 0 if same_as_fresh_load else 1


if __name__ == "__main__":
    sys.exit(main())
