# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer updates an offline ``vllm.LLM`` in its own process over ``ipc``.

The same flow as ``rlhf_ipc_cpu_demo.py`` without a server: the ``LLM`` runs
its workers as child processes, the trainer drives them through
``OfflineLLMWeightSyncClient(llm)`` (``init -> start -> update* -> finish`` as
``LLM`` method calls) and the weights travel through POSIX shared memory.
After every step vLLM's greedy output is compared with what the same engine
serves, bit for bit, when its workers load the trainer's weights fresh from a
checkpoint, and with a Hugging Face forward pass of them (float32, within a
small logprob tolerance); the script exits with status 1 on a mismatch.

With ``--quantization fp8_per_channel`` the engine serves float8 weights
(bfloat16 activations) that it quantizes itself from the trainer's float32
weights at every sync (dense models; see docs/training/weight_transfer/
quantized.md); the check is then the bit-exact fresh load alone. Adding
``--trainer-codes`` makes the trainer quantize instead (``Fp8ChannelCodes``):
it sends float8 codes and per-row scales, half the bytes, which the workers
copy straight into the served codes; the served model is the same, bit for
bit.
With ``--int8-checkpoint`` the engine serves a pre-quantized checkpoint
instead: compressed-tensors W8A8 int8, written from the trainer's starting
weights, which vLLM CPU runs through its int8 oneDNN GEMM. Such an engine
never quantizes, so the trainer sends int8 codes and per-row scales in the
checkpoint's names (``Int8ChannelCodes``); the check is the bit-exact fresh
load of a checkpoint holding the same codes.
With ``--cpu-linear plain`` the engine keeps its linear layers' weights as
tensors (``WeightTransferConfig.cpu_linear``; no oneDNN handle to rebuild at
each sync, at some generation speed), and with ``--landing planned`` it copies
the tensors of such layers straight into the served tensors
(``WeightTransferConfig.landing``). With ``--shared-params`` the trainer's
parameters live in shared memory (``SharedParameters``), so nothing is packed
and, planned, each byte is copied once; ``--segment-mib`` sets the size of
the segments they are placed in (on a GPU, ``SharedParameters.adopt`` shares
CUDA parameters where they are instead). See docs/training/weight_transfer/
one_copy.md. The checks are the same.
Run: ``python examples/rl/rlhf_ipc_offline_cpu.py [--arch qwen3_moe] [--tp 2]
[--steps 3] [--model-dir DIR] [--quantization fp8_per_channel
[--trainer-codes]] [--int8-checkpoint] [--cpu-linear plain]
[--landing planned] [--shared-params [--segment-mib N]]]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.api import (
    CheckpointNamesSource,
    IPCTrainerInitInfo,
)
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.testing import (
    FreshLoadOracle,
    GreedyResult,
    TinyModelSpec,
    assert_bit_identical,
    assert_serves_weights,
    build_tiny_model,
    load_hf_model,
    offline_worker_call,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="HF model folder (default: tiny)")
    p.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--steps", type=int, default=2, help="train-and-sync steps")
    p.add_argument(
        "--quantization",
        choices=["fp8_per_channel"],
        help="an online scheme the engine applies to the weights it receives",
    )
    p.add_argument(
        "--trainer-codes",
        action="store_true",
        help="with --quantization fp8_per_channel: the trainer sends FP8 codes",
    )
    p.add_argument(
        "--int8-checkpoint",
        action="store_true",
        help="serve a pre-quantized W8A8 int8 checkpoint; the trainer sends int8 codes",
    )
    p.add_argument(
        "--cpu-linear",
        choices=["packed", "plain"],
        default="packed",
        help="how vLLM CPU runs linear layers (WeightTransferConfig.cpu_linear)",
    )
    p.add_argument(
        "--landing",
        choices=["reload", "planned"],
        default="reload",
        help="how updates reach the served tensors (WeightTransferConfig.landing)",
    )
    p.add_argument(
        "--shared-params",
        action="store_true",
        help="place the trainer's parameters in shared memory (SharedParameters)",
    )
    p.add_argument(
        "--segment-mib",
        type=int,
        default=None,
        help="with --shared-params: segments of at most this many MiB "
        "(default: SharedParameters' own, 1 GiB)",
    )
    return p.parse_args()


def weight_source(model: torch.nn.Module) -> WeightSource:
    """HF keeps MoE experts fused in memory; vLLM loads checkpoint names."""
    if any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()):
        return CheckpointNamesSource(model)
    return ModuleSource(model)


def fake_training_step(model: torch.nn.Module, step: int) -> None:
    """Stands in for an optimizer step: a seeded in-place change of every weight."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def main() -> int:
    args = parse_args()
    if args.trainer_codes and args.quantization != "fp8_per_channel":
        sys.exit("--trainer-codes needs --quantization fp8_per_channel")
    if args.int8_checkpoint and (args.quantization or args.arch != "qwen3"):
        sys.exit("--int8-checkpoint takes a dense model and no --quantization")
    if args.tp > 1:
        # vLLM's CPU default binds OpenMP threads per NUMA node; pin one core
        # per TP worker instead. Must be set before the LLM starts.
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp))
        )
    if args.model_dir:
        # Your own model may need more KV cache than the tiny models' 64 MiB.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    model_dir = args.model_dir or build_tiny_model(TinyModelSpec(arch=args.arch))
    model = load_hf_model(model_dir, "float32")
    served_dir: str | Path = model_dir
    int8_dir = None
    if args.int8_checkpoint:
        from vllm.distributed.weight_transfer.api import Int8ChannelCodes
        from vllm.distributed.weight_transfer.testing.int8_checkpoint import (
            save_int8_checkpoint,
        )

        def int8_codes() -> WeightSource:
            return Int8ChannelCodes(ModuleSource(model), dtype=torch.bfloat16)

        int8_dir = tempfile.TemporaryDirectory(prefix="int8-w8a8-")
        served_dir = save_int8_checkpoint(model_dir, int8_codes(), int8_dir.name)

    t0 = time.perf_counter()
    # eager, small, seeded; with the fresh-load oracle's worker methods
    # The engine's dtype: bfloat16 under a quantization scheme (the scheme's
    # activations), else float32 like the trainer, so HF can check it too.
    dtype = "bfloat16" if args.quantization or args.int8_checkpoint else "float32"
    llm = tiny_llm(
        served_dir,
        dtype=dtype,
        tensor_parallel_size=args.tp,
        quantization=args.quantization,
        weight_transfer_config=WeightTransferConfig(
            backend="ipc", cpu_linear=args.cpu_linear, landing=args.landing
        ),
    )

    def greedy():
        # Plain float32 linear layers run MKL's GEMM, whose last bit depends
        # on how many rows share a step: generate each prompt alone.
        return vllm_greedy(llm, one_at_a_time=args.cpu_linear == "plain")

    fresh_load = FreshLoadOracle(offline_worker_call(llm), greedy)
    print(f"LLM up in {time.perf_counter() - t0:.1f} s (backend ipc, TP={args.tp})")

    def serves_the_oracle() -> GreedyResult:
        if not args.int8_checkpoint:
            return assert_serves_weights(fresh_load, model, dtype=dtype)
        # The oracle: a fresh load of a checkpoint holding the same codes.
        served = greedy()
        with tempfile.TemporaryDirectory(prefix="int8-oracle-") as tmp:
            checkpoint = save_int8_checkpoint(model_dir, int8_codes(), tmp)
            assert_bit_identical(served, fresh_load.from_checkpoint(checkpoint))
        return served

    checks = "fresh load (bit-exact)" + (
        "" if args.quantization or args.int8_checkpoint else " and HF"
    )
    failures = 0
    try:
        serves_the_oracle()
        print(f"before any update: vLLM == {checks}: True")

        if args.shared_params:
            from vllm.distributed.weight_transfer.api import SharedParameters

            # Kept for as long as the trainer trains; the optimizer's
            # in-place updates write into the segments the workers read.
            # (CUDA parameters: SharedParameters.adopt(model), nothing moved.)
            shared = (
                SharedParameters.place(model)
                if args.segment_mib is None
                else SharedParameters.place(
                    model, max_segment_bytes=args.segment_mib << 20
                )
            )
            print(
                f"trainer parameters in {shared.num_segments} shared-memory "
                f"segment(s): {', '.join(shared.shm_names)}"
            )
        source = weight_source(model)
        if args.trainer_codes:
            from vllm.distributed.weight_transfer.api import Fp8ChannelCodes

            # Linear weights leave the trainer as float8 codes and scales.
            source = Fp8ChannelCodes(source, dtype=torch.bfloat16)
        if args.int8_checkpoint:
            # Linear weights leave the trainer as int8 codes and scales.
            source = int8_codes()
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=True),
            client=OfflineLLMWeightSyncClient(llm),
            source=source,
        )
        for step in range(1, args.steps + 1):
            fake_training_step(model, step)
            t0 = time.perf_counter()
            trainer.send_weights()
            sync_s = time.perf_counter() - t0
            try:
                got = serves_the_oracle()
                ok = True
            except AssertionError as e:
                ok = False
                failures += 1
                got = greedy()
                print(f"  {e}")
            print(
                f"step {step}: send_weights {sync_s * 1e3:.0f} ms; "
                f"vLLM {[list(t) for t in got.tokens]}; "
                f"vLLM == {checks}: {ok}"
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        if int8_dir is not None:
            int8_dir.cleanup()
    print(f"oracle match on every step: {failures == 0}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
