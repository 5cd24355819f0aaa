# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: the ``sharded_rdt`` planned landing on one GPU, against one flat
device copy of the same bytes.

What a ``sharded_rdt`` worker with ``landing="planned"`` does once its chunks
have arrived: ``ChunkLander.land`` copies each direct slice of each chunk from
the receive buffer into a view of the served tensor, as one batched copy per
chunk (the chunk's copy table bound to its receive buffer once, Triton on
CUDA; ``batched``) and, measured side by side, one ``copy_`` per slice
(``one_by_one``, the lander without batching). A staged commit lands from
staging copies that are fresh at every sync; two modes land from two buffer
sets in turn (the same chunks at other addresses):
``batched_fresh_buffers``, the lander's path for them (a program bound at the
first landing, kept without its source, run from each buffer with
``CopyProgram.run_shifted``), and ``batched_bound_each_sync``
(``bind_fresh_buffers=True``: bound anew at every landing). Here
the chunks are already resident in device receive buffers (one per chunk,
packed by the producer's ``pack_chunk`` from bf16 trainer tensors before the
clock starts), so the time is the landing alone: no transport. The served tensors are
allocated in vLLM's layout from the regions of a real plan, baked at TP 1 from
vLLM's own loaders by ``bench_plan_scale.py --plans-dir`` (Qwen3-8B; the first
``--moe-layers`` decoder layers of Qwen3-30B-A3B). Every copy is direct, as on
an engine whose modules all keep their bytes.

Reported per model and mode: ``land_seconds`` (best and median of ``--reps``
full landings), ``first_land_s`` (the first landing, which compiles and binds
the batched copies), ``fraction_of_device_copy`` (flat / land) and
``bit_exact`` (every served region equals the slice the loader would take of
the trainer's tensor, checked after the mode's last landing, the served
tensors zeroed before its first); per model ``flat_seconds`` (one ``copy_``
of the same byte count between two device buffers), the number of slices and
``batched_over_one_by_one``. The top-level ``fraction_of_device_copy`` is the
batched mode's, the engine's path.

Runs without vLLM through ``tools/fork/device``'s stand-ins::

    PYTHONPATH=.device-carry/site:tools/fork/device/site:. python3 \\
        benchmarks/weight_transfer/bench_sharded_rdt_landing_cuda.py \\
        --plans-dir bench_plans --out result.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

import torch
from _bench_common import device_times, emit_json, result_path
from bench_ipc_cuda import (
    ModelShape,
    make_tensors,
    model_runs,
    param_list,
)


def _load_plan(plans_dir: str, name: str):
    from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan

    for suffix in (".json.gz", ".json"):
        path = Path(plans_dir) / f"{name}_tp1_rank0{suffix}"
        if path.exists():
            opener = gzip.open if suffix.endswith(".gz") else open
            with opener(path, "rt") as f:
                return WorkerPlan.from_json(json.load(f))
    raise FileNotFoundError(f"no plan {name}_tp1_rank0.json[.gz] in {plans_dir}")


def _land(params, baked, args):
    """Land every chunk of ``baked`` (restricted to ``params``) ``args.reps``
    times; the seconds of each landing, the copies that came out wrong, and
    the pull plan."""
    from vllm.distributed.weight_transfer.plan.copy_exec import empty_dests
    from vllm.distributed.weight_transfer.plan.copy_table import compile_copy_table
    from vllm.distributed.weight_transfer.plan.ops import replay_slice
    from vllm.distributed.weight_transfer.plan.worker_plan import build_plan
    from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
    from vllm.distributed.weight_transfer.pull.producer import pack_chunk
    from vllm.distributed.weight_transfer.pull.routing import RdtRouter
    from vllm.distributed.weight_transfer.sharded_rdt.lander import (
        IN_PLACE,
        ChunkLander,
    )

    names = [n for n, _ in params]
    sent = set(names)
    plan = build_plan(
        worker=baked.worker,
        names=names,
        copies=[c for c in baked.copies if c.slice.source in sent],
    )
    metas = {n: (s, "bfloat16") for n, s in params}
    table = compile_copy_table(plan, metas, only_sources=metas)
    served = {
        spec.name: t
        for spec, t in zip(table.dests, empty_dests(table, "cuda"), strict=True)
    }
    direct = {}
    for copy in plan.copies:
        region, tensor = copy.region, served[copy.region.qualname]
        direct[copy] = tensor.as_strided(
            region.shape, region.stride, tensor.storage_offset() + region.offset
        )
    trainer = make_tensors(params, seed=7)
    pulls = build_pull_plan(plan, RdtRouter(1, 1), consumer_id=0)
    buffers = []
    for chunk in pulls.chunks:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device="cuda")
        pack_chunk(chunk, trainer, buf)
        buffers.append(buf)

    def check(inverted: bool) -> list[str]:
        bad = []
        for c, view in direct.items():
            want = replay_slice(trainer[c.slice.source], c.slice)
            want = want.contiguous().view(torch.int16)
            if inverted:
                want = torch.bitwise_not(want)
            if not torch.equal(view.contiguous().view(torch.int16), want):
                bad.append(f"{c.slice.source} -> {c.region.qualname}")
        return bad

    # A second set of buffers at other addresses, holding every chunk's bytes
    # inverted (so a landing from it is told apart from one from the first
    # set): the fresh-buffer modes land from the two sets in turn.
    other = [torch.bitwise_not(buf) for buf in buffers]
    out = {}
    # (mode, batch method, buffers reused, bind_fresh_buffers)
    modes = (
        ("one_by_one", None, True, False),
        ("batched", "auto", True, False),
        ("batched_fresh_buffers", "auto", False, False),
        ("batched_bound_each_sync", "auto", False, True),
    )
    for mode, method, reused, bind_fresh in modes:
        lander = ChunkLander(
            torch.nn.Module(),
            plan,
            pulls,
            IN_PLACE,
            direct=direct,
            batch_method=method,
            bind_fresh_buffers=bind_fresh,
        )
        turn = [0]

        def land_all(lander=lander, reused=reused, turn=turn) -> None:
            sets = (buffers,) if reused else (buffers, other)
            lander.begin()
            for index, data in enumerate(sets[turn[0] % len(sets)]):
                lander.land(index, data, reused=reused)
            turn[0] += 1

        for view in direct.values():
            view.zero_()
        # The first landing compiles and binds each chunk's batched copy.
        first = device_times(land_all, 1)[0]
        times = device_times(land_all, args.reps)
        out[mode] = {
            "first_land_s": first,
            "land_seconds": times,
            "batched_copies": lander.batched,
            "binds": lander.binds,
            # Odd landings of the fresh-buffer modes read the inverted set.
            "bad": check(inverted=not reused and turn[0] % 2 == 0),
        }
        del lander
    return out, pulls


def _flat_copy_times(nbytes: int, reps: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return device_times(lambda: dst.copy_(src), reps)


def run_model(shape: ModelShape, layers: int | None, plan_name: str, args) -> dict:
    params = param_list(shape, layers)
    modes, pulls = _land(params, _load_plan(args.plans_dir, plan_name), args)
    torch.cuda.empty_cache()
    flat = min(_flat_copy_times(pulls.payload_bytes, args.reps))
    torch.cuda.empty_cache()
    result = {
        "model": shape.name,
        "layers": layers or shape.layers,
        "tensors": len(params),
        "slices": sum(len(c.slices) for c in pulls.chunks),
        "chunks": len(pulls.chunks),
        "bytes": pulls.payload_bytes,
        "flat_seconds": flat,
    }
    for mode, m in modes.items():
        land = m["land_seconds"]
        result[mode] = {
            "land_seconds": land,
            "land_best_s": min(land),
            "land_median_s": statistics.median(land),
            "first_land_s": m["first_land_s"],
            "batched_copies": m["batched_copies"],
            "binds": m["binds"],
            "fraction_of_device_copy": flat / min(land),
            "fraction_of_device_copy_median": flat / statistics.median(land),
            "bit_exact": not m["bad"],
            "first_bad": m["bad"][:5],
        }
    # The engine's path: each chunk's direct copies as one batched copy.
    result["fraction_of_device_copy"] = result["batched"]["fraction_of_device_copy"]
    one_by_one = result["one_by_one"]["land_best_s"]
    result["batched_over_one_by_one"] = one_by_one / result["batched"]["land_best_s"]
    result["fresh_buffers_over_one_by_one"] = (
        one_by_one / result["batched_fresh_buffers"]["land_best_s"]
    )
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans-dir", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--moe-layers", type=int, default=24)
    p.add_argument("--models", default="8b,30b")
    p.add_argument("--out", default=str(result_path(__file__)))
    args = p.parse_args()
    runs = model_runs(args.models, args.moe_layers)
    doc = {
        "benchmark": "sharded_rdt_planned_landing_cuda",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "results": [run_model(s, layers, plan, args) for s, layers, plan in runs],
    }
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
