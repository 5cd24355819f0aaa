# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: worker-side against trainer-side FP8 quantization, one engine.

A generated Qwen3 (the CPU benchmarks' 18-layer shape: 1.17 GB of float32
weights, 0.58 GB in bfloat16; nothing downloaded) is served by an offline
``LLM`` in bfloat16 with ``quantization="fp8_per_channel"`` and
``weight_transfer_config=ipc``. The trainer, this process, holds the model in
float32 and syncs it three ways, each for a warm-up and ``--rounds`` rounds
in a row (the weights changed before each):

* ``worker_side_fp32``: its float32 weights as they are; every worker lands
  them through the layerwise reload, and vLLM quantizes each linear layer;
* ``worker_side_bf16``: the same, cast to bfloat16 on the trainer first (the
  engine's dtype: half the bytes of float32);
* ``trainer_side_codes``: ``Fp8ChannelCodes``: the trainer quantizes each
  linear weight to float8 codes and per-row float32 scales and the workers
  copy them straight into the served codes (``codes_landing``); embeddings
  and norms go as float32.

Printed and written to ``benchmarks/results/quantized_sync_cpu/<device>.json``: per
mode the bytes moved (the manifest's total), the sync times (first round a
warm-up), the time inside the client calls (the workers' side) and the rest
(the trainer: reading, casting or quantizing, packing); the ratios of bytes
and median times of each mode against ``worker_side_fp32`` and
``worker_side_bf16``; a ``memcpy`` of the float32 bytes in the same run; and
``same_output``: one more set of weights synced through each mode in turn
gives the same greedy output bit for bit (the same weights, quantized by the
same arithmetic on either side).

Run: ``python benchmarks/weight_transfer/bench_quantized_sync_cpu.py
[--rounds 3] [--num-layers 18]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _bench_common import (
    TimedClient,
    bench_model,
    cast_source,
    emit_json,
    git_commit,
    median_memcpy_s,
    result_path,
    rounded,
    run_record,
    sync_times_s,
)

MODES = ("worker_side_fp32", "worker_side_bf16", "trainer_side_codes")


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

    from vllm.distributed.weight_transfer.api import Fp8ChannelCodes, IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.base import (
        ModuleSource,
        WeightSource,
    )
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.testing import (
        assert_bit_identical,
        randomize_weights_,
        vllm_greedy,
    )
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    bench = bench_model(args.num_layers, touch=True)
    model_dir, model, fp32_bytes = bench.dir, bench.model, bench.nbytes
    print(bench.describe())

    t0 = time.perf_counter()
    llm = tiny_llm(
        model_dir, dtype="bfloat16", backend="ipc", quantization="fp8_per_channel"
    )
    llm_start_s = time.perf_counter() - t0
    print(f"LLM up in {llm_start_s:.1f} s")

    sources: dict[str, WeightSource] = {
        "worker_side_fp32": ModuleSource(model),
        "worker_side_bf16": cast_source(ModuleSource(model)),
        "trainer_side_codes": Fp8ChannelCodes(ModuleSource(model)),
    }
    moved = {
        mode: sum(m.dtype.itemsize * math.prod(m.shape) for m in s.metadata())
        for mode, s in sources.items()
    }
    times: dict[str, list[float]] = {m: [] for m in MODES}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    outputs: dict[str, Any] = {}
    try:
        client = TimedClient(OfflineLLMWeightSyncClient(llm))
        trainers = {
            mode: WeightTransferTrainerFactory.trainer_init(
                IPCTrainerInitInfo(rank=0, packed=True), client=client, source=source
            )
            for mode, source in sources.items()
        }
        # Each mode syncs its rounds in a row, as a training run would (the
        # worker plans a layout's codes landing once and keeps it while the
        # layout and the served tensors stay).
        for mode in MODES:
            for round_ in range(args.rounds + 1):
                randomize_weights_(model, seed=100 + round_, std=0.02)
                client.reset()
                t0 = time.perf_counter()
                trainers[mode].send_weights()
                took = time.perf_counter() - t0
                workers = sum(client.seconds.values())
                times[mode].append(took)
                phases[mode].append(
                    rounded({"workers": workers, "trainer": took - workers})
                )
                label = " (warm-up)" if round_ == 0 else ""
                print(f"{mode} round {round_}{label}: {took:.3f} s {phases[mode][-1]}")
        # The same weights through each mode: the same served model.
        randomize_weights_(model, seed=200, std=0.02)
        for mode in MODES:
            trainers[mode].send_weights()
            llm.reset_prefix_cache()
            outputs[mode] = vllm_greedy(llm)
        for trainer in trainers.values():
            trainer.shutdown()
        memcpy_s = median_memcpy_s(fp32_bytes)
    finally:
        llm.llm_engine.engine_core.shutdown()

    same_output = True
    for mode in MODES[1:]:
        try:
            assert_bit_identical(outputs[mode], outputs[MODES[0]], what=mode)
        except AssertionError as e:
            print(f"outputs differ: {e}")
            same_output = False

    modes: dict[str, Any] = {}
    for mode in MODES:
        measured = times[mode][1:]
        modes[mode] = {
            "bytes_moved": moved[mode],
            **sync_times_s(times[mode]),
            "sync_median_s": round(statistics.median(measured), 4),
            "sync_min_s": round(min(measured), 4),
            "phases_s": phases[mode][1:],
        }
    for mode in MODES:
        for peer in ("worker_side_fp32", "worker_side_bf16"):
            modes[mode][f"bytes_over_{peer}"] = round(moved[mode] / moved[peer], 4)
            modes[mode][f"time_over_{peer}"] = round(
                modes[mode]["sync_median_s"] / modes[peer]["sync_median_s"], 3
            )
    doc = {
        **run_record("quantized_sync_cpu", commit),
        "model": {
            "dir": model_dir.name,
            "spec": dataclasses.asdict(bench.spec),
            "float32_bytes": fp32_bytes,
        },
        "vllm": {"dtype": "bfloat16", "quantization": "fp8_per_channel", "tp": 1},
        "llm_start_s": round(llm_start_s, 2),
        "modes": modes,
        "memcpy_float32_bytes_s": round(memcpy_s, 4),
        "same_output": same_output,
    }
    emit_json(doc, str(args.out))
    return 0 if same_output else 1


if __name__ == "__main__":
    sys.exit(main())
