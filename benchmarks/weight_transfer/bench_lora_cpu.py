# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: a LoRA adapter pushed from the trainer's memory
(``push_lora_adapter``) against the way frameworks do it today, writing it
with PEFT's ``save_pretrained`` and loading it with vLLM's load-from-directory
path, on vLLM CPU, in one run.

One offline ``LLM`` (``enable_lora=True``) serves the generated 1.17 GB
float32 Qwen3 of ``bench_cpu_linear.py`` (nothing downloaded). For each rank
(``--ranks``, default 8 and 64) a PEFT LoRA on every linear module of the
trainer's copy of the model is synced ``--rounds`` times each way, after an
in-place change of its tensors:

* ``push_s``: ``LoRAPusher.push`` (pack into the buffer it keeps, one
  message, every worker checks, the commit) plus ``LLM.llm_engine.add_lora``
  of the pushed id, which makes the worker build the adapter as a request
  would;
* ``nixl_s``: the same push with ``transport="nixl"`` (what a trainer on
  another machine does: the worker pulls the packed adapter from the
  pusher's producer over NIXL and returns its receipt through it), plus the
  same ``add_lora``;
* ``disk_s``: ``save_pretrained`` into a fresh directory plus ``add_lora`` of
  a ``LoRARequest`` on it with ``load_inplace=True`` (what a framework does to
  replace an adapter that serves);
* ``adapter_bytes``, ``push_over_disk``, ``nixl_over_disk`` and
  ``nixl_over_push`` (medians), and whether a greedy generation through each
  serves the same tokens and logprobs bit for bit as the adapter from disk.

Both pushes are verified publications (every worker's receipt checked before
the commit), as by default.

Written to ``benchmarks/results/lora_cpu/<device>.json``.

Run: ``python benchmarks/weight_transfer/bench_lora_cpu.py [--ranks 8 64]``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_common import (
    REPO,
    bench_model,
    device_tag,
    emit_json,
    git_commit,
    rounded,
    run_record,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def main() -> int:
    import peft

    from vllm.distributed.weight_transfer.api import (
        LoRAAdapter,
        LoRAPusher,
        memory_path,
    )
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.testing import vllm_greedy
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm
    from vllm.lora.request import LoRARequest

    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    bench = bench_model(num_layers=18)
    model_dir, base = bench.dir, bench.model
    llm = tiny_llm(
        model_dir, enable_lora=True, max_lora_rank=max(args.ranks), max_cpu_loras=8
    )
    # A trainer pushing every step keeps its pusher (and its buffer).
    client = OfflineLLMWeightSyncClient(llm)
    pusher = LoRAPusher(client)
    puller = LoRAPusher(client, transport="nixl")
    results: dict[str, dict] = {}
    next_id = 1
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rank in args.ranks:
                model = peft.get_peft_model(
                    copy.deepcopy(base),
                    peft.LoraConfig(
                        r=rank, lora_alpha=2 * rank, target_modules=TARGETS
                    ),
                )
                lora = [p for n, p in model.named_parameters() if "lora_" in n]
                push_id, disk_id, pull_id = next_id, next_id + 1, next_id + 2
                next_id += 3
                push_s: list[float] = []
                disk_s: list[float] = []
                nixl_s: list[float] = []
                for round_ in range(args.rounds + 1):  # the first is a warm-up
                    gen = torch.Generator().manual_seed(round_)
                    with torch.no_grad():
                        for p in lora:
                            p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
                    for way, name, lora_id, times in (
                        (pusher, f"push-{rank}", push_id, push_s),
                        (puller, f"pull-{rank}", pull_id, nixl_s),
                    ):
                        adapter = LoRAAdapter.from_peft_model(model, name, lora_id)
                        t0 = time.perf_counter()
                        way.push(adapter)
                        llm.llm_engine.add_lora(
                            LoRARequest(name, lora_id, memory_path(name))
                        )
                        times.append(time.perf_counter() - t0)
                    path = os.path.join(tmp, f"rank{rank}-round{round_}")
                    t0 = time.perf_counter()
                    model.save_pretrained(path)
                    llm.llm_engine.add_lora(
                        LoRARequest(f"disk-{rank}", disk_id, path, load_inplace=True)
                    )
                    disk_s.append(time.perf_counter() - t0)
                pushed = vllm_greedy(
                    llm,
                    one_at_a_time=True,
                    lora_request=LoRARequest(
                        f"push-{rank}", push_id, memory_path(f"push-{rank}")
                    ),
                )
                pulled_out = vllm_greedy(
                    llm,
                    one_at_a_time=True,
                    lora_request=LoRARequest(
                        f"pull-{rank}", pull_id, memory_path(f"pull-{rank}")
                    ),
                )
                from_disk = vllm_greedy(
                    llm,
                    one_at_a_time=True,
                    lora_request=LoRARequest(f"disk-{rank}", disk_id, path),
                )
                nbytes = sum(p.numel() * p.element_size() for p in lora)
                push_median = statistics.median(push_s[1:])
                nixl_median = statistics.median(nixl_s[1:])
                disk_median = statistics.median(disk_s[1:])
                seconds = {
                    "push_s": push_s[1:],
                    "push_s_median": push_median,
                    "nixl_s": nixl_s[1:],
                    "nixl_s_median": nixl_median,
                    "nixl_first_s": nixl_s[0],
                    "disk_s": disk_s[1:],
                    "disk_s_median": disk_median,
                }
                ratios = {
                    "push_over_disk": push_median / disk_median,
                    "nixl_over_disk": nixl_median / disk_median,
                    "nixl_over_push": nixl_median / push_median,
                }
                result = {
                    "adapter_bytes": nbytes,
                    "adapter_tensors": len(lora),
                    **rounded(seconds),
                    "same_output": pushed == from_disk,
                    "same_output_nixl": pulled_out == from_disk,
                    "same_tokens": pushed.tokens == from_disk.tokens,
                    "max_logprob_diff": max(
                        abs(x - y)
                        for a, b in zip(
                            pushed.logprobs, from_disk.logprobs, strict=True
                        )
                        for x, y in zip(a, b, strict=True)
                    ),
                    **rounded(ratios, 3),
                }
                print(f"rank {rank}: {result}", flush=True)
                results[f"rank_{rank}"] = result
    finally:
        pusher.close()
        puller.close()
        llm.llm_engine.engine_core.shutdown()
    doc = {
        **run_record("lora_push_vs_save_and_load", git_commit()),
        "model": {"dir": model_dir.name, "dtype": "float32"},
        "targets": TARGETS,
        **results,
    }
    emit_json(doc, str(args.out / "lora_cpu" / f"{device_tag()}.json"))
    same = all(r["same_output"] and r["same_output_nixl"] for r in results.values())
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
