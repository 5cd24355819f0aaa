# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What gathering FSDP2 shards straight into the packed buffer saves, on CPU.

Two gloo ranks hold a model of Qwen3-like linear layers (``--layers`` of
them, bfloat16) as DTensors sharding dimension 0 (FSDP2's layout) and send
it with the ``ipc`` trainer (``ModuleSource``, packed, the buffer kept, as
multi-rank trainers send). Rank 0's client accepts every call without a
worker (no receipts: verification off), so the time is the trainer's:
gather, pack, hand out. Side by side in one run, seconds per
``send_weights()`` after a warm-up:

* ``in_slot``: the default; each tensor's shards gathered into its slot of
  the packed buffer (``sharded_gather.gather_full_into``);
* ``full_tensor``: the same tensors through ``full_tensor()`` (a new full
  tensor per tensor) and a copy into the slot, as before.

Prints the ratio ``in_slot / full_tensor`` and the peak RSS growth of a
sync, and writes ``benchmarks/results/sharded_gather_cpu/<device>.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import time
from typing import Any

from _bench_common import (
    emit_json,
    git_commit,
    result_path,
    rounded,
    run_record,
)

from vllm.distributed.weight_transfer.testing.multirank import free_port

WORLD = 2


class NullClient:
    """Accepts every call; the trainer's side alone is measured."""

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        pass

    def finish_weight_update(self, weight_version: Any = None) -> None:
        pass

    def update_weight_version(self, new_version: str) -> None:
        pass

    def get_world_size(self) -> int:
        return 1


def _rank(rank: int, port: int, mode: str, layers: int, syncs: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerWeightTransferEngine,
        )
        from vllm.distributed.weight_transfer.trainer import sharded_gather

        mesh = init_device_mesh("cpu", (WORLD,))
        model = torch.nn.Module()
        for i in range(layers):
            # Qwen3-0.6B-like projections: q/o 1024x1024, gate/up/down 3072.
            for name, shape in (
                ("q", (1024, 1024)),
                ("o", (1024, 1024)),
                ("gate", (3072, 1024)),
                ("up", (3072, 1024)),
                ("down", (1024, 3072)),
            ):
                full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
                shards = distribute_tensor(full.to(torch.bfloat16), mesh, [Shard(0)])
                model.register_parameter(
                    f"l{i}_{name}", torch.nn.Parameter(shards, requires_grad=False)
                )
        if mode == "full_tensor":
            # As before: every tensor through full_tensor() and a copy.
            sharded_gather._gathers_in_place = lambda out, tensor: False
        client = NullClient()
        trainer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(
                rank=rank, keep_packed_buffer=True, verify_publication=False
            ),
            client=client,
            source=ModuleSource(model),
        )
        times = []
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(syncs + 1):
            dist.barrier()
            start = time.perf_counter()
            trainer.send_weights()
            times.append(time.perf_counter() - start)
        rss_growth = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
        ) * 1024
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        in_slots = trainer.gathered_into_slots
        trainer.shutdown()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        out.put((rank, times, in_slots, rss_growth, nbytes, None))
    except BaseException as e:
        out.put((rank, [], 0, 0, 0, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def run_mode(mode: str, layers: int, syncs: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, mode, layers, syncs, out))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, *_, error in got:
        if error is not None:
            raise RuntimeError(f"{mode}: rank {rank}: {error}")
    _, times, in_slots, rss_growth, nbytes, _ = got[0]
    warm = times[1:]
    return {
        **rounded(
            {
                "median_s": statistics.median(warm),
                "best_s": min(warm),
                "all_s": warm,
                "first_sync_s": times[0],
            }
        ),
        "gathered_into_slots_rank0": in_slots,
        "peak_rss_growth_bytes_rank0": rss_growth,
        "full_bytes": nbytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--out", default=str(result_path(__file__)))
    args = parser.parse_args()
    modes = {
        mode: run_mode(mode, args.layers, args.syncs)
        for mode in ("full_tensor", "in_slot")
    }
    doc = {
        **run_record("bench_sharded_gather_cpu", git_commit()),
        "ranks": WORLD,
        "layers": args.layers,
        **modes,
        "in_slot_over_full_tensor": round(
            modes["in_slot"]["median_s"] / modes["full_tensor"]["median_s"], 3
        ),
    }
    emit_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
