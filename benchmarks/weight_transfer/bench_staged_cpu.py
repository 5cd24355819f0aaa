# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark: generation under a steady load while the weights are updated,
staged against stop-the-world, through ``vllm serve`` over ``ipc`` on CPU.

A generated Qwen3 (18 layers of the CPU benchmarks' shape by default, 1.17 GB
of float32 weights; nothing downloaded) is served twice, one server after the
other: with ``staging="host"`` and with the default ``staging="off"``. On each,
``--streams`` clients stream greedy completions back to back for the whole
run, and every streamed chunk's arrival time is recorded. The trainer, this
process, pushes new weights ``--rounds`` times (after one warm-up sync).

* staged: the trainer's ``send_weights()`` runs while the streams go on;
  generation is held only for the commit.
* stop-the-world (``staging="off"``): generation must not run while weights
  land, so the trainer pauses it (``/pause?mode=keep``) for the whole
  ``send_weights()`` and resumes it after: today's way.

Per mode and round: ``sync_s`` (the whole ``send_weights()``), ``held_s``
(staged: pause to resume around the commit; stop-the-world: the whole sync),
``max_token_gap_s`` (the longest time a running completion waited between
two of its tokens, over every such wait that overlapped the sync, counted
whole: the recomputation after a commit, which outlasts ``send_weights()``,
is in it), ``max_gap_s`` (the same between two chunks of one client, across
the end of one completion and the first token of the next as well), and
tokens per second during the sync and while idle. The idle readings come
from a window right before each sync (as long as the previous sync; the
streams settle for 2 s on either side). The JSON in
``benchmarks/results/staged_cpu/<device>.json`` carries the issue's two ratios for the
staged mode, as medians over the rounds:

* ``max_generation_gap_over_sync``: the longest wait for a token during a
  staged sync over the stop-the-world sync's duration (target: at most
  0.10); ``max_stream_gap_over_sync`` is the same with ``max_gap_s``;
* ``throughput_during_sync_over_idle``: tokens per second during a staged sync
  over tokens per second while idle (target: at least 0.50);

and ``commit_over_sync`` (how much of a staged sync generation is held) and
the workers' resident memory after the syncs in each mode. Two readings put
the gap in context: ``max_token_gap_idle_s``, the same streams' longest wait
for a token while no sync runs (a decode step, or a decode step beside
another completion's prefill, is the floor of any gap), with
``excess_gap_over_sync`` (the staged gap less that floor, over the
stop-the-world sync); and ``max_generation_gap_over_staged_sync``, the gap
over the staged sync's own duration.

With ``--settings one-copy`` both modes run with ``cpu_linear="plain"`` and
``landing="planned"``: the staged commit copies each staged byte once into the
served tensors instead of running vLLM's layerwise reload. The ratios are then
over the stop-the-world sync with the same settings; a third server, with the
defaults, gives ``max_generation_gap_over_default_sync`` (results in
``benchmarks/results/staged_cpu/<device>-one-copy.json``).

Run: ``python benchmarks/weight_transfer/bench_staged_cpu.py [--rounds 3]
[--settings one-copy]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from itertools import pairwise
from typing import Any

from _bench_common import (
    bench_model,
    child_rss_bytes,
    emit_json,
    git_commit,
    result_path,
    rounded,
    run_record,
)

from vllm.distributed.weight_transfer.testing.streams import StreamingClients

CHUNK_BYTES = 64 * 2**20
STREAM_TOKENS = 48
# The idle window before the first sync (later ones last as long as the last
# sync), and the pause before and after each window.
IDLE_S = 3.0
SETTLE_S = 2.0


class Load(StreamingClients):
    """Clients streaming greedy completions back to back; records the arrival
    time of every streamed chunk, per stream."""

    def __init__(self, base_url: str, model: str, streams: int) -> None:
        super().__init__(
            base_url,
            model,
            [[1, 17, 93, 255, 41 + i] for i in range(streams)],
            STREAM_TOKENS,
            timeout_s=300,
        )

    def tokens_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for times in self.arrivals for t in times)

    def longest_gap(
        self, start: float, end: float, *, per_request: bool, during: bool = True
    ) -> tuple[float, float]:
        """The longest time between two consecutive chunks, as (from, to).

        ``per_request``: between two tokens of one completion (how long a
        running request waited for its next token); otherwise between two
        chunks of one client, across the end of one completion and the first
        token of the next as well. ``during``: every such gap that overlaps
        ``[start, end]`` counts whole (a stall that began before a sync or
        outlasted it, such as the recomputation after a commit, is not cut);
        otherwise only gaps inside the window count (the idle floor)."""
        series = (
            [list(s.arrivals) for s in list(self.streams)]
            if per_request
            else [list(a) for a in self.arrivals]
        )
        longest = (start, start)
        for times in series:
            for a, b in pairwise(times):
                inside = (a < end and b > start) if during else start <= a <= b <= end
                if inside and b - a > longest[1] - longest[0]:
                    longest = (a, b)
        return longest

    def max_gap(
        self, start: float, end: float, *, per_request: bool, during: bool = True
    ) -> float:
        gap_from, gap_to = self.longest_gap(
            start, end, per_request=per_request, during=during
        )
        return gap_to - gap_from


class HeldClock:
    """A sync client that adds up the time generation is held: between
    ``pause_generation`` and ``resume_generation``, and for a
    ``finish_weight_update`` outside such a pause (the fork's server holds
    generation around the commit itself, within that one request)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.held_s = 0.0
        self._since: float | None = None
        # Every sync call as (what, started, ended): to tell which call a
        # generation gap fell in.
        self.calls: list[tuple[str, float, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, what: str, call: Any, *args: Any) -> None:
        start = time.perf_counter()
        try:
            call(*args)
        finally:
            self.calls.append((what, start, time.perf_counter()))

    def start_weight_update(self) -> None:
        self._timed("start", self.inner.start_weight_update)

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]]
    ) -> None:
        first = update_info[0] if isinstance(update_info, list) else update_info
        names = first.get("names") or []
        if names:
            what = f"{len(names)} tensors: {names[0]} .. {names[-1]}"
        else:
            what = ", ".join(sorted(k for k in first if k != "publication"))
        self._timed(what, self.inner.update_weights, update_info)

    def pause_generation(self, mode: str = "keep") -> None:
        self._since = time.perf_counter()
        self.inner.pause_generation(mode)

    def finish_weight_update(self, *args: Any) -> None:
        start = time.perf_counter()
        try:
            self._timed("finish", self.inner.finish_weight_update, *args)
        finally:
            if self._since is None:
                self.held_s += time.perf_counter() - start

    def calls_during(self, start: float, end: float) -> list[dict]:
        """The calls that overlap ``[start, end]``, with their seconds."""
        return [
            {
                "call": what,
                "s": round(b - a, 4),
                "from_gap_start_s": round(a - start, 4),
            }
            for what, a, b in self.calls
            if a < end and b > start
        ]

    def resume_generation(self) -> None:
        self.inner.resume_generation()
        assert self._since is not None
        self.held_s += time.perf_counter() - self._since
        self._since = None


# ``--settings one-copy``: plain CPU linear layers and the planned landing, so
# a commit copies each staged byte once into the served tensors.
ONE_COPY = {"cpu_linear": "plain", "landing": "planned"}


def run_mode(
    staging: str,
    model_dir: Any,
    model: Any,
    args: Any,
    options: dict[str, str] | None = None,
) -> dict:
    from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.testing import (
        assert_serves_weights,
        randomize_weights_,
    )
    from vllm.distributed.weight_transfer.testing.server import serve

    rounds = []
    with serve(
        model_dir,
        weight_transfer_backend="ipc",
        weight_transfer_options={"staging": staging, **(options or {})},
        startup_timeout_s=600,
    ) as server:
        client = HeldClock(HTTPVLLMWeightSyncClient(server.base_url, timeout=600))
        trainer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=CHUNK_BYTES),
            client=client,
            source=ModuleSource(model),
        )
        with Load(server.base_url, server.model, args.streams) as load:
            while min(len(a) for a in load.arrivals) < 2 and not load.errors:
                time.sleep(0.1)
            idle_s = IDLE_S
            for round_ in range(args.rounds + 1):
                randomize_weights_(model, seed=100 + round_, std=0.02)
                client.held_s = 0.0
                client.calls = []
                # Idle first: the same streams with no sync, after the last
                # sync's after-effects (the recomputation a commit causes)
                # had time to pass.
                time.sleep(SETTLE_S)
                i0 = time.perf_counter()
                time.sleep(idle_s)
                t0 = time.perf_counter()
                if staging == "off":  # stop the world for the whole update
                    client.pause_generation("keep")
                trainer.send_weights(weight_version=f"round-{round_}")
                if staging == "off":
                    client.resume_generation()
                t1 = time.perf_counter()
                sync_s = t1 - t0
                # Every gap the sync opened has closed by then.
                time.sleep(SETTLE_S)
                gaps = {
                    "sync_s": sync_s,
                    "held_s": client.held_s,
                    # The longest wait of a running request for its next
                    # token, and of a client for its next chunk (across
                    # completions too), in any gap that overlapped the sync.
                    "max_token_gap_s": load.max_gap(t0, t1, per_request=True),
                    "max_gap_s": load.max_gap(t0, t1, per_request=False),
                    # The same streams' longest gaps with no sync: the floor
                    # any gap during a sync stands on (a decode step, a new
                    # completion's prefill, the API server's own delays).
                    "max_token_gap_idle_s": load.max_gap(
                        i0, t0, per_request=True, during=False
                    ),
                    "max_gap_idle_s": load.max_gap(
                        i0, t0, per_request=False, during=False
                    ),
                }
                tokens = {
                    "tokens_per_s_during_sync": load.tokens_between(t0, t1) / sync_s,
                    "tokens_per_s_idle": load.tokens_between(i0, t0) / idle_s,
                }
                idle_s = max(sync_s, IDLE_S)
                row = {**rounded(gaps), **rounded(tokens, 2)}
                # Where the longest gap fell: the sync calls it overlapped,
                # and the three longest calls of the sync.
                gap_from, gap_to = load.longest_gap(t0, t1, per_request=True)
                row["calls_in_longest_gap"] = client.calls_during(gap_from, gap_to)
                row["longest_calls"] = [
                    {"call": what, "s": round(b - a, 4)}
                    for what, a, b in sorted(client.calls, key=lambda c: c[1] - c[2])[
                        :3
                    ]
                ]
                label = " (warm-up)" if round_ == 0 else ""
                print(
                    f"[staging={staging} {options or ''}] round {round_}{label}: {row}"
                )
                if round_:
                    rounds.append(row)
            errors = list(load.errors)
        rss = child_rss_bytes()
        assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
        trainer.shutdown()
    if errors:
        raise RuntimeError(f"a stream failed: {errors[0]}")

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 4)

    return {
        "staging": staging,
        "options": options or {},
        "rounds": rounds,
        "sync_median_s": median("sync_s"),
        "held_median_s": median("held_s"),
        "max_token_gap_median_s": median("max_token_gap_s"),
        "max_token_gap_idle_median_s": median("max_token_gap_idle_s"),
        "max_gap_median_s": median("max_gap_s"),
        "max_gap_idle_median_s": median("max_gap_idle_s"),
        "tokens_per_s_during_sync_median": median("tokens_per_s_during_sync"),
        "tokens_per_s_idle_median": median("tokens_per_s_idle"),
        "worker_rss_bytes_after": rss,
        "oracle_match": True,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=18)
    p.add_argument(
        "--settings",
        choices=["defaults", "one-copy"],
        default="defaults",
        help="one-copy: both modes with cpu_linear='plain' and landing='planned' "
        "(the staged commit copies each byte once into the served tensors), "
        "plus a stop-the-world sync with the defaults for reference",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    one_copy = args.settings == "one-copy"
    if args.out is None:
        args.out = str(result_path(__file__, "one-copy" if one_copy else None))
    commit = git_commit()
    bench = bench_model(args.num_layers)
    model_dir, model = bench.dir, bench.model
    print(bench.describe())

    options = ONE_COPY if one_copy else None
    staged = run_mode("host", model_dir, model, args, options)
    stopped = run_mode("off", model_dir, model, args, options)
    defaults = run_mode("off", model_dir, model, args) if one_copy else None
    token_gap = staged["max_token_gap_median_s"]
    gap_over_sync = token_gap / stopped["sync_median_s"]
    stream_gap_over_sync = staged["max_gap_median_s"] / stopped["sync_median_s"]
    during_over_idle = (
        staged["tokens_per_s_during_sync_median"] / staged["tokens_per_s_idle_median"]
    )
    commit_over_sync = staged["held_median_s"] / staged["sync_median_s"]
    # What the staged sync adds to the longest wait for a token that the
    # streams see anyway.
    excess_gap_over_sync = (
        token_gap - staged["max_token_gap_idle_median_s"]
    ) / stopped["sync_median_s"]
    print(
        f"staged: longest wait for a token {token_gap:.3f} s over a "
        f"stop-the-world sync of {stopped['sync_median_s']:.3f} s = "
        f"{gap_over_sync:.3f} (target <= 0.10); across completions "
        f"{staged['max_gap_median_s']:.3f} s = {stream_gap_over_sync:.3f}; "
        f"throughput during the sync over idle {during_over_idle:.3f} (target >= "
        f"0.50); commit {staged['held_median_s']:.3f} s of a "
        f"{staged['sync_median_s']:.3f} s sync"
    )
    print(
        f"idle streams' longest wait for a token "
        f"{staged['max_token_gap_idle_median_s']:.3f} s; the staged sync adds "
        f"{excess_gap_over_sync:.3f} of the stop-the-world sync"
    )
    if defaults is not None:
        print(
            f"over the stop-the-world sync with the defaults "
            f"({defaults['sync_median_s']:.3f} s): "
            f"{token_gap / defaults['sync_median_s']:.3f}"
        )
    emit_json(
        {
            **run_record("staged_vs_stop_the_world_cpu", commit),
            "model": {
                "dir": model_dir.name,
                "spec": dataclasses.asdict(bench.spec),
                "bytes": bench.nbytes,
            },
            "streams": args.streams,
            "stream_tokens": STREAM_TOKENS,
            "chunk_bytes": CHUNK_BYTES,
            "settings": args.settings,
            "staged": staged,
            "stop_the_world": stopped,
            **(
                {
                    "stop_the_world_defaults": defaults,
                    "max_generation_gap_over_default_sync": round(
                        token_gap / defaults["sync_median_s"], 4
                    ),
                    "max_stream_gap_over_default_sync": round(
                        staged["max_gap_median_s"] / defaults["sync_median_s"], 4
                    ),
                }
                if defaults is not None
                else {}
            ),
            "max_generation_gap_over_sync": round(gap_over_sync, 4),
            "max_stream_gap_over_sync": round(stream_gap_over_sync, 4),
            "throughput_during_sync_over_idle": round(during_over_idle, 4),
            "commit_over_sync": round(commit_over_sync, 4),
            "max_generation_gap_over_staged_sync": round(
                token_gap / staged["sync_median_s"], 4
            ),
            "excess_gap_over_sync": round(excess_gap_over_sync, 4),
            "targets": {
                "max_generation_gap_over_sync": 0.10,
                "throughput_during_sync_over_idle": 0.50,
            },
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
