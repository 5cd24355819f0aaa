# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: how long short streaming completions wait for a token while one
request generates thousands of tokens, on ``vllm serve`` on CPU, with no
weight update open.

One ``vllm serve`` runs per call (wrap each call in ``flock
/tmp/engine.lock``). A generated tiny Qwen3 with a long context (the testing
helpers' default shape, ``max_position_embeddings`` raised; nothing
downloaded) is served with ``--config``:

* ``fork``: the fork as the tester ran it, ``--weight-transfer-config
  '{"backend": "ipc", "staging": "host"}'``, ``VLLM_SERVER_DEV_MODE=1`` (the
  RL routes and the fork's middlewares: metrics, update guard, adapter id
  guard, non-finite outputs) and every general plugin (the fork's
  ``weight_transfer_cpu_linear`` and ``weight_transfer_rpc_replies``);
* ``no-fork``: the same server arguments without any of that: no
  ``--weight-transfer-config``, no worker extension,
  ``VLLM_SERVER_DEV_MODE=0`` (no RL routes, no middleware) and
  ``VLLM_PLUGINS`` naming upstream's general plugins only.

``--extra-args`` (upstream scheduler settings) and ``--env`` (``KEY=VALUE``,
e.g. thread binding) go on top of either, under ``--label``.

``--streams`` clients stream short greedy completions (``STREAM_TOKENS``)
back to back. After ``IDLE_S`` of them alone, one long request
(``--long-prompt`` prompt tokens, ``--long-tokens`` generated, ``ignore_eos``)
streams until it ends or ``--deadline`` passes. Recorded: the short streams'
longest and median wait between two tokens of one completion while the long
request runs (and while it does not: the idle floor), the long request's own
time to first token and token rate, and, for the five longest short-stream
gaps, what the long request was doing then (prefill, or how many tokens it
had streamed).

Each call appends its run to ``--out`` (default
``benchmarks/results/long_generation_stall_cpu/<device>.json``) and recomputes the
medians per label.

To tell where a stall sits, each run also records: the API server's own
time-to-first-token histogram (``server_side``: taken when the API server
processes the engine's output, so a first token the client waits seconds for
while this stays under 1 s was produced and processed on time); and, sampled
every 0.1 s by a thread of this client, the CPU seconds of each server
process, of the client, of the machine and of every other process, whether
each main thread is runnable, and the sampler's own longest sleep
(``sampler_max_interval_s``: how long a sleeping thread of the client went
unscheduled).

What the committed result shows on the 2-core VM: the stall happens with and
without the fork's routes, middlewares and plugins, in the same place: the
engine and the API server run on (no API-server time to first token over 1 s
in any run without other load), while the client process that generates the
load is runnable and not scheduled for seconds (its sampler thread sleeps up
to 11.8 s), with both cores busy with the worker (pinned to core 0 by
``VLLM_CPU_OMP_THREADS_BIND=auto``) and the engine core (polling the worker's
replies with ``sched_yield`` on the other core). Lowering the server's
autogroup weight (``--autogroup-nice 10``) ends the client's starvation
(longest sampler sleep 0.14 s); none of the upstream vLLM settings tried
(``--stream-interval 16``, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` with and
without ``OMP_NUM_THREADS=1``) removes the stall.

Run: ``flock /tmp/engine.lock python
benchmarks/weight_transfer/bench_long_generation_stall_cpu.py --config fork``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from _bench_common import (
    emit_json,
    git_commit,
    result_path,
    rounded,
    run_record,
)

from vllm.distributed.weight_transfer.testing import TinyModelSpec, build_tiny_model
from vllm.distributed.weight_transfer.testing.server import serve
from vllm.distributed.weight_transfer.testing.streams import (
    Stream,
    StreamingClients,
    stream_completion,
)

STREAM_TOKENS = 32
IDLE_S = 4.0
MAX_MODEL_LEN = 8192
# The general plugins upstream's wheel registers (the fork adds two more).
UPSTREAM_PLUGINS = "lora_filesystem_resolver,lora_hf_hub_resolver"
FORK_OPTIONS = {"staging": "host"}


class DeadlinePassed(Exception):
    """The long request ran past ``--deadline``; its stream is closed."""


def server_settings(config: str) -> dict[str, Any]:
    """``serve()`` keyword arguments of ``--config``; see the docstring."""
    if config == "fork":
        return {
            "weight_transfer_backend": "ipc",
            "weight_transfer_options": FORK_OPTIONS,
            "env": {},
        }
    return {
        "weight_transfer_backend": None,
        "fresh_load_oracle": False,
        "env": {"VLLM_SERVER_DEV_MODE": "0", "VLLM_PLUGINS": UPSTREAM_PLUGINS},
    }


def run_long(
    base_url: str, model: str, args: Any, out: Stream, errors: list[str]
) -> None:
    """Stream the long request into ``out`` until it ends or the deadline."""
    deadline = time.perf_counter() + args.deadline

    def check(stream: Stream) -> None:
        if time.perf_counter() > deadline:
            raise DeadlinePassed

    try:
        stream_completion(
            base_url,
            model,
            out,
            args.long_tokens,
            timeout_s=args.deadline + 60,
            on_chunk=check,
        )
    except DeadlinePassed:
        pass
    except Exception as e:
        errors.append(f"long request: {type(e).__name__}: {e}")


def token_gaps(
    series: list[list[float]], start: float, end: float
) -> list[tuple[float, float]]:
    """Every wait between two consecutive arrivals of one series, as (from,
    to), that overlaps ``[start, end]``."""
    return [
        (a, b) for times in series for a, b in pairwise(times) if a < end and b > start
    ]


class CpuSampler:
    """Samples, every ``PERIOD_S`` on its own thread, the CPU seconds the
    server's processes (by name: API server, engine core, worker), this
    client and the whole machine have used, to tell a stall in one process
    from a machine whose cores are busy with other work."""

    PERIOD_S = 0.1

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {**pids, "client": os.getpid()}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def _cpu_s(self, pid: int) -> tuple[float, bool]:
        """The process's CPU seconds, and whether its main thread is
        runnable (state R: running, or waiting for a core)."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0, False
        return (int(fields[11]) + int(fields[12])) / self._tick, fields[0] == "R"

    def _machine_s(self) -> dict[str, float]:
        """Busy seconds of the machine and of each core, and the machine's
        steal (time the hypervisor ran something else on its cores)."""
        out = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if not name.startswith("cpu"):
                break
            v = [int(x) for x in fields[:8]]
            key = "machine" if name == "cpu" else name
            out[key] = (v[0] + v[1] + v[2] + v[5] + v[6]) / self._tick
            if name == "cpu":
                out["steal"] = v[7] / self._tick
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            used = {}
            for name, pid in self.pids.items():
                used[name], used[f"{name}_runnable"] = self._cpu_s(pid)
            used.update(self._machine_s())
            self.samples.append((time.perf_counter(), used))

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def used_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per process, the machine's, and what other processes
        used (``others``), over the samples nearest ``[start, end]``."""
        inside = [(t, u) for t, u in self.samples if start <= t <= end]
        if len(inside) < 2:
            return {"samples": len(inside), "window_s": end - start}
        (t0, u0), (t1, u1) = inside[0], inside[-1]
        out = {name: u1[name] - u0[name] for name in u0 if "runnable" not in name}
        # The share of samples in which each main thread was runnable.
        for name in self.pids:
            key = f"{name}_runnable"
            out[f"{key}_share"] = sum(u[key] for _, u in inside) / len(inside)
        out["others"] = out["machine"] - sum(out[k] for k in self.pids)
        out["window_s"] = t1 - t0
        # The sampler's own longest sleep of PERIOD_S: how late a sleeping
        # thread of this client was woken and run.
        times = [t for t, _ in self.samples if t >= start and t <= end]
        out["sampler_max_interval_s"] = max(
            (b - a for a, b in pairwise([start, *times, end])), default=0.0
        )
        return rounded(out, 3)


def renice(pids: list[int], nice: int) -> None:
    """Set the nice value of every thread of ``pids`` (Linux keeps one per
    thread)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def placement(pids: dict[str, int]) -> dict[str, Any]:
    """Each process's allowed cores and scheduling policy."""
    return {
        name: {
            "cores": sorted(os.sched_getaffinity(pid)),
            "policy": os.sched_getscheduler(pid),
            "nice": os.getpriority(os.PRIO_PROCESS, pid),
        }
        for name, pid in pids.items()
    }


def server_pids(pid: int, group: list[int]) -> dict[str, int]:
    """The server's processes by role, from their command names."""
    out = {"api_server": pid}
    for p in group:
        comm = Path(f"/proc/{p}/comm").read_text().strip().lower()
        if "engine" in comm:
            out["engine_core"] = p
        elif "worker" in comm:
            out["worker"] = p
    return out


def server_side_latencies(base_url: str) -> dict[str, float]:
    """How many waits between two tokens, and first tokens, the API server's
    own output processing saw above 1 s and 5 s (vLLM's
    ``inter_token_latency`` and ``time_to_first_token`` histograms): a stall
    the clients see but these do not happens after the API server processed
    the engine's output (its HTTP writes, or the client)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    samples = [
        sample
        for family in text_string_to_metric_families(
            requests.get(f"{base_url}/metrics", timeout=30).text
        )
        for sample in family.samples
    ]

    def total(name: str, le: str | None = None) -> float:
        return sum(
            s.value
            for s in samples
            if s.name == name and (le is None or s.labels.get("le") == le)
        )

    out = {}
    for short, name in (
        ("itl", "vllm:inter_token_latency_seconds"),
        ("ttft", "vllm:time_to_first_token_seconds"),
    ):
        count = total(f"{name}_count")
        out[f"{short}_count"] = count
        for le in ("1.0", "5.0"):
            out[f"{short}_over_{le[0]}s"] = count - total(f"{name}_bucket", le)
    return out


def long_state(long: Stream, sent: float, at: float) -> dict[str, Any]:
    """What the long request was doing at ``at``: not sent yet, sent with no
    token yet (prefill), or streaming, with how many tokens it had streamed."""
    streamed = sum(t <= at for t in long.arrivals)
    phase = "not_sent" if at < sent else "prefill" if streamed == 0 else "decode"
    return {
        "long_phase": phase,
        "long_tokens_streamed": streamed,
    }


def measure(args: Any, model_dir: Path) -> dict[str, Any]:
    settings = server_settings(args.config)
    env = dict(settings.pop("env"))
    env.update(kv.split("=", 1) for kv in args.env)
    log_path = Path(args.log_dir) / f"{args.label}-{int(time.time())}.log"
    prompt = [(7 * i) % 1000 + 3 for i in range(args.long_prompt)]
    with serve(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        extra_args=args.extra_args,
        env=env,
        log_path=log_path,
        **settings,
    ) as server:
        prompts = [[1, 17, 93, 255, 41 + i] for i in range(args.streams)]
        pids = server_pids(server.pid, server.group_pids())
        if args.renice_engine:
            renice([pids["engine_core"], pids["worker"]], args.renice_engine)
        if args.autogroup_nice:
            # The server runs in its own session, so in its own scheduler
            # autogroup: this weighs the whole server against other sessions.
            Path(f"/proc/{server.pid}/autogroup").write_text(str(args.autogroup_nice))
        where = placement(pids)
        with (
            CpuSampler(pids) as cpu,
            StreamingClients(
                server.base_url, server.model, prompts, STREAM_TOKENS, timeout_s=300
            ) as load,
        ):
            while min(len(a) for a in load.arrivals) < 2 and not load.errors:
                time.sleep(0.1)
            idle_from = time.perf_counter()
            time.sleep(IDLE_S)
            long = Stream(client=-1, prompt=prompt)
            errors: list[str] = []
            sent = time.perf_counter()
            run_long(server.base_url, server.model, args, long, errors)
            ended = time.perf_counter()
            errors += load.errors
        server_side = server_side_latencies(server.base_url)
        shorts = [list(s.arrivals) for s in load.streams if s.arrivals]
        clients = [list(a) for a in load.arrivals]
    if errors:
        raise RuntimeError(errors[0])
    idle = [
        b - a
        for a, b in token_gaps(shorts, idle_from, sent)
        if a >= idle_from and b <= sent
    ]
    lengths = [b - a for a, b in token_gaps(shorts, sent, ended)]
    # A client's waits across completions too: a completion that starts
    # while the long one runs waits for its first token.
    during = sorted(token_gaps(clients, sent, ended), key=lambda g: g[0] - g[1])
    idle_client = [
        b - a
        for a, b in token_gaps(clients, idle_from, sent)
        if a >= idle_from and b <= sent
    ]
    first = long.arrivals[0] if long.arrivals else ended
    decode_s = ended - first
    return {
        "label": args.label,
        "config": args.config,
        "extra_args": args.extra_args,
        "env": args.env,
        "renice_engine": args.renice_engine,
        "autogroup_nice": args.autogroup_nice,
        "long_prompt_tokens": args.long_prompt,
        "long_max_tokens": args.long_tokens,
        "long_tokens_streamed": len(long.arrivals),
        "long_finished": long.finished_at is not None,
        **rounded(
            {
                "long_s": ended - sent,
                "long_ttft_s": first - sent,
                "long_tokens_per_s": (len(long.arrivals) - 1) / decode_s
                if decode_s > 0
                else 0.0,
                "max_token_gap_s": max(lengths, default=0.0),
                "median_token_gap_s": statistics.median(lengths) if lengths else 0.0,
                "max_token_gap_idle_s": max(idle, default=0.0),
                "max_stream_gap_s": during[0][1] - during[0][0] if during else 0.0,
                "max_stream_gap_idle_s": max(idle_client, default=0.0),
                "median_token_gap_idle_s": statistics.median(idle) if idle else 0.0,
                "short_tokens_per_s": sum(
                    sent <= t <= ended for times in clients for t in times
                )
                / (ended - sent),
            }
        ),
        "longest_gaps": [
            {
                "s": round(b - a, 4),
                "from_long_sent_s": round(a - sent, 3),
                **long_state(long, sent, a),
                "cpu_s_in_gap": cpu.used_between(a, b),
            }
            for a, b in during[:5]
        ],
        "cpu_s_while_long_runs": cpu.used_between(sent, ended),
        "server_side": server_side,
        "server_pids": pids,
        "placement": where,
        "log": str(log_path),
    }


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Per label: how many runs, and the medians of their gaps."""
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]

        def median(key: str, mine: list[dict] = mine) -> float:
            return round(statistics.median(r[key] for r in mine), 4)

        out[label] = {
            "runs": len(mine),
            "max_token_gap_s": [r["max_token_gap_s"] for r in mine],
            "max_token_gap_median_s": median("max_token_gap_s"),
            "median_token_gap_median_s": median("median_token_gap_s"),
            "max_token_gap_idle_median_s": median("max_token_gap_idle_s"),
            "max_stream_gap_s": [r["max_stream_gap_s"] for r in mine],
            "max_stream_gap_median_s": median("max_stream_gap_s"),
            "long_ttft_median_s": median("long_ttft_s"),
            "long_tokens_per_s_median": median("long_tokens_per_s"),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=["fork", "no-fork"], default="fork")
    p.add_argument("--label", default=None, help="default: --config")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--long-prompt", type=int, default=8)
    p.add_argument("--deadline", type=float, default=75.0)
    p.add_argument(
        "--extra-args", default="", help="more vllm serve arguments, one string"
    )
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE")
    p.add_argument(
        "--renice-engine",
        type=int,
        default=0,
        help="the nice value of the engine core and worker processes (a test "
        "of CPU starvation, not a vLLM setting)",
    )
    p.add_argument("--log-dir", default="/tmp/long_generation_stall_logs")
    p.add_argument("--out", default=str(result_path(__file__)))
    p.add_argument(
        "--autogroup-nice",
        type=int,
        default=0,
        help="the nice value of the server's scheduler autogroup (its session, "
        "when the kernel groups tasks by session)",
    )
    args = p.parse_args()
    args.label = args.label or args.config
    args.extra_args = args.extra_args.split()
    spec = TinyModelSpec(max_position_embeddings=MAX_MODEL_LEN)
    model_dir = build_tiny_model(spec)
    run = measure(args, model_dir)
    print(json.dumps(run, indent=2))
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if out.exists() else []
    runs.append(run)
    emit_json(
        {
            **run_record("long_generation_stall_cpu", git_commit()),
            "model": model_dir.name,
            "max_model_len": MAX_MODEL_LEN,
            "stream_tokens": STREAM_TOKENS,
            "summary": summarize(runs),
            "runs": runs,
        },
        out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
