# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer updates a ``vllm serve`` that keeps streaming completions while
the weights move: staged updates over ``ipc``, on CPU.

What happens:

1. A tiny Qwen3 model folder is generated locally (nothing is downloaded)
   unless ``--model-dir`` names one.
2. ``vllm serve`` starts with ``--weight-transfer-config '{"backend": "ipc",
   "staging": "host"}'``: an update waits in the workers' host memory until
   the trainer commits it, and the server serves the old weights meanwhile.
3. A client thread streams greedy completions back to back for the whole
   run and notes the longest gap between two streamed chunks.
4. This process is the trainer. Each step it changes its weights and calls
   ``send_weights()``, which sends the weights in small chunks, verifies every
   worker's receipt, then holds generation only for the commit
   (``/pause?mode=keep``, finish, KV-cache reset, ``/resume``).
5. After each step the served greedy output is compared, bit for bit, with
   what the same server serves when its workers load the trainer's weights
   fresh from a checkpoint, and with a Hugging Face forward pass of them
   (float32, within a small logprob tolerance).

It prints, per step, how long the sync took, how many streams completed
during it and the longest stall a streaming client saw; the script exits
with status 1 if an oracle ever differs or a stream fails.

Run: ``python examples/rl/rlhf_staged_serve_cpu.py [--steps 3]
[--staging device] [--model-dir DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from vllm.distributed.weight_transfer.api import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.testing import (
    DEFAULT_PROMPTS,
    TinyModelSpec,
    assert_serves_weights,
    build_tiny_model,
    load_hf_model,
)
from vllm.distributed.weight_transfer.testing.server import ServerProcess, serve
from vllm.distributed.weight_transfer.testing.streams import StreamingClients

CHUNK_BYTES = 256 * 1024  # many small messages: the transfer takes a while
STREAM_TOKENS = 24


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="HF model folder (default: tiny)")
    p.add_argument("--steps", type=int, default=2, help="train-and-sync steps")
    p.add_argument("--staging", choices=["host", "device"], default="host")
    return p.parse_args()


class StreamingClient(StreamingClients):
    """Streams greedy completions back to back on a thread; records every
    finished stream's end time and the longest gap between two chunks."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(
            server.base_url,
            server.model,
            [DEFAULT_PROMPTS[0]],
            STREAM_TOKENS,
            join_timeout_s=60,
        )

    @property
    def finished_at(self) -> list[float]:
        return [s.finished_at for s in self.streams if s.finished_at is not None]

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a chunk (the first one counted from the start
        of its response) among chunks that arrived within ``[start, end]``."""
        longest = 0.0
        for stream in self.streams:
            last = stream.started
            for now in stream.arrivals:
                if last is not None and start <= now <= end:
                    longest = max(longest, now - last)
                last = now
        return longest


def main() -> int:
    args = parse_args()
    model_dir = args.model_dir or build_tiny_model(TinyModelSpec(arch="qwen3"))
    model = load_hf_model(model_dir, "float32")
    all_match = True
    with serve(
        model_dir,
        weight_transfer_backend="ipc",
        weight_transfer_options={"staging": args.staging},
    ) as server:
        print(f"vllm serve at {server.base_url} (ipc, staging={args.staging!r})")
        trainer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=CHUNK_BYTES),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=ModuleSource(model),
        )
        total_streams = 0
        for step in range(1, args.steps + 1):
            with torch.no_grad():  # stands in for an optimizer step
                for param in model.parameters():
                    param.mul_(1.0 + 0.05 * step)
            # Streams run through the sync, and stop before the oracle check
            # (its bit-exact comparison wants the oracle's batch alone).
            with StreamingClient(server) as streams:
                while not streams.finished_at and not streams.errors:
                    time.sleep(0.05)
                t0 = time.perf_counter()
                trainer.send_weights(weight_version=f"step-{step}")
                t1 = time.perf_counter()
            during = sum(t0 <= t <= t1 for t in streams.finished_at)
            total_streams += len(streams.finished_at)
            print(
                f"step {step}: send_weights {t1 - t0:.2f} s; {during} stream(s) "
                f"completed during it; longest stall a streaming client saw: "
                f"{streams.longest_gap(t0, t1):.3f} s"
            )
            if streams.errors:
                print(f"  a stream failed: {streams.errors[0]}")
                all_match = False
            try:
                assert_serves_weights(
                    server.fresh_load_oracle(), model, dtype="float32"
                )
                print("  served == fresh load (bit-exact) and == HF: True")
            except AssertionError as e:
                all_match = False
                print(f"  oracle mismatch: {e}")
        trainer.shutdown()
        print(f"{total_streams} streams completed in all")
    print(f"oracle match on every step and no stream failed: {all_match}")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
