# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU sweep over model size: the fork's two engines (``ipc``, ``sharded_rdt``)
against the machine's floors and against a checkpoint reload without the fork.

For each size (GiB of float32 weights; a generated Qwen3 with the shape of
``bench_ipc_cpu``, made deeper) the sweep measures, one process at a time:

* ``floors``: one ``copy_`` of the model's bytes between two warm tensors
  (memcpy) and one NIXL READ of the same bytes by a second process (raw NIXL);
* ``ipc``: ``send_weights()`` into an offline ``LLM(weight_transfer_config=ipc)``
  through ``OfflineLLMWeightSyncClient`` with the default settings (packed,
  overlapped chunks, kept shared-memory buffer);
* ``sharded_rdt``: ``send_weights()`` from a trainer with a direct NIXL
  producer into an offline ``LLM(weight_transfer_config=sharded_rdt)``;
* ``reload``: what a user of vLLM on CPU does without the fork: the trainer
  writes a safetensors checkpoint (``save_pretrained``) and a plain ``LLM``
  reloads it in place with ``collective_rpc("reload_weights",
  kwargs={"weights_path": ...})``; the time is save + reload.

Every engine gets its own ``LLM`` (TP=1, eager, float32, 1 GiB KV cache) in
its own child process, so one engine's memory is gone before the next starts
and each process's peak RSS belongs to one engine. Weights are redrawn before
every sync; the first sync is a warm-up and the median of the others is
reported. After the last sync vLLM's greedy output is compared with a Hugging
Face forward pass of the trainer's weights (``oracle_match``).

Run: ``python benchmarks/weight_transfer/bench_cpu_sweep.py [--sizes 0.25 1 4]
[--rounds 3]``; the result goes to ``benchmarks/results/cpu_sweep/<device>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench_common import (
    QWEN3_BENCH_SHAPE,
    TimedClient,
    bench_model,
    child_rss_bytes,
    git_commit,
    machine_info,
    max_rss_bytes,
    memcpy_times_s,
    raw_nixl_read_s,
    result_path,
    utc_now,
    write_json,
)

GIB = 2**30

# The shape of bench_ipc_cpu's model; only the depth changes with the size.
BASE_SPEC: dict[str, Any] = QWEN3_BENCH_SHAPE
STEPS = ("floors", "ipc", "sharded_rdt", "reload")


def model_bytes(num_layers: int) -> int:
    """float32 bytes of BASE_SPEC with ``num_layers`` decoder layers."""
    s = BASE_SPEC
    h, q, kv = s["hidden_size"], s["num_heads"], s["num_kv_heads"]
    d, inter = s["head_dim"], s["intermediate_size"]
    per_layer = (
        h * q * d
        + 2 * h * kv * d
        + q * d * h  # q, k, v, o projections
        + 3 * h * inter  # gate, up, down
        + 2 * h
        + 2 * d  # two RMSNorms, q_norm and k_norm
    )
    fixed = 2 * s["vocab_size"] * h + h  # embeddings, untied lm_head, final norm
    return 4 * (fixed + num_layers * per_layer)


def layers_for(size_gib: float) -> int:
    """Depth whose model is closest to ``size_gib`` (at least one layer)."""
    per_layer = model_bytes(1) - model_bytes(0)
    return max(1, round((size_gib * GIB - model_bytes(0)) / per_layer))


# ---------------------------------------------------------------- child steps


def _load_trainer_model(num_layers: int) -> tuple[Any, Path, int]:
    """The trainer's model, its folder and its bytes; every weight touched once,
    so the RSS baseline holds the whole model and its temporaries."""
    bench = bench_model(num_layers, touch=True)
    return bench.model, bench.dir, bench.nbytes


def _start_llm(model_dir: Path, backend: str | None) -> tuple[Any, float]:
    from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

    t0 = time.perf_counter()
    llm = tiny_llm(model_dir, backend=backend)
    return llm, time.perf_counter() - t0


def _oracle(llm: Any, model: Any) -> tuple[bool, str | None]:
    from vllm.distributed.weight_transfer.testing import (
        assert_same_greedy,
        hf_greedy,
        logprob_atol,
        vllm_greedy,
    )

    try:
        assert_same_greedy(
            vllm_greedy(llm), hf_greedy(model), atol=logprob_atol("float32")
        )
    except AssertionError as e:
        return False, str(e)
    return True, None


def _stop_llm(llm: Any) -> dict[str, Any]:
    """Shut the engine down and wait until its processes are gone."""
    import psutil

    # The engine's processes; multiprocessing's resource tracker stays until
    # this process exits.
    procs = [
        proc
        for proc in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(proc.cmdline())
    ]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    _, alive = psutil.wait_procs(procs, timeout=60)
    for proc in alive:  # processes this benchmark started, by pid
        proc.kill()
    return {"engine_processes": len(procs), "killed_after_60s": len(alive)}


def _run_syncs(
    rounds: int, model: Any, sync: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    from vllm.distributed.weight_transfer.testing import randomize_weights_

    syncs = []
    for round_ in range(rounds + 1):
        randomize_weights_(model, seed=100 + round_, std=0.02)
        t0 = time.perf_counter()
        detail = sync()
        record = {"sync_s": time.perf_counter() - t0, **detail}
        syncs.append(record)
        label = " (warm-up)" if round_ == 0 else ""
        print(f"  sync {round_}{label}: {record['sync_s']:.3f} s", flush=True)
    return syncs


def _measure(
    llm: Any,
    model: Any,
    rounds: int,
    rss_before: int,
    sync: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The syncs, then what every engine step reports after them: trainer
    and worker memory, and the oracle."""
    syncs = _run_syncs(rounds, model, sync)
    rss_after = max_rss_bytes()
    workers = child_rss_bytes()
    match, mismatch = _oracle(llm, model)
    return {
        "syncs": syncs,
        "trainer_peak_rss_bytes_before_sync": rss_before,
        "trainer_peak_rss_bytes": rss_after,
        "child_rss_bytes": workers,
        "oracle_match": match,
        "oracle_mismatch": mismatch,
    }


def step_floors(num_layers: int, rounds: int) -> dict[str, Any]:
    nbytes = model_bytes(num_layers)
    memcpy = memcpy_times_s(nbytes)
    gc.collect()
    raw = raw_nixl_read_s(nbytes, repeats=3)
    return {
        "bytes": nbytes,
        "memcpy_s": memcpy,
        "memcpy_median_s": statistics.median(memcpy),
        "raw_nixl_read_s": raw,
        "raw_nixl_best_s": min(raw),
        "raw_nixl_median_s": statistics.median(raw),
    }


def step_ipc(num_layers: int, rounds: int) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    model, model_dir, nbytes = _load_trainer_model(num_layers)
    llm, start_s = _start_llm(model_dir, "ipc")
    rss_before = max_rss_bytes()
    client = TimedClient(OfflineLLMWeightSyncClient(llm))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
    )

    def sync() -> dict[str, Any]:
        client.reset()
        t0 = time.perf_counter()
        trainer.send_weights()
        return {"phases_s": client.split_s(time.perf_counter() - t0)}

    measured = _measure(llm, model, rounds, rss_before, sync)
    plan = getattr(trainer, "last_plan", None)
    trainer.shutdown()
    stopped = _stop_llm(llm)
    return {
        "bytes": nbytes,
        "model_dir": model_dir.name,
        "llm_start_s": start_s,
        "buffer_nbytes": plan.buffer_nbytes if plan else None,
        "chunks": len(plan.chunks) if plan else None,
        **measured,
        **stopped,
    }


def step_sharded_rdt(num_layers: int, rounds: int) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.api import (
        CheckpointNamesSource,
        ShardedRDTTrainerInitInfo,
    )
    from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    model, model_dir, nbytes = _load_trainer_model(num_layers)
    llm, start_s = _start_llm(model_dir, "sharded_rdt")
    rss_before = max_rss_bytes()
    t0 = time.perf_counter()
    trainer = WeightTransferTrainerFactory.trainer_init(
        ShardedRDTTrainerInitInfo(num_consumers=1, rank=0),
        client=OfflineLLMWeightSyncClient(llm),
        source=CheckpointNamesSource(model),
    )
    init_s = time.perf_counter() - t0

    def sync() -> dict[str, Any]:
        trainer.send_weights()
        (receipt,) = llm.collective_rpc(lambda w: w.weight_transfer_engine.last_receipt)
        return {
            key: receipt[key]
            for key in ("bytes", "chunks", "seconds", "pull_seconds", "land_seconds")
        }

    measured = _measure(llm, model, rounds, rss_before, sync)
    trainer.shutdown()
    stopped = _stop_llm(llm)
    return {
        "bytes": nbytes,
        "model_dir": model_dir.name,
        "llm_start_s": start_s,
        "trainer_init_s": init_s,
        **measured,
        **stopped,
    }


def step_reload(num_layers: int, rounds: int) -> dict[str, Any]:
    """Checkpoint + reload, vLLM's own path: ``Worker.reload_weights`` reads the
    safetensors under ``weights_path`` through the model loader and runs the
    layerwise reload."""
    model, model_dir, nbytes = _load_trainer_model(num_layers)
    llm, start_s = _start_llm(model_dir, None)
    rss_before = max_rss_bytes()
    # A disk-backed folder (not tmpfs), next to the cached model.
    ckpt = Path(tempfile.mkdtemp(prefix="sweep-ckpt-", dir=model_dir.parent))

    def sync() -> dict[str, Any]:
        t0 = time.perf_counter()
        model.save_pretrained(ckpt, safe_serialization=True)
        saved = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ckpt)})
        return {"save_s": saved - t0, "reload_s": time.perf_counter() - saved}

    try:
        measured = _measure(llm, model, rounds, rss_before, sync)
        files = sorted(p.name for p in ckpt.iterdir())
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    stopped = _stop_llm(llm)
    return {
        "bytes": nbytes,
        "model_dir": model_dir.name,
        "llm_start_s": start_s,
        "checkpoint_files": files,
        **measured,
        **stopped,
    }


STEP_FUNCS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "floors": step_floors,
    "ipc": step_ipc,
    "sharded_rdt": step_sharded_rdt,
    "reload": step_reload,
}


def run_step_here(step: str, num_layers: int, rounds: int, out: Path) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # sharded_rdt's receipts come back through collective_rpc of a function.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    result = STEP_FUNCS[step](num_layers, rounds)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    write_json(result, out)
    return 0


# --------------------------------------------------------------- orchestrator


def run_step_child(
    step: str, num_layers: int, rounds: int, timeout_s: float
) -> dict[str, Any]:
    """Run one step in a fresh Python process; its engine dies with it."""
    with tempfile.TemporaryDirectory(prefix="cpu-sweep-") as tmp:
        out = Path(tmp) / "step.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--step",
            step,
            "--num-layers",
            str(num_layers),
            "--rounds",
            str(rounds),
            "--step-out",
            str(out),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"{step} did not finish within {timeout_s:.0f} s"}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            return {"error": f"{step} exited with status {proc.returncode}"}
        result = json.loads(out.read_text())
    result["step_wall_s"] = wall
    return result


def _median_measured(step: dict[str, Any], key: str = "sync_s") -> float:
    return statistics.median(s[key] for s in step["syncs"][1:])


def summarize(size: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios and seconds per GiB of one size's steps."""
    gib = size["bytes"] / GIB
    out: dict[str, Any] = {"gib": round(gib, 3)}
    floors = size["steps"].get("floors", {})
    memcpy = floors.get("memcpy_median_s")
    raw = floors.get("raw_nixl_best_s")
    if memcpy:
        out["memcpy_s"] = memcpy
        out["memcpy_gib_s"] = gib / memcpy
    if raw:
        out["raw_nixl_s"] = raw
        out["raw_nixl_gib_s"] = gib / raw
    for engine in ("ipc", "sharded_rdt", "reload"):
        step = size["steps"].get(engine, {})
        if "syncs" not in step:
            continue
        sync = _median_measured(step)
        e: dict[str, Any] = {
            "sync_median_s": sync,
            "sync_min_s": min(s["sync_s"] for s in step["syncs"][1:]),
            "s_per_gib": sync / gib,
            "gib_s": gib / sync,
            "trainer_peak_rss_growth_bytes": step["trainer_peak_rss_bytes"]
            - step["trainer_peak_rss_bytes_before_sync"],
            "worker_rss_bytes": max(step["child_rss_bytes"].values(), default=None),
            "oracle_match": step["oracle_match"],
        }
        if memcpy:
            e["over_memcpy"] = sync / memcpy
        if raw:
            e["over_raw_nixl"] = sync / raw
        if engine == "sharded_rdt":
            pull = _median_measured(step, "pull_seconds")
            e["pull_median_s"] = pull
            e["pull_gib_s"] = gib / pull
            if raw:
                e["pull_fraction_of_raw_nixl"] = raw / pull
                e["sync_fraction_of_raw_nixl"] = raw / sync
        if engine == "reload":
            e["save_median_s"] = _median_measured(step, "save_s")
            e["reload_median_s"] = _median_measured(step, "reload_s")
        out[engine] = e
    if "reload" in out:
        for engine in ("ipc", "sharded_rdt"):
            if engine in out:
                out[engine]["reload_over_sync"] = (
                    out["reload"]["sync_median_s"] / out[engine]["sync_median_s"]
                )
    return out


def growth(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Least-squares seconds per GiB (slope) and intercept of each series."""
    series = {
        "memcpy": [(s["gib"], s.get("memcpy_s")) for s in summaries],
        "raw_nixl": [(s["gib"], s.get("raw_nixl_s")) for s in summaries],
    }
    for engine in ("ipc", "sharded_rdt", "reload"):
        series[engine] = [
            (s["gib"], s.get(engine, {}).get("sync_median_s")) for s in summaries
        ]
    out = {}
    for name, points in series.items():
        pts = [(x, y) for x, y in points if y is not None]
        if len(pts) < 2:
            continue
        mx = statistics.fmean(x for x, _ in pts)
        my = statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        out[name] = {"s_per_gib": slope, "intercept_s": my - slope * mx}
    return out


def print_table(summaries: list[dict[str, Any]]) -> None:
    def f(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    head = (
        f"{'GiB':>5} {'memcpy':>7} {'rawNIXL':>7} | {'ipc':>6} {'xcpy':>5} "
        f"| {'rdt':>6} {'xcpy':>5} {'pull/raw':>8} | {'reload':>7} "
        f"{'/ipc':>5} {'/rdt':>5} | oracle"
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        ipc, rdt, rel = (s.get(k, {}) for k in ("ipc", "sharded_rdt", "reload"))
        oracle = "".join(
            "-" if not e else ("ok" if e["oracle_match"] else "FAIL") + " "
            for e in (ipc, rdt, rel)
        )
        print(
            f"{s['gib']:>5.2f} {f(s.get('memcpy_s'), '7.3f')} "
            f"{f(s.get('raw_nixl_s'), '7.3f')} | "
            f"{f(ipc.get('sync_median_s'), '6.2f')} "
            f"{f(ipc.get('over_memcpy'), '5.1f')} | "
            f"{f(rdt.get('sync_median_s'), '6.2f')} "
            f"{f(rdt.get('over_memcpy'), '5.1f')} "
            f"{f(rdt.get('pull_fraction_of_raw_nixl'), '8.0%')} | "
            f"{f(rel.get('sync_median_s'), '7.2f')} "
            f"{f(ipc.get('reload_over_sync'), '5.1f')} "
            f"{f(rdt.get('reload_over_sync'), '5.1f')} | {oracle}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1, 4])
    p.add_argument("--rounds", type=int, default=3, help="measured syncs")
    p.add_argument(
        "--steps", nargs="+", choices=STEPS, default=list(STEPS), help="what to run"
    )
    p.add_argument("--step-timeout-s", type=float, default=1800)
    p.add_argument("--out", type=Path, default=result_path(__file__))
    # Internal: run one step in this process (the orchestrator spawns these).
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--num-layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--step-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        return run_step_here(args.step, args.num_layers, args.rounds, args.step_out)

    commit = git_commit()
    started = utc_now()
    sizes = []
    for target in args.sizes:
        num_layers = layers_for(target)
        nbytes = model_bytes(num_layers)
        print(
            f"== size {target} GiB: {num_layers} layers, "
            f"{nbytes / GIB:.3f} GiB float32",
            flush=True,
        )
        size: dict[str, Any] = {
            "target_gib": target,
            "num_layers": num_layers,
            "bytes": nbytes,
            "steps": {},
        }
        for step in args.steps:
            print(f"-- {step}", flush=True)
            result = run_step_child(step, num_layers, args.rounds, args.step_timeout_s)
            if "error" in result:
                print(f"   {result['error']}", flush=True)
            size["steps"][step] = result
        size["summary"] = summarize(size)
        sizes.append(size)
        write_result(args.out, sizes, args.rounds, commit, started)

    summaries = [s["summary"] for s in sizes]
    result = write_result(args.out, sizes, args.rounds, commit, started)
    print_table(summaries)
    for name, g in result["growth"].items():
        print(f"{name}: {g['s_per_gib']:.3f} s/GiB + {g['intercept_s']:.3f} s")
    print(f"wrote {args.out}")
    ok = all(
        e.get("oracle_match", True)
        for s in summaries
        for e in s.values()
        if isinstance(e, dict)
    )
    return 0 if ok else 1


def write_result(
    path: Path,
    sizes: list[dict[str, Any]],
    rounds: int,
    commit: str | None,
    started: str,
) -> dict[str, Any]:
    """Write the sizes measured so far (the file is rewritten after each size)."""
    summaries = [s["summary"] for s in sizes]
    result = {
        "benchmark": "cpu_sweep",
        "commit": commit,
        "time_utc_start": started,
        "time_utc_end": utc_now(),
        "machine": machine_info(),
        "model": {"base_spec": BASE_SPEC, "dtype": "float32"},
        "vllm": {
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            "kv_cache_gib": 1,
        },
        "rounds": rounds,
        "growth": growth(summaries),
        "sizes": sizes,
    }
    write_json(result, path)
    return result


if __name__ == "__main__":
    sys.exit(main())
