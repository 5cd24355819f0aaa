# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt on CPU: bytes each worker pulls and its pull throughput, next to
a raw NIXL read of the same size in the same run; then delta syncs against
full syncs on the same engine, at several change rates.

The benchmark process is the trainer (one rank, direct NIXL producer) and holds
the model in Hugging Face form; vLLM runs it as an offline ``LLM`` with the
default executor, so every byte crosses a process boundary by NIXL READ.

Full syncs (``delta_bases_gb=0``): before each one every weight is redrawn.
They run before and after the delta syncs, each time under a trainer of their
own on the same engine, and their median is the reference.

Delta syncs (``--deltas``, a trainer with ``delta_bases_gb`` set on the same
engine): one full sync seeds both sides' copies, then, per change rate, before
each sync a random subset of that fraction of every weight's elements moves by
one unit in the last place (the lowest bit of the element flips) and the rest
keep their exact bits, as a small optimizer step leaves them. Per rate: bytes
read from the producers (receipt ``read_bytes``) and sync time (median), both
against the full syncs', the chunks that came as deltas, and where the time
went (producer: packing, encoding, keeping the base and its digest; worker:
applying deltas, the held copy's digest, keeping what landed). After the last
sync of each rate (and of each full phase) the engine must serve bit for bit
what a fresh vLLM load of the trainer's weights serves, each prompt generated
alone so that every step has the same shapes (float32 also: the Hugging Face
greedy output, within a tolerance); a mismatch is recorded and fails the run.

The "measured RL rate" is read from
``benchmarks/results/delta_opportunity_cpu/cpu-2core.json``: the 1 GiB Qwen3
with fp32 master weights cast to bf16, mean changed fraction of steps 2-20,
at lr 1e-6 and 3e-6.

Run: ``python benchmarks/weight_transfer/bench_sharded_pull.py [--tp 2]
[--num-layers 8] [--dtype bfloat16] [--arch qwen3_moe] [--rounds 3]
[--deltas] [--landing planned]``; the result goes to
``benchmarks/results/sharded_pull/<device>-tp<N>[-planned].json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from _bench_common import (
    QWEN3_BENCH_SHAPE,
    RESULTS,
    BenchModel,
    bench_model,
    bench_model_of,
    git_commit,
    raw_nixl_read_s,
    result_path,
    rounded,
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
    FreshLoadOracle,
    assert_serves_weights,
    offline_worker_call,
    randomize_weights_,
    vllm_greedy,
)

# The machine fields of this benchmark's results.
MACHINE_KEYS = ("cpu_count", "platform", "torch", "load_avg_1m")

OPPORTUNITY = RESULTS / "delta_opportunity_cpu" / "cpu-2core.json"
# The runs of OPPORTUNITY whose mean changed fraction is a "measured RL rate".
RL_RUNS = (("fp32_master", 1e-6), ("fp32_master", 3e-6))
# Fixed change rates (fraction of elements) of the benchmark.
FIXED_RATES = (0.005, 0.02, 0.10, 0.50, 1.0)

# The goals: at the measured RL rate, bytes read and sync time as
# fractions of a full sync's; at 100% changed, the time over a full sync's.
GOAL_BYTES_AT_RL = 0.10
GOAL_TIME_AT_RL = 0.30
GOAL_TIME_AT_ALL = 1.05


def measured_rl_rates() -> list[dict[str, Any]]:
    """The RL change rates of the 1 GiB Qwen3 in OPPORTUNITY (``RL_RUNS``)."""
    doc = json.loads(OPPORTUNITY.read_text())
    rates = []
    for mode, lr in RL_RUNS:
        (run,) = [
            r
            for r in doc["qwen3_1gib_run"]["runs"]
            if r["mode"] == mode and r["lr"] == lr
        ]
        rates.append(
            {
                "label": f"measured RL rate ({run['model']}, {mode}, lr {lr:g})",
                "fraction": run["summary_steps_2_to_n"]["changed_fraction_mean"],
            }
        )
    return rates


def moe_bench_model(num_layers: int, dtype: str) -> BenchModel:
    """A Qwen3-MoE of ``QWEN3_BENCH_SHAPE``'s attention and vocabulary with 8
    experts of 512 per layer (2 routed), written once and loaded."""
    from vllm.distributed.weight_transfer.testing import TinyModelSpec

    shape = dict(QWEN3_BENCH_SHAPE, arch="qwen3_moe")
    spec = TinyModelSpec(
        **shape,
        num_layers=num_layers,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=512,
        dtype=dtype,  # type: ignore[arg-type]
    )
    return bench_model_of(spec)


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def move_elements_(model: torch.nn.Module, fraction: float, seed: int) -> int:
    """Flip the lowest bit (one unit in the last place) of a random
    ``fraction`` of every parameter's elements, the rest untouched; the
    number of elements changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            bits = param.data.view(BITS[param.dtype])
            if fraction >= 1.0:
                bits ^= 1
                changed += bits.numel()
                continue
            moved = torch.rand(bits.shape, generator=gen) < fraction
            bits ^= moved.to(bits.dtype)
            changed += int(moved.sum())
    return changed


class Seconds:
    """Wall seconds spent in chosen functions, added up per name (thread
    safe: the producer packs on its server's threads, a worker applies
    deltas on its puller thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def time(self, owner: Any, attr: str, name: str) -> None:
        """Replace ``owner.attr`` by a version that adds its time to ``name``."""
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.totals[name] = self.totals.get(name, 0.0) + dt
                    self.calls[name] = self.calls.get(name, 0) + 1

        setattr(owner, attr, timed)

    def take(self) -> dict[str, Any]:
        """The totals since the last take, rounded, and reset."""
        with self.lock:
            out = {k: round(v, 4) for k, v in sorted(self.totals.items())}
            out.update({f"{k}_calls": n for k, n in sorted(self.calls.items())})
            self.totals, self.calls = {}, {}
        return out


def time_producer_delta_path() -> Seconds:
    """Time, in this (the producer's) process: packing each chunk, encoding
    its delta, the digest of a delta's base (taken inside the encode that
    yields the delta, so part of ``encode_s``), the apply that turns the
    kept bytes into the new ones (``keep_apply_s``, the base's checksum
    updated with it), and the whole offer (encode + keep the new bytes as
    the next base)."""
    from vllm.distributed.weight_transfer.pull import delta, delta_bases, producer

    seconds = Seconds()
    seconds.time(producer, "pack_chunk", "pack_s")
    seconds.time(delta_bases.PublishedBases, "offer", "offer_s")
    seconds.time(delta_bases, "encode_delta", "encode_s")
    seconds.time(delta, "payload_checksum", "base_digest_s")
    seconds.time(delta_bases, "apply_delta", "keep_apply_s")
    return seconds


def time_worker_delta_path(worker: Any) -> bool:
    """Time, in a vLLM worker (run through ``collective_rpc``): each delta's
    landing (read it, check and apply it to the held copy, copy that to the
    receive buffer; or read the served bytes back into the receive buffer,
    ``read_back_s``, and apply it there), the base's digest inside it (a
    pass only where the stored one is unknown, and always for served
    bytes), the apply (``held_apply_s``), and keeping each landed chunk as
    the next base. A delta written into the served tensors instead: its
    check there on the pulling thread (``in_place_check_s``: of it, the
    served bytes' checksum, ``served_digest_s``), and its write in the
    landing step (``in_place_write_s``)."""
    from vllm.distributed.weight_transfer.pull import (
        delta,
        delta_bases,
        delta_write,
        transport,
    )
    from vllm.distributed.weight_transfer.sharded_rdt import lander

    if getattr(worker, "_bench_delta_seconds", None) is not None:
        return False
    seconds = Seconds()
    seconds.time(transport, "land_delta", "land_delta_s")
    seconds.time(delta, "payload_checksum", "held_digest_s")
    seconds.time(delta_bases, "apply_delta", "held_apply_s")
    seconds.time(delta_bases.HeldBases, "record", "keep_landed_s")
    seconds.time(lander.ChunkLander, "read_back", "read_back_s")
    seconds.time(transport, "delta_in_place", "in_place_check_s")
    seconds.time(delta, "pieces_checksum", "served_digest_s")
    seconds.time(delta_write.PiecesWrite, "write", "in_place_write_s")
    worker._bench_delta_seconds = seconds
    return True


def take_worker_seconds(worker: Any) -> dict[str, Any]:
    seconds = getattr(worker, "_bench_delta_seconds", None)
    return seconds.take() if seconds is not None else {}


def last_receipt(worker: Any) -> dict[str, Any]:
    return worker.weight_transfer_engine.last_receipt


class Bench:
    """The engine, the trainer's model, and one trainer at a time on them."""

    def __init__(self, llm: Any, bench: BenchModel, tp: int) -> None:
        self.llm = llm
        self.bench = bench
        self.model = bench.model
        self.tp = tp
        self.trainer: Any = None
        self.oracle = FreshLoadOracle(
            offline_worker_call(llm), lambda: vllm_greedy(llm, one_at_a_time=True)
        )

    def start_trainer(self, delta_bases_gb: float) -> float:
        if self.trainer is not None:
            self.trainer.shutdown()
        t0 = time.perf_counter()
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=self.tp, rank=0, delta_bases_gb=delta_bases_gb
            ),
            client=OfflineLLMWeightSyncClient(self.llm),
            source=CheckpointNamesSource(self.model),
        )
        return time.perf_counter() - t0

    def sync(self, label: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.trainer.send_weights()
        sync_s = time.perf_counter() - t0
        receipts = self.llm.collective_rpc(last_receipt)
        producer = self.trainer.producer
        record = {
            "sync_s": sync_s,
            "receipts": receipts,
            "producer_deltas_offered": producer.deltas_offered,
            "producer_delta_bytes": producer.delta_bytes,
        }
        print(
            f"{label}: {sync_s:.3f} s; "
            + "; ".join(
                f"worker {r['consumer_id']} read {r['read_bytes'] / 2**20:.1f} of "
                f"{r['bytes'] / 2**20:.1f} MiB in {r['seconds']:.3f} s, "
                f"{r['delta_chunks']}/{r['chunks']} chunks as deltas"
                + (f" ({r['delta_refused']} refused)" if r["delta_refused"] else "")
                for r in receipts
            ),
            flush=True,
        )
        return record

    def exact(self, what: str) -> dict[str, Any]:
        """Whether the engine serves exactly the trainer's weights now."""
        t0 = time.perf_counter()
        try:
            assert_serves_weights(
                self.oracle, self.model, dtype=self.bench.dtype, what=what
            )
        except AssertionError as e:
            print(f"NOT EXACT {what}: {e}", flush=True)
            return {"served_exact": False, "mismatch": str(e)[:500]}
        print(f"exact: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)
        return {"served_exact": True}


def full_phase(b: Bench, rounds: int, seed: int, warmup: bool) -> dict[str, Any]:
    """``rounds`` full syncs (every weight redrawn before each) under a trainer
    with deltas off, after a warm-up sync when ``warmup``."""
    init_s = b.start_trainer(0.0)
    syncs = []
    for i in range(rounds + int(warmup)):
        randomize_weights_(b.model, seed=seed + i, std=0.02)
        first = warmup and i == 0
        syncs.append(b.sync(f"full sync {i}{' (warmup)' if first else ''}"))
    return {
        "trainer_init_s": init_s,
        "warmup": syncs[0] if warmup else None,
        "syncs": syncs[int(warmup) :],
        **b.exact("after the full syncs"),
    }


def read_bytes(sync: dict[str, Any]) -> int:
    return sum(r["read_bytes"] for r in sync["receipts"])


def delta_phase(
    b: Bench, rates: list[dict[str, Any]], rounds: int, delta_gb: float
) -> dict[str, Any]:
    """One seeding full sync, a warm-up delta sync, then ``rounds`` delta syncs
    per rate, under a trainer with ``delta_gb`` of bases."""
    init_s = b.start_trainer(delta_gb)
    producer_seconds = time_producer_delta_path()
    b.llm.collective_rpc(time_worker_delta_path)
    randomize_weights_(b.model, seed=500, std=0.02)
    seed_sync = b.sync("delta trainer, seeding sync")
    move_elements_(b.model, rates[0]["fraction"], seed=501)
    warmup = b.sync("delta trainer, warm-up delta sync")
    producer_seconds.take()
    b.llm.collective_rpc(take_worker_seconds)
    out = []
    for ri, rate in enumerate(rates):
        syncs = []
        for i in range(rounds):
            changed = move_elements_(b.model, rate["fraction"], seed=1000 * ri + i)
            sync = b.sync(f"{rate['label']} ({100 * rate['fraction']:.2f}%) {i}")
            sync["changed_elements"] = changed
            syncs.append(sync)
        out.append(
            {
                **rate,
                "changed_fraction_actual": statistics.mean(
                    s["changed_elements"] for s in syncs
                )
                / b.bench.params,
                "syncs": syncs,
                # Totals over this rate's syncs.
                "producer_seconds": producer_seconds.take(),
                "worker_seconds": b.llm.collective_rpc(take_worker_seconds),
                **b.exact(f"after delta syncs at {rate['label']}"),
            }
        )
    return {
        "trainer_init_s": init_s,
        "seed_sync": seed_sync,
        "warmup": warmup,
        "rates": out,
    }


def per_worker_summary(syncs: list[dict[str, Any]], tp: int) -> list[dict[str, Any]]:
    """The full syncs' figures per worker, as earlier results had them."""
    per_worker = []
    for w in range(tp):
        rs = [s["receipts"][w] for s in syncs]
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
    return per_worker


RECEIPT_KEYS = (
    "consumer_id",
    "bytes",
    "read_bytes",
    "chunks",
    "delta_chunks",
    "delta_in_place",
    "delta_refused",
    "delta_first_refusal",
    "delta_bases_bytes",
    "delta_served_bases",
    "seconds",
    "pull_seconds",
    "land_seconds",
)


def rate_summary(
    rate: dict[str, Any], full_s: float, full_read: float
) -> dict[str, Any]:
    syncs = rate["syncs"]
    sync_s = [s["sync_s"] for s in syncs]
    median_s = statistics.median(sync_s)
    reads = [read_bytes(s) for s in syncs]
    return {
        "label": rate["label"],
        "changed_fraction": rate["fraction"],
        "changed_fraction_actual": rate["changed_fraction_actual"],
        "sync_s": sync_s,
        "sync_median_s": median_s,
        "time_vs_full": median_s / full_s,
        "read_bytes": reads,
        "bytes_vs_full": statistics.median(reads) / full_read,
        "delta_chunks": [sum(r["delta_chunks"] for r in s["receipts"]) for s in syncs],
        "delta_refused": sum(r["delta_refused"] for s in syncs for r in s["receipts"]),
        "chunks": sum(r["chunks"] for r in syncs[0]["receipts"]),
        "producer_delta_bytes": [s["producer_delta_bytes"] for s in syncs],
        "served_exact": rate["served_exact"],
        **({"mismatch": rate["mismatch"]} if "mismatch" in rate else {}),
        "seconds_over_the_rate_syncs": {
            "producer": rate["producer_seconds"],
            "workers": rate["worker_seconds"],
            "worker_receipts_pull_s": [
                sum(s["receipts"][w]["pull_seconds"] for s in syncs)
                for w in range(len(syncs[0]["receipts"]))
            ],
            "worker_receipts_land_s": [
                sum(s["receipts"][w]["land_seconds"] for s in syncs)
                for w in range(len(syncs[0]["receipts"]))
            ],
        },
        "receipts": [
            [{k: r.get(k) for k in RECEIPT_KEYS} for r in s["receipts"]] for s in syncs
        ],
    }


def goals(rates: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rate's ratios against the issue's goals (no assertion)."""
    out: dict[str, Any] = {}
    for r in rates:
        if r["label"].startswith("measured RL rate"):
            out[r["label"]] = {
                "bytes_vs_full": r["bytes_vs_full"],
                "bytes_goal": GOAL_BYTES_AT_RL,
                "bytes_met": r["bytes_vs_full"] <= GOAL_BYTES_AT_RL,
                "time_vs_full": r["time_vs_full"],
                "time_goal": GOAL_TIME_AT_RL,
                "time_met": r["time_vs_full"] <= GOAL_TIME_AT_RL,
            }
        elif r["changed_fraction"] >= 1.0:
            out["100% changed"] = {
                "time_vs_full": r["time_vs_full"],
                "time_goal": GOAL_TIME_AT_ALL,
                "time_met": r["time_vs_full"] <= GOAL_TIME_AT_ALL,
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3")
    p.add_argument("--rounds", type=int, default=3, help="measured syncs per set")
    p.add_argument("--deltas", action="store_true", help="also run delta syncs")
    p.add_argument(
        "--landing",
        choices=["reload", "planned"],
        default="reload",
        help="the engine's landing; planned (with plain CPU linear layers) "
        "lands most chunks straight in served tensors, where a worker reads "
        "its delta bases back instead of keeping copies",
    )
    p.add_argument(
        "--delta-bases-gb",
        type=float,
        default=0.0,
        help="delta_bases_gb of the delta trainer (default: 1.25x the model)",
    )
    args = p.parse_args()
    if args.tp > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp))
        )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # receipts via RPC
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    if args.arch == "qwen3_moe":
        bench = moe_bench_model(args.num_layers, args.dtype)
    else:
        bench = bench_model(args.num_layers, args.dtype)
    model_dir, nbytes = bench.dir, bench.nbytes
    print(f"model {model_dir.name}: {nbytes / 2**30:.2f} GiB {args.dtype}")
    delta_gb = args.delta_bases_gb or round(1.25 * nbytes / 2**30, 2)
    rates = measured_rl_rates() + [
        {"label": f"{100 * f:g}% changed", "fraction": f} for f in FIXED_RATES
    ]

    from vllm.config import WeightTransferConfig

    config = WeightTransferConfig(backend="sharded_rdt")
    if args.landing == "planned":
        config = WeightTransferConfig(
            backend="sharded_rdt", landing="planned", cpu_linear="plain"
        )
    llm = tiny_llm(
        model_dir,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        weight_transfer_config=config,
    )
    try:
        b = Bench(llm, bench, args.tp)
        before = full_phase(b, args.rounds, seed=1000, warmup=True)
        deltas = after = None
        if args.deltas:
            deltas = delta_phase(b, rates, args.rounds, delta_gb)
            after = full_phase(b, args.rounds, seed=2000, warmup=False)
        b.trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()

    full = before["syncs"] + (after["syncs"] if after else [])
    full_median_s = statistics.median(s["sync_s"] for s in full)
    full_read = statistics.median(read_bytes(s) for s in full)
    per_worker = per_worker_summary(before["syncs"], args.tp)
    raw_bytes = per_worker[0]["bytes"]
    raw = raw_nixl_read_s(raw_bytes)
    result: dict[str, Any] = {
        **run_record("sharded_rdt_cpu_pull", git_commit(), *MACHINE_KEYS),
        "model": {
            "dir": model_dir.name,
            "spec": dataclasses.asdict(bench.spec),
            "params": bench.params,
            "bytes": nbytes,
        },
        "vllm": {
            "tensor_parallel_size": args.tp,
            "dtype": args.dtype,
            "transport": "nixl (direct agents)",
            "landing": args.landing,
        },
        "trainer_init_s": before["trainer_init_s"],
        "warmup_sync_s": before["warmup"]["sync_s"],
        # The full syncs before the delta syncs (the figures earlier results
        # had); the delta section compares against these and those after.
        "sync_s": [s["sync_s"] for s in before["syncs"]],
        "sync_median_s": statistics.median(s["sync_s"] for s in before["syncs"]),
        "per_worker": per_worker,
        "raw_nixl_read": {
            "bytes": raw_bytes,
            "seconds": raw,
            "best_gib_s": raw_bytes / min(raw) / 2**30,
        },
        "oracle_match": before["served_exact"]
        and (after is None or after["served_exact"]),
    }
    if deltas is not None and after is not None:
        summaries = [rate_summary(r, full_median_s, full_read) for r in deltas["rates"]]
        result["oracle_match"] = result["oracle_match"] and all(
            r["served_exact"] for r in summaries
        )
        result["deltas"] = {
            "delta_bases_gb": delta_gb,
            "change": "a random subset of each weight's elements moves by one "
            "unit in the last place (lowest bit flipped); the rest keep "
            "their bits",
            "measured_rl_rate_source": str(OPPORTUNITY.relative_to(RESULTS.parent)),
            "full_syncs": {
                "sync_s_before": [s["sync_s"] for s in before["syncs"]],
                "sync_s_after": [s["sync_s"] for s in after["syncs"]],
                "sync_median_s": full_median_s,
                "read_bytes": full_read,
                "served_exact_after": after["served_exact"],
            },
            "seed_sync": {
                "sync_s": deltas["seed_sync"]["sync_s"],
                "read_bytes": read_bytes(deltas["seed_sync"]),
                "delta_bases_bytes": [
                    r["delta_bases_bytes"] for r in deltas["seed_sync"]["receipts"]
                ],
                "delta_served_bases": [
                    r.get("delta_served_bases", 0)
                    for r in deltas["seed_sync"]["receipts"]
                ],
            },
            "warmup_delta_sync_s": deltas["warmup"]["sync_s"],
            "trainer_init_s": deltas["trainer_init_s"],
            "rates": summaries,
            "goals": goals(summaries),
        }
    suffix = "" if args.landing == "reload" else f"-{args.landing}"
    out = result_path(__file__, f"tp{args.tp}{suffix}")
    write_json(rounded(result, 6), out)
    update = [round(w["update_weights_gib_s"], 3) for w in per_worker]
    pulls_only = [round(w["pull_only_gib_s"], 3) for w in per_worker]
    raw_gib_s = result["raw_nixl_read"]["best_gib_s"]
    print(
        f"full syncs: median {full_median_s:.3f} s; per worker GiB/s: "
        f"update_weights (pull+land+process) {update}, pulls alone {pulls_only}; "
        f"raw NIXL read of {raw_bytes / 2**20:.1f} MiB {raw_gib_s:.2f} GiB/s"
    )
    if "deltas" in result:
        print("rate | changed | bytes/full | time/full | delta chunks | exact")
        for r in result["deltas"]["rates"]:
            print(
                f"{r['label']} | {100 * r['changed_fraction_actual']:.2f}% | "
                f"{r['bytes_vs_full']:.4f} | {r['time_vs_full']:.3f} | "
                f"{r['delta_chunks']}/{r['chunks']} | {r['served_exact']}"
            )
        for label, g in result["deltas"]["goals"].items():
            print(f"goal at {label}: {g}")
    print(f"wrote {out}")
    if not result["oracle_match"]:
        raise SystemExit("the engine did not serve the trainer's weights exactly")


if __name__ == "__main__":
    main()
