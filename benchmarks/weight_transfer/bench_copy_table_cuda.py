# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one-copy data plane on one GPU: a baked sharded_rdt plan compiled into a
copy table and executed from trainer-shaped tensors into destination tensors.

For each plan (``<model>_tp<N>_rank<R>.json[.gz]``, as written by
``bench_plan_scale.py --plans-dir``):

1. one flat device copy of the plan's byte count (``dst.copy_(src)`` of one
   flat buffer each side), median of ``--reps``: the ceiling;
2. the source tensors, one separate bf16 allocation per checkpoint tensor the
   plan reads (shapes from ``bench_plan_scale.checkpoint_metas``), random, and
   one flat destination tensor per planned parameter, sized from its regions;
3. ``compile_copy_table`` on the CPU, timed;
4. each executor bound once (`CopyProgram`, timed apart) and run ``--warmup``
   times, then ``--reps`` times (wall clock around the launch and a
   ``synchronize``); ``per_copy_replay`` is the ordinary path for comparison:
   one ``region.copy_(replay_slice(source))`` per plan copy;
5. each executor verified once: destinations poisoned (all bits set), one
   execute, then every copy's region (`region_view`) compared bit for bit with
   ``replay_slice`` of its source, and the count of still-poisoned elements
   equal to the destination elements no region covers.

Same process for trainer and worker tensors: mapping the trainer's storages in
another process is a one-off cost per mapping (measured apart, see the
one-copy notes in docs/training/weight_transfer/one_copy.md), not per sync.

Device run (vLLM is not installed there; see tools/fork/device/prepare.sh)::

    PYTHONPATH=.device-carry/site:tools/fork/device/site:. \\
        python3 benchmarks/weight_transfer/bench_copy_table_cuda.py \\
        --plans-dir bench_plans --out $OUT/copy_table_h200.json
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import RESULTS, result_path, write_json  # noqa: E402
from bench_plan_scale import MODELS, checkpoint_metas  # noqa: E402

from vllm.distributed.weight_transfer.landing.regions import (  # noqa: E402
    region_view,
)
from vllm.distributed.weight_transfer.plan.copy_exec import (  # noqa: E402
    CopyProgram,
    empty_dests,
    triton_available,
)
from vllm.distributed.weight_transfer.plan.copy_table import (  # noqa: E402
    compile_copy_table,
)
from vllm.distributed.weight_transfer.plan.ops import (  # noqa: E402
    replay_slice,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (  # noqa: E402
    WorkerPlan,
)

DEFAULT_CASES = (
    "qwen3-8b_tp1_rank0",
    "qwen3-8b_tp2_rank0",
    "qwen3-30b-a3b_tp1_rank0",
    "qwen3-30b-a3b_tp2_rank0",
)


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _time(fn, reps: int, warmup: int) -> dict[str, Any]:
    times = []
    for i in range(warmup + reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "best_s": min(times), "all_s": times}


def _flat_copy(nbytes: int, reps: int, warmup: int) -> dict[str, Any]:
    """One ``copy_`` of ``nbytes`` between two flat buffers, timed."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    src.view(torch.int16).random_()
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), reps, warmup)


def _load_plan(plans_dir: Path, case: str) -> WorkerPlan:
    for name in (f"{case}.json.gz", f"{case}.json"):
        path = plans_dir / name
        if path.exists():
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt") as f:
                return WorkerPlan.from_json(json.load(f))
    raise FileNotFoundError(f"no plan {case}.json[.gz] in {plans_dir}")


class _Model:
    """Just enough of a module tree for `region_view`: qualname -> tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for qualname, tensor in tensors.items():
            module, _, param = qualname.rpartition(".")
            modules.setdefault(module, {})[param] = tensor
        self.modules = {k: SimpleNamespace(**v) for k, v in modules.items()}

    def get_submodule(self, module: str) -> Any:
        return self.modules[module]


def _verify(plan, table, sources_by_name, dests, uncovered: int) -> dict[str, Any]:
    model = _Model({spec.name: t for spec, t in zip(table.dests, dests, strict=True)})
    bad = []
    for i, copy in enumerate(plan.copies):
        got = region_view(model, copy.region)  # type: ignore[arg-type]
        want = replay_slice(sources_by_name[copy.slice.source], copy.slice)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            bad.append(i)
            if len(bad) >= 5:
                break
    poisoned = sum(int((d.view(torch.int16) == -1).sum()) for d in dests)
    return {
        "bit_exact": not bad,
        "first_bad_copies": bad,
        "poison_left": poisoned,
        "poison_expected": uncovered,
        "verified": not bad and poisoned == uncovered,
    }


def _fork_packed_result() -> Path | None:
    """The committed ``bench_ipc_cuda.py`` result of the card this run uses
    (``ipc_cuda/<device>.json``: another run, 24 of Qwen3-30B-A3B's 48
    layers, same per-layer shapes), or None, with a printed line, when there
    is none."""
    path = result_path("bench_ipc_cuda.py") if DEVICE == "cuda" else None
    if path is None or not path.exists():
        print(
            "no committed ipc_cuda result for this device"
            + (f" ({path.relative_to(RESULTS.parent.parent)})" if path else "")
            + ": the cross-run ratio to the fork's packed mode is skipped",
            flush=True,
        )
        return None
    return path


def _fork_packed_reference(model: str, source: Path | None) -> dict[str, Any] | None:
    if source is None:
        return None
    doc = json.loads(source.read_text())
    for res in doc.get("results", []):
        if res.get("model", "").lower() == model.lower() and "fork_packed" in res:
            flat = res["d2d_copy"]["flat_seconds"]
            packed = res["fork_packed"]
            return {
                "source": str(source.relative_to(RESULTS.parent.parent)),
                "device": doc.get("device"),
                "layers": res.get("layers"),
                "bytes": res.get("bytes"),
                "fraction_of_device_copy_best": flat / packed["seconds"],
                "fraction_of_device_copy_median": flat
                / statistics.median(packed["all_seconds"]),
            }
    return None


def run_case(
    plans_dir: Path,
    case: str,
    methods: list[str],
    task_bytes: list[int],
    reps: int,
    warmup: int,
    first_groups: int | None = None,
    fork_packed_source: Path | None = None,
) -> dict[str, Any]:
    model_name = case.split("_")[0]
    res: dict[str, Any] = {"plan": case, "model": model_name}
    t0 = time.perf_counter()
    plan = _load_plan(plans_dir, case)
    res["plan_load_s"] = time.perf_counter() - t0
    if first_groups is not None:  # a smaller slice of the plan, for smoke tests
        plan = WorkerPlan(
            worker=plan.worker,
            groups=tuple(
                g if g.index < first_groups else replace(g, copies=(), completes=())
                for g in plan.groups
            ),
        )
        res["first_groups"] = first_groups
    metas = {m.name: (m.shape, m.dtype) for m in checkpoint_metas(MODELS[model_name])}

    t0 = time.perf_counter()
    table = compile_copy_table(plan, metas)
    res["compile_s"] = time.perf_counter() - t0
    res.update(table.summary())
    res["bytes"] = table.total_bytes
    if table.fallback:
        res["fallback_names"] = [f.describe() for f in table.fallback[:20]]
    nbytes = table.total_bytes
    print(
        f"== {case}: {json.dumps(table.summary())}, compile {res['compile_s']:.2f} s",
        flush=True,
    )

    # The ceiling first, while the memory is free: one flat copy of the bytes.
    flat = _flat_copy(nbytes, reps, warmup)
    res["flat_copy"] = flat
    res["flat_copy_s"] = flat["median_s"]
    res["flat_copy_GBps"] = nbytes / flat["median_s"] / 1e9
    gc.collect()
    _empty_cache()

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    sources = []
    for spec in table.sources:
        t = torch.empty(spec.shape, dtype=torch.bfloat16, device=DEVICE)
        t.normal_(generator=gen)
        sources.append(t)
    by_name = {spec.name: t for spec, t in zip(table.sources, sources, strict=True)}
    dests = empty_dests(table, DEVICE)
    uncovered = sum(d.numel() for d in dests) - nbytes // 2
    _sync()

    variants: list[tuple[str, str, dict[str, Any]]] = []
    for method in methods:
        if method == "triton":
            for tb in task_bytes:
                variants.append((f"triton_{tb // 1024}k", "triton", {"task_bytes": tb}))
        else:
            variants.append((method, method, {}))
    results: dict[str, Any] = {}
    for label, method, kwargs in variants:
        r: dict[str, Any] = {}
        run: Callable[[], None]
        try:
            if method == "per_copy_replay":
                model = _Model(
                    {s.name: t for s, t in zip(table.dests, dests, strict=True)}
                )
                views = [region_view(model, c.region) for c in plan.copies]  # type: ignore[arg-type]
                pairs = list(zip(views, plan.copies, strict=True))

                def run(pairs=pairs, by_name=by_name) -> None:
                    for view, copy in pairs:
                        view.copy_(replay_slice(by_name[copy.slice.source], copy.slice))

                r["bind_s"] = 0.0
            else:
                t0 = time.perf_counter()
                program = CopyProgram(table, sources, dests, method=method, **kwargs)
                _sync()
                r["bind_s"] = time.perf_counter() - t0
                if method == "triton":
                    r["tasks"] = program.tasks
                    r["word_bytes"] = program.word * program.vec
                    r["launches"] = program.launches
                run = program
            first_t0 = time.perf_counter()
            run()
            _sync()
            r["first_call_s"] = time.perf_counter() - first_t0
            r.update(_time(run, reps, warmup))
            r["GBps"] = nbytes / r["median_s"] / 1e9
            r["fraction_of_device_copy"] = flat["median_s"] / r["median_s"]
            for d in dests:
                d.view(torch.int16).fill_(-1)
            run()
            _sync()
            r.update(_verify(plan, table, by_name, dests, uncovered))
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc()[-2000:]
        results[label] = r
        print(
            f"  {label:<18} "
            + (
                f"median {r['median_s'] * 1e3:8.2f} ms  "
                f"best {r['best_s'] * 1e3:8.2f} ms"
                f"  {r['GBps']:7.0f} GB/s  {100 * r['fraction_of_device_copy']:5.1f}% "
                f"of flat copy  bind {r['bind_s']:.3f} s  verified {r['verified']}"
                if "median_s" in r
                else r["error"]
            ),
            flush=True,
        )
    res["methods"] = results
    ok = {k: v for k, v in results.items() if v.get("verified")}
    table_methods = {k: v for k, v in ok.items() if k != "per_copy_replay"}
    if table_methods:
        best = min(table_methods, key=lambda k: table_methods[k]["median_s"])
        res["executor"] = best
        res["execute_s"] = table_methods[best]["median_s"]
        res["fraction_of_device_copy"] = flat["median_s"] / res["execute_s"]
    ref = _fork_packed_reference(
        {"qwen3-8b": "Qwen3-8B", "qwen3-30b-a3b": "Qwen3-30B-A3B"}.get(model_name, ""),
        fork_packed_source,
    )
    if ref and "fraction_of_device_copy" in res:
        ref["note"] = (
            "cross-run reference: the fork's packed ipc sync measured in another "
            f"run on a {ref['device']} (committed result), as a fraction of that "
            "run's flat device copy"
        )
        res["fork_packed_reference"] = ref
        res["over_fork_packed_reference"] = (
            res["fraction_of_device_copy"] / ref["fraction_of_device_copy_best"]
        )
        res["over_fork_packed_reference_median"] = (
            res["fraction_of_device_copy"] / ref["fraction_of_device_copy_median"]
        )
    del sources, dests, by_name
    gc.collect()
    _empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans-dir", default="bench_plans")
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument(
        "--methods",
        default="triton,foreach,loop,per_copy_replay",
        help="comma list of triton, foreach, loop, per_copy_replay",
    )
    ap.add_argument(
        "--task-bytes",
        default="131072,524288,2097152",
        help="triton task sizes to try (bytes, comma list)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(result_path(__file__)))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test only")
    ap.add_argument(
        "--first-groups",
        type=int,
        default=None,
        help="keep only the copies of the plan's first N gather groups",
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    methods = [m for m in args.methods.split(",") if m]
    if DEVICE != "cuda" and "triton" in methods:
        methods.remove("triton")
    if "triton" in methods and not triton_available():
        print("triton does not import here; skipping it", flush=True)
        methods.remove("triton")
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "triton": __import__("triton").__version__ if "triton" in methods else None,
        "reps": args.reps,
        "warmup": args.warmup,
        "timing": "wall clock around the call and torch.cuda.synchronize; median",
        "same_process": True,
        "results": [],
    }
    fork_packed_source = _fork_packed_result()
    for case in args.cases:
        try:
            r = run_case(
                Path(args.plans_dir),
                case,
                methods,
                [int(x) for x in args.task_bytes.split(",")],
                args.reps,
                args.warmup,
                args.first_groups,
                fork_packed_source,
            )
        except Exception as e:
            r = {
                "plan": case,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
            print(r["traceback"], flush=True)
        doc["results"].append(r)
        write_json(doc, args.out)
        gc.collect()
        _empty_cache()
    print(
        f"{'plan':<26} {'bytes':>14} {'runs':>10} {'compile s':>9} "
        f"{'execute ms':>10} {'flat ms':>8} {'fraction':>8} executor"
    )
    for r in doc["results"]:
        if "execute_s" not in r:
            print(f"{r['plan']:<26} {r.get('error', 'no verified executor')}")
            continue
        print(
            f"{r['plan']:<26} {r['bytes']:>14} {r['runs']:>10} {r['compile_s']:>9.2f} "
            f"{r['execute_s'] * 1e3:>10.2f} {r['flat_copy_s'] * 1e3:>8.2f} "
            f"{r['fraction_of_device_copy']:>8.3f} {r['executor']}"
            + (
                f"  x{r['over_fork_packed_reference']:.1f} fork packed (cross-run)"
                if "over_fork_packed_reference" in r
                else ""
            )
        )


if __name__ == "__main__":
    main()
