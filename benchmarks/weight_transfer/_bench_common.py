# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measurements shared by the CPU weight-transfer benchmarks: the generated
model they sync, the machine's copy and NIXL floors, process memory, per-call
timing of a weight-sync client, the run's provenance and the rounding of what
goes into a result JSON. Scripts in this folder import it by its bare name
(the folder is on ``sys.path`` when a script runs)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# The generated Qwen3 the CPU benchmarks sync (``TinyModelSpec`` fields); each
# benchmark picks its depth (``num_layers``). 18 layers: 292 M parameters,
# 1.17 GB in float32.
QWEN3_BENCH_SHAPE: dict[str, Any] = dict(
    arch="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_heads=16,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=32000,
    init_std=0.02,
)


@dataclasses.dataclass
class BenchModel:
    """The generated Qwen3 of a benchmark: its spec, the folder it is written
    to (what vLLM serves) and the trainer's copy loaded from that folder."""

    spec: Any  # TinyModelSpec
    dir: Path
    model: Any  # the Hugging Face model
    dtype: str
    build_s: float  # writing the folder, or finding it already written
    params: int
    nbytes: int

    def describe(self) -> str:
        """``model <folder>: <GB> GB <dtype>``, the line scripts print."""
        return f"model {self.dir.name}: {self.nbytes / 1e9:.2f} GB {self.dtype}"


def bench_model(
    num_layers: int,
    dtype: Literal["float32", "bfloat16"] = "float32",
    touch: bool = False,
) -> BenchModel:
    """Write (once per spec; later calls find the folder) the ``QWEN3_BENCH_SHAPE``
    model with ``num_layers`` decoder layers in ``dtype`` and load the trainer's
    copy in the same dtype. With ``touch`` every weight is redrawn once (seed
    99), as training would touch it, so that a memory baseline taken afterwards
    already holds the whole model and its temporaries."""
    from vllm.distributed.weight_transfer.testing import TinyModelSpec

    spec = TinyModelSpec(**QWEN3_BENCH_SHAPE, num_layers=num_layers, dtype=dtype)
    return bench_model_of(spec, touch=touch)


def bench_model_of(spec: Any, touch: bool = False) -> BenchModel:
    """Write the tiny model ``spec`` (a ``TinyModelSpec``) and load the
    trainer's copy in its dtype; ``touch`` as in `bench_model`."""
    from vllm.distributed.weight_transfer.testing import (
        build_tiny_model,
        load_hf_model,
        randomize_weights_,
    )

    dtype = spec.dtype
    t0 = time.perf_counter()
    model_dir = build_tiny_model(spec)
    build_s = time.perf_counter() - t0
    model = load_hf_model(model_dir, dtype)
    if touch:
        randomize_weights_(model, seed=99, std=0.02)
    params = list(model.parameters())
    return BenchModel(
        spec=spec,
        dir=model_dir,
        model=model,
        dtype=dtype,
        build_s=build_s,
        params=sum(p.numel() for p in params),
        nbytes=sum(p.numel() * p.element_size() for p in params),
    )


def cast_source(inner: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """``inner`` (a ``WeightSource``) with every tensor cast to ``dtype`` as
    it is read, and declared so: a trainer that sends the engine's dtype."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Cast(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, dtype, m.shape) for m in inner.metadata()]

        def __iter__(self) -> Any:
            for name, tensor in inner:
                yield name, tensor.to(dtype)

    return Cast()


def rounded(value: Any, ndigits: int = 4) -> Any:
    """``value`` with every float in it rounded to ``ndigits`` digits, through
    dicts, lists and tuples (a tuple comes back as a list, as JSON writes it);
    ints, bools, strings and None stay as they are."""
    if isinstance(value, float):
        return round(value, ndigits)
    if isinstance(value, dict):
        return {k: rounded(v, ndigits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, ndigits) for v in value]
    return value


def sync_times_s(times: list[float]) -> dict[str, Any]:
    """The first of ``times`` as the warm-up sync and the rest as the measured
    syncs, in seconds rounded for a result JSON."""
    return {"warmup_sync_s": round(times[0], 4), "sync_s": rounded(times[1:])}


def max_rss_bytes() -> int:
    """Peak RSS of this process so far (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memcpy_times_s(nbytes: int, repeats: int = 5) -> list[float]:
    """Seconds of ``repeats`` ``copy_`` calls of ``nbytes`` between two warm,
    preallocated flat tensors: the machine's copy bandwidth right now."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault every page in before timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del src, dst
    return times


def median_memcpy_s(nbytes: int, repeats: int = 5) -> float:
    return statistics.median(memcpy_times_s(nbytes, repeats))


def raw_nixl_read_s(
    nbytes: int, repeats: int = 3, timeout_s: float = 300
) -> list[float]:
    """Seconds of each single NIXL READ of ``nbytes`` from this process by a
    spawned reader process (UCX over loopback, DRAM to DRAM)."""
    from vllm.distributed.weight_transfer.pull.nixl import make_agent, register
    from vllm.distributed.weight_transfer.testing.sharded_rdt_procs import (
        raw_read_main,
    )

    agent = make_agent(f"raw-target-{os.getpid()}")
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    register(agent, source)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=raw_read_main,
        args=(agent.get_agent_metadata(), source.data_ptr(), nbytes, repeats, child),
    )
    proc.start()
    if not parent.poll(timeout_s):
        proc.kill()
        raise TimeoutError(f"raw NIXL reader did not report within {timeout_s} s")
    kind, value = parent.recv()
    proc.join(30)
    if kind != "times":
        raise RuntimeError(f"raw NIXL reader failed:\n{value}")
    return value


def child_rss_bytes() -> dict[str, int]:
    """RSS of each descendant process (vLLM's engine core and workers), by name."""
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out[f"{child.name()}[{child.pid}]"] = child.memory_info().rss
    return out


class TimedClient:
    """Wraps a weight-sync client and adds up the wall time of each method, so a
    sync splits into server-side time (inside the calls) and trainer-side time
    (packing, between the calls)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def split_s(self, total_s: float) -> dict[str, float]:
        """``total_s``, one sync's wall time, split into the seconds inside
        each client call and ``trainer_side``, the rest; rounded."""
        split = {k: round(v, 4) for k, v in self.seconds.items()}
        split["trainer_side"] = round(total_s - sum(self.seconds.values()), 4)
        return split

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # other client methods, untimed

    def _timed(self, method: str, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            getattr(self.inner, method)(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.seconds[method] = self.seconds.get(method, 0.0) + dt

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._timed("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._timed("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._timed("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._timed("finish_weight_update", weight_version)


def device_times(fn: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, the GPU (when there is
    one) idle before and waited for after each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def git_commit() -> str | None:
    """The commit this run imports (``git rev-parse --short HEAD``), with
    ``+dirty`` when tracked files differ from it; None outside a checkout.
    ``VLLM_FORK_COMMIT``, when set, wins: a GPU run imports the HEAD snapshot
    ``tools/fork/device/prepare.sh --snapshot`` made, from a copy whose own
    git metadata names another commit."""
    if os.environ.get("VLLM_FORK_COMMIT"):
        return os.environ["VLLM_FORK_COMMIT"]
    try:
        head = subprocess.check_output(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            text=True,
            stderr=subprocess.DEVNULL,
        ).strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "diff", "--quiet", "HEAD"],
            stderr=subprocess.DEVNULL,
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def device_name() -> str:
    """The card a CUDA run uses, else the CPU machine in words."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU, {os.cpu_count()} cores ({platform.platform()})"


def device_tag() -> str:
    """The device part of a result file's name: the card's model in lower
    case on CUDA (``h200``, ``h100``), else ``cpu-<N>core``."""
    if torch.cuda.is_available():
        words = torch.cuda.get_device_name(0).split()
        models = [w for w in words if any(c.isdigit() for c in w)]
        return (models[0] if models else words[-1]).lower()
    return f"cpu-{os.cpu_count()}core"


def result_path(script: str, variant: str | None = None) -> Path:
    """``benchmarks/results/<bench>/<device>[-<variant>].json``, where
    ``<bench>`` is ``script``'s file name without ``bench_`` and ``.py``."""
    bench = Path(script).stem.removeprefix("bench_")
    name = device_tag() + (f"-{variant}" if variant else "")
    return RESULTS / bench / f"{name}.json"


_PROVENANCE: dict[str, Any] = {}


def provenance() -> dict[str, Any]:
    """What every result file records first: the commit, the device, the
    command line and the UTC date of the run, taken once, when the script
    imports this module, so that a long run names the commit it started at
    (the checkout may move on while it runs)."""
    if not _PROVENANCE:
        _PROVENANCE.update(_provenance_now())
    return dict(_PROVENANCE)


def _provenance_now() -> dict[str, Any]:
    argv = list(sys.argv)
    with contextlib.suppress(ValueError):
        argv[0] = os.path.relpath(argv[0], REPO)
    return {
        "commit": git_commit() or "unknown (not run in a git checkout)",
        "device": device_name(),
        "command": " ".join(shlex.quote(a) for a in ["python", *argv]),
        "date": utc_now(),
    }


def machine_info(*only: str) -> dict[str, Any]:
    """This machine and its load now; only the keys in ``only`` when given
    (some results were first written with fewer fields)."""
    info = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "omp_num_threads": torch.get_num_threads(),
        "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "load_avg_1m": os.getloadavg()[0],
    }
    return {k: v for k, v in info.items() if not only or k in only}


def utc_now() -> str:
    """The time now in UTC, as result files write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_record(
    benchmark: str, commit: str | None, *machine_keys: str
) -> dict[str, Any]:
    """The fields a result JSON opens with: the benchmark's name, the checkout
    it ran (``git_commit()``), when, and ``machine_info(*machine_keys)``."""
    return {
        "benchmark": benchmark,
        "commit": commit,
        "time_utc": utc_now(),
        "machine": machine_info(*machine_keys),
    }


def stamped(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` led by ``provenance()``; fields ``doc`` already holds (a commit
    or device the script recorded itself) keep their values."""
    stamp = provenance()
    return {**stamp, **doc, **{k: v for k, v in stamp.items() if doc.get(k) is None}}


def write_json(doc: dict[str, Any], out: str | os.PathLike[str]) -> None:
    """Write ``stamped(doc)`` to ``out`` as indented JSON, creating its
    folder."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(json.dumps(stamped(doc), indent=2) + "\n")


def emit_json(doc: dict[str, Any], out: str | os.PathLike[str] | None) -> None:
    """Print ``stamped(doc)`` and, when ``out`` is given, write it there."""
    print(json.dumps(stamped(doc), indent=2))
    if out:
        write_json(doc, out)


provenance()
