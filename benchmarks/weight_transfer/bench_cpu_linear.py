# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: what ``WeightTransferConfig.cpu_linear="plain"`` costs generation
and what it and ``landing="planned"`` save a sync, on vLLM CPU, all in one run.

The same generated Qwen3 (1.17 GB of float32 weights by default; nothing
downloaded) is served three times by an offline ``LLM`` with the ``ipc``
backend: ``packed`` (vLLM's oneDNN handles, layerwise reload: the defaults),
``plain`` (weights stay tensors, torch's linear; layerwise reload),
``plain_planned`` (plain, and every tensor copied straight into the served
tensors by the planned landing) and ``plain_planned_shared`` (that, with the
trainer's parameters in shared memory, ``SharedParameters``: nothing is
packed, one copy per byte). For each engine:

* ``decode_tokens_per_s``: greedy generation of ``--batch`` prompts for
  ``--max-tokens`` tokens each (ignore EOS), median of ``--rounds``;
* ``sync_s``: one full in-place ``send_weights()`` of the trainer's weights
  (start -> update* -> finish, vLLM's layerwise reload included), median of
  ``--rounds`` after one warm-up, and ``sync_over_memcpy`` against one
  ``torch.Tensor.copy_`` of the same bytes measured in the same run;
* ``oracle_match``: greedy tokens and logprobs after the last sync equal a
  Hugging Face forward pass of the trainer's weights (fp32 tolerance).

Ratios printed and written to ``benchmarks/results/cpu_linear/<device>.json``:
``plain_over_packed_decode`` (generation speed kept),
``plain_over_packed_sync`` and ``planned_over_packed_sync`` (sync time left),
``planned_over_plain_sync`` (what the planned landing saves over the reload
on the same layers), ``shared_over_packed_sync`` and
``shared_over_planned_sync`` (what reading the trainer's own memory saves).

Run: ``python benchmarks/weight_transfer/bench_cpu_linear.py [--rounds 3]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

from _bench_common import (
    REPO,
    RESULTS,
    bench_model,
    emit_json,
    git_commit,
    median_memcpy_s,
    result_path,
    rounded,
    run_record,
    sync_times_s,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    # 18 layers: 292 M parameters, 1.17 GB of float32 weights.
    p.add_argument("--num-layers", type=int, default=18)
    p.add_argument("--batch", type=int, default=8, help="prompts per generate")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="engines to measure (ratios need both of their engines)",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument(
        "--out-name", default=str(result_path(__file__).relative_to(RESULTS))
    )
    return p.parse_args()


CpuLinear = Literal["packed", "plain"]
Landing = Literal["reload", "planned"]
SETTINGS: dict[str, tuple[CpuLinear, Landing, bool]] = {
    # name: (WeightTransferConfig.cpu_linear, WeightTransferConfig.landing,
    #        trainer parameters in shared memory)
    "packed": ("packed", "reload", False),
    "plain": ("plain", "reload", False),
    "plain_planned": ("plain", "planned", False),
    "plain_planned_shared": ("plain", "planned", True),
}


def measure(setting: str, model_dir: Path, model: Any, args: argparse.Namespace):
    """Start an engine with ``SETTINGS[setting]``; its decode speed and syncs."""
    from vllm import SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.testing import (
        assert_same_greedy,
        hf_greedy,
        logprob_atol,
        randomize_weights_,
        vllm_greedy,
    )
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    t0 = time.perf_counter()
    llm = tiny_llm(
        model_dir,
        max_num_seqs=args.batch,
        weight_transfer_config=WeightTransferConfig(
            backend="ipc",
            cpu_linear=SETTINGS[setting][0],
            landing=SETTINGS[setting][1],
        ),
    )
    start_s = time.perf_counter() - t0
    shared = None
    try:
        prompts = [
            {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(16)]}
            for i in range(args.batch)
        ]
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
        )
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        decode = []
        for _ in range(args.rounds):
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            decode.append(tokens / elapsed)

        if SETTINGS[setting][2]:
            from vllm.distributed.weight_transfer.api import SharedParameters

            shared = SharedParameters.place(model)
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=True),
            client=OfflineLLMWeightSyncClient(llm),
            source=ModuleSource(model),
        )
        syncs = []
        for round_ in range(args.rounds + 1):
            randomize_weights_(model, seed=200 + round_, std=0.02)
            t0 = time.perf_counter()
            trainer.send_weights()
            syncs.append(time.perf_counter() - t0)
        llm.reset_prefix_cache()
        try:
            assert_same_greedy(
                vllm_greedy(llm), hf_greedy(model), atol=logprob_atol("float32")
            )
            oracle_match = True
        except AssertionError as e:
            print(f"[{setting}] oracle mismatch: {e}")
            oracle_match = False
    finally:
        if shared is not None:
            shared.close()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    generation = {
        "llm_start_s": start_s,
        "decode_tokens_per_s": decode,
        "decode_tokens_per_s_median": statistics.median(decode),
    }
    result = {
        **rounded(generation, 2),
        **sync_times_s(syncs),
        "sync_s_median": round(statistics.median(syncs[1:]), 4),
        "oracle_match": oracle_match,
    }
    print(f"[{setting}] {result}")
    return result


def main() -> int:
    args = parse_args()
    commit = git_commit()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    bench = bench_model(args.num_layers, touch=True)
    print(bench.describe())

    settings = {s: measure(s, bench.dir, bench.model, args) for s in args.settings}
    memcpy_s = median_memcpy_s(bench.nbytes)
    for result in settings.values():
        result["sync_over_memcpy"] = round(result["sync_s_median"] / memcpy_s, 2)

    def ratio(name: str, num: str, den: str, key: str = "sync_s_median") -> None:
        if num in settings and den in settings:
            ratios[name] = round(settings[num][key] / settings[den][key], 3)

    ratios: dict[str, float] = {}
    ratio("plain_over_packed_decode", "plain", "packed", "decode_tokens_per_s_median")
    ratio("plain_over_packed_sync", "plain", "packed")
    ratio("planned_over_packed_sync", "plain_planned", "packed")
    ratio("planned_over_plain_sync", "plain_planned", "plain")
    ratio("shared_over_packed_sync", "plain_planned_shared", "packed")
    ratio("shared_over_planned_sync", "plain_planned_shared", "plain_planned")
    print(f"memcpy {memcpy_s:.3f} s; {ratios}")
    doc = {
        **run_record("cpu_linear_packed_vs_plain", commit),
        "model": {"dir": bench.dir.name, "bytes": bench.nbytes, "dtype": "float32"},
        "generation": {"batch": args.batch, "max_tokens": args.max_tokens},
        "memcpy_s": round(memcpy_s, 4),
        **settings,
        **ratios,
    }
    emit_json(doc, str(args.out / args.out_name))
    return 0 if all(r["oracle_match"] for r in settings.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
