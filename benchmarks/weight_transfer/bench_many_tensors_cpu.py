# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-tensor cost of an ``ipc`` sync with many small tensors, on this CPU.

A trainer module and a served module with the same parameters (``--tensors``
of them: ``Linear(8, 8)`` layers, weight and bias, so almost every byte of a
sync is per-tensor work, as on Qwen3-30B-A3B's 9,435 tensors); the served
one is held by the fork's ``ipc`` worker engine in this process
(``IPCWeightTransferEngine`` driven directly, ``testing.direct_engine``; no
vLLM engine), which lands with ``landing="planned"`` and verifies every
publication (manifest, receipts, completeness), as the defaults do.
Measured side by side, seconds per ``send_weights()`` after a warm-up:

* ``packed``: the defaults (the trainer packs every tensor into a buffer);
* ``shared_module_source``: the trainer's parameters placed in shared memory
  (``SharedParameters``) and sent with ``ModuleSource(model)``: nothing is
  packed, but every sync walks, locates and lists every tensor;
* ``shared_source``: the same placement sent with ``shared.source(model)``,
  which knows when nothing moved: after the first sync, each sync is one
  short message naming the layout the worker parsed, and the manifest and
  the worker's checks are reused.

Every sync is checked: the served parameters equal the trainer's. Prints the
ratios of each mode to ``shared_source`` and writes
``benchmarks/results/many_tensors_cpu/<device>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from _bench_common import (
    emit_json,
    git_commit,
    result_path,
    rounded,
    run_record,
)

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo, SharedParameters
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.testing.direct_engine import (
    DirectEngineClient,
    direct_ipc_engine,
    load_through_weight_loaders,
)
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading


class ManyLinears(torch.nn.Module):
    """``layers`` Linear(8, 8) layers, loaded as vLLM models load."""

    def __init__(self, layers: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def load_weights(self, weights):
        return load_through_weight_loaders(self, weights)


def worker_engine(model: torch.nn.Module) -> IPCWeightTransferEngine:
    record_metadata_for_reloading(model)
    return direct_ipc_engine(model, landing="planned")


def run_mode(mode: str, layers: int, syncs: int) -> dict[str, Any]:
    served = ManyLinears(layers, seed=0)
    trainer_model = ManyLinears(layers, seed=1)
    engine = worker_engine(served)
    shared = None
    source: Any = ModuleSource(trainer_model)
    if mode != "packed":
        shared = SharedParameters.place(trainer_model)
        if mode == "shared_source":
            source = shared.source(trainer_model)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0), client=DirectEngineClient(engine), source=source
    )
    times = []
    try:
        for _ in range(syncs + 1):  # the first one maps, binds and bakes
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(1)
            start = time.perf_counter()
            trainer.send_weights()
            times.append(time.perf_counter() - start)
            want = dict(trainer_model.named_parameters())
            for name, got in served.named_parameters():
                if not torch.equal(got, want[name]):
                    raise AssertionError(f"{mode}: {name} differs after a sync")
    finally:
        trainer.shutdown()
        if shared is not None:
            shared.close()
    warm = times[1:]
    return rounded(
        {
            "first_sync_s": times[0],
            "median_s": statistics.median(warm),
            "best_s": min(warm),
            "all_s": warm,
            "short_messages": engine.layouts.compact,
            "served_equals_trainer": True,
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tensors", type=int, default=9434, help="parameters (two per layer)"
    )
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--out", default=str(result_path(__file__)))
    args = parser.parse_args()
    layers = args.tensors // 2
    modes = ["packed", "shared_module_source", "shared_source"]
    results = {}
    for mode in modes:
        results[mode] = run_mode(mode, layers, args.syncs)
        print(mode, results[mode], flush=True)
    best = results["shared_source"]["median_s"]
    doc = {
        **run_record("ipc_many_small_tensors_cpu", git_commit()),
        "tensors": 2 * layers,
        "bytes": layers * (8 * 8 + 8) * 4,
        "landing": "planned",
        "verify_publication": True,
        **results,
        "ratios_over_shared_source": {
            mode: round(results[mode]["median_s"] / best, 2) for mode in modes
        },
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
