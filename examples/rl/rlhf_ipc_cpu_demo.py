# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer updates a served model over the ``ipc`` backend, on CPU.

What happens:

1. A tiny Qwen3 (or Qwen3-MoE) model folder is generated locally (nothing is
   downloaded) unless ``--model-dir`` names one.
2. ``vllm serve`` starts on 127.0.0.1 with ``--weight-transfer-config
   '{"backend": "ipc"}'`` and ``VLLM_SERVER_DEV_MODE=1`` (for the RL routes).
   No ``VLLM_ALLOW_INSECURE_SERIALIZATION``: the control plane is plain JSON.
3. This process is the trainer. It holds the same model in Hugging Face form
   and, each step, trains it to continue the first prompt with a fixed target
   sentence, then calls ``send_weights()``: the weights travel through POSIX
   shared memory (``/dev/shm``), the HTTP routes carry only their description.
   ``send_weights`` verifies every worker's receipt, then commits with
   generation held for just the commit, and drops the KV blocks the old
   weights computed (``POST /reset_prefix_cache``) before it returns.
4. After every step the served greedy completion is compared with two
   oracles: what the same server serves, bit for bit, when its workers load
   the trainer's weights fresh from a checkpoint (``testing.fresh_load``), and
   a Hugging Face forward pass of the trainer's weights (float32, within a
   small logprob tolerance). The script exits with status 1 if either ever
   differs.

Run: ``python examples/rl/rlhf_ipc_cpu_demo.py`` (or ``make demo``).
Options: ``--arch qwen3_moe``, ``--tp 2``, ``--steps 3``, ``--model-dir DIR``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from vllm.distributed.weight_transfer.api import (
    CheckpointNamesSource,
    IPCTrainerInitInfo,
)
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.testing import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPTS,
    GreedyResult,
    TinyModelSpec,
    build_tiny_model,
    completions_greedy,
    hf_greedy,
    load_hf_model,
    logprob_atol,
)
from vllm.distributed.weight_transfer.testing.server import serve

TARGET_TEXT = " the quick brown fox jumps over the lazy dog."
ITERS_PER_STEP = 2
LEARNING_RATE = 1e-3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="HF model folder (default: tiny)")
    p.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--steps", type=int, default=2, help="train-and-sync steps")
    return p.parse_args()


def weight_source(model: torch.nn.Module) -> WeightSource:
    """HF keeps MoE experts fused in memory; vLLM loads checkpoint names."""
    if any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()):
        return CheckpointNamesSource(model)
    return ModuleSource(model)


def train_step(model, optimizer, prompt: list[int], target: list[int]) -> float:
    """A few optimizer steps teaching ``prompt -> target``; returns the last loss."""
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # learn only the continuation
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(ITERS_PER_STEP):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def show(label: str, result: GreedyResult, tokenizer) -> None:
    for i, tokens in enumerate(result.tokens):
        text = tokenizer.decode(list(tokens))
        print(f"  {label} prompt {i}: {list(tokens)} {text!r}")


def matches(served: GreedyResult, oracle: GreedyResult, atol: float) -> bool:
    if served.tokens != oracle.tokens:
        return False
    return all(
        abs(a - b) <= atol
        for got, want in zip(served.logprobs, oracle.logprobs, strict=True)
        for a, b in zip(got, want, strict=True)
    )


def check(
    served: GreedyResult, fresh: GreedyResult, hf: GreedyResult, atol: float
) -> bool:
    """Print and return whether ``served`` equals both oracles."""
    exact = served == fresh
    close = matches(served, hf, atol)
    print(f"  served == fresh vLLM load of the trainer's weights (bit-exact): {exact}")
    print(f"  served == HF forward of the trainer's weights (atol {atol}): {close}")
    return exact and close


def main() -> int:
    args = parse_args()
    t_start = time.perf_counter()
    model_dir = args.model_dir or build_tiny_model(TinyModelSpec(arch=args.arch))
    model = load_hf_model(model_dir, "float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"model {model_dir.name}: {params_m:.2f} M parameters, "
        f"{nbytes / 2**20:.1f} MiB float32; vLLM TP={args.tp}"
    )

    prompt = list(DEFAULT_PROMPTS[0])
    target = tokenizer.encode(TARGET_TEXT)[:DEFAULT_MAX_TOKENS]
    print(f"training target for prompt 0: {target} {tokenizer.decode(target)!r}")
    atol = logprob_atol("float32")
    all_match = True

    t_serve = time.perf_counter()
    with serve(
        model_dir, weight_transfer_backend="ipc", tensor_parallel_size=args.tp
    ) as server:
        print(
            f"vllm serve healthy at {server.base_url} after "
            f"{time.perf_counter() - t_serve:.1f} s (backend ipc)"
        )

        fresh_load = server.fresh_load_oracle()
        served = server.greedy()
        ok = check(served, fresh_load.expected(model), hf_greedy(model), atol)
        all_match &= ok
        print("before any update:")
        show("served", served, tokenizer)

        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=True),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=weight_source(model),
        )
        assert isinstance(trainer, IPCTrainerWeightTransferEngine)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        for step in range(1, args.steps + 1):
            loss = train_step(model, optimizer, prompt, target)
            t0 = time.perf_counter()
            trainer.send_weights(weight_version=f"step-{step}")
            sync_s = time.perf_counter() - t0
            plan = trainer.last_plan
            chunks = len(plan.chunks) if plan is not None else "?"
            served = completions_greedy(server.base_url, server.model)
            print(
                f"step {step}: loss {loss:.3f}; send_weights {sync_s * 1e3:.0f} ms "
                f"({nbytes / 2**20:.1f} MiB in {chunks} chunk(s))"
            )
            show("served", served, tokenizer)
            ok = check(served, fresh_load.expected(model), hf_greedy(model), atol)
            all_match &= ok

    print(
        f"oracle match on every step: {all_match} "
        f"(total {time.perf_counter() - t_start:.1f} s)"
    )
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
