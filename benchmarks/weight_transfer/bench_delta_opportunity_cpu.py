# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many bytes of a bf16 sync an optimizer step leaves unchanged: the
opportunity for sending changed bytes only (issue 43, item 1).

For each model and learning rate, the script runs real AdamW steps on a
causal-LM loss and, after every step, compares the bf16 weights a trainer
would publish with the ones it published after the previous step, element by
element (bit patterns, so -0.0 vs 0.0 and NaN payloads count as changes).
Two ways a trainer holds its weights:

* ``bf16``: the parameters themselves are bf16 and AdamW updates them in
  place; an update smaller than half a bf16 step at that value is lost;
* ``fp32_master``: the parameters are fp32 (master weights), AdamW runs in
  fp32, and the published weights are their bf16 cast; small updates
  accumulate until they cross a bf16 step.

Reported per step and per tensor kind (attention, mlp, experts, router, norms,
embeddings): the fraction of elements that changed, and the bytes a per-tensor
delta would take, each tensor sent as whichever of three encodings is
smallest: whole (2 bytes an element), positions and values (4 + 2 bytes a
changed element) or a bitmap and values (1 bit an element + 2 bytes a changed
element). A summary gives the mean and the largest fraction over steps 2 to N
(step 1 is Adam's sign step: every element moves by exactly the learning
rate), and the means and the last step's fraction in percent, as docs quote
them.

What this is not: the loss is next-token prediction on seeded random tokens,
not an RL objective, and the weights are the generated models' random draws
at the scale of trained ones (std 0.02 for matrices, 1 + small noise for
norms), not trained checkpoints. Both set how far a step moves each element
relative to a bf16 step, which is what decides the fraction; the ratios are
a measurement of this setup, to be checked against a real RL run.

Run (a few minutes for the tiny models; the 1 GiB model takes tens of
minutes on two cores)::

    .venv/bin/python benchmarks/weight_transfer/bench_delta_opportunity_cpu.py
    .venv/bin/python benchmarks/weight_transfer/bench_delta_opportunity_cpu.py \\
        --models qwen3-1gib --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402
    QWEN3_BENCH_SHAPE,
    emit_json,
    machine_info,
    result_path,
    rounded,
)

# Model name -> TinyModelSpec fields. "qwen3-1gib": the benchmarks' Qwen3
# shape with 36 layers, 519 M parameters, 1.04 GB in bf16.
MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": dict(arch="qwen3", init_std=0.02),
    "tiny-qwen3-moe": dict(arch="qwen3_moe", init_std=0.02),
    "qwen3-1gib": dict(QWEN3_BENCH_SHAPE, num_layers=36),
}
LEARNING_RATES = (1e-6, 3e-6, 1e-5)
MODES = ("bf16", "fp32_master")
KINDS = ("attention", "mlp", "experts", "router", "norms", "embeddings", "other")


def tensor_kind(name: str) -> str:
    """The kind of a Qwen3 / Qwen3-MoE parameter, from its name."""
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    if "norm" in name:
        return "norms"
    if ".experts." in name:
        return "experts"
    if ".mlp.gate." in name:
        return "router"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "other"


def delta_bytes(numel: int, changed: int) -> int:
    """The smallest of the three encodings of one tensor's change."""
    whole = 2 * numel
    positions = 6 * changed
    bitmap = -(-numel // 8) + 2 * changed
    return min(whole, positions, bitmap)


def build_model(name: str, mode: str) -> Any:
    from vllm.distributed.weight_transfer.testing import TinyModelSpec
    from vllm.distributed.weight_transfer.testing.tiny_models import build_hf_model

    spec = TinyModelSpec(**MODELS[name], dtype="float32")
    model = build_hf_model(spec)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    return model.train()


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 bit patterns a trainer would publish now."""
    return {
        n: p.detach().to(torch.bfloat16).view(torch.int16).clone()
        for n, p in model.named_parameters()
    }


def run(
    name: str, mode: str, lr: float, steps: int, tokens: int, seed: int
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build_model(name, mode)
    vocab = int(model.config.vocab_size)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=0.01, foreach=False
    )
    numel = {n: p.numel() for n, p in model.named_parameters()}
    kind_of = {n: tensor_kind(n) for n in numel}
    kind_numel: dict[str, int] = defaultdict(int)
    for n, k in kind_of.items():
        kind_numel[k] += numel[n]
    total = sum(numel.values())
    before = published(model)
    per_step: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ids = torch.randint(3, vocab, (1, tokens), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = published(model)
        changed_by_kind: dict[str, int] = defaultdict(int)
        delta_total = 0
        for n, bits in after.items():
            changed = int((bits != before[n]).sum())
            changed_by_kind[kind_of[n]] += changed
            delta_total += delta_bytes(numel[n], changed)
        before = after
        changed_all = sum(changed_by_kind.values())
        per_step.append(
            {
                "step": step,
                "loss": float(loss),
                "changed_fraction": changed_all / total,
                "delta_bytes_fraction": delta_total / (2 * total),
                "changed_fraction_by_kind": {
                    k: changed_by_kind[k] / kind_numel[k] for k in sorted(kind_numel)
                },
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"{name} {mode} lr={lr:g} step {step}: "
            f"{100 * changed_all / total:.3f}% of elements changed, delta "
            f"{100 * delta_total / (2 * total):.3f}% of the bf16 bytes",
            flush=True,
        )
    later = per_step[1:] or per_step
    changed_mean = sum(s["changed_fraction"] for s in later) / len(later)
    delta_mean = sum(s["delta_bytes_fraction"] for s in later) / len(later)
    return {
        "model": name,
        "mode": mode,
        "lr": lr,
        "parameters": total,
        "bf16_bytes": 2 * total,
        "parameters_by_kind": dict(sorted(kind_numel.items())),
        "summary_steps_2_to_n": {
            "changed_percent_mean": round(100 * changed_mean, 2),
            "delta_bytes_percent_mean": round(100 * delta_mean, 2),
            "changed_percent_last_step": round(
                100 * per_step[-1]["changed_fraction"], 2
            ),
            "changed_fraction_mean": changed_mean,
            "changed_fraction_max": max(s["changed_fraction"] for s in later),
            "delta_bytes_fraction_mean": delta_mean,
            "delta_bytes_fraction_max": max(s["delta_bytes_fraction"] for s in later),
            "changed_fraction_by_kind_mean": {
                k: sum(s["changed_fraction_by_kind"][k] for s in later) / len(later)
                for k in sorted(kind_numel)
            },
        },
        "steps": per_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-qwen3", "tiny-qwen3-moe"])
    ap.add_argument("--lrs", nargs="+", type=float, default=list(LEARNING_RATES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default: the result layout")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = [
        run(m, mode, lr, args.steps, args.tokens, args.seed)
        for m in args.models
        for mode in args.modes
        for lr in args.lrs
    ]
    variant = "-".join(args.models)
    doc = {
        "benchmark": "delta_opportunity_cpu",
        "what": (
            "fraction of bf16 elements (and of per-tensor delta bytes) that "
            "change per AdamW step, per tensor kind"
        ),
        "settings": {
            "steps": args.steps,
            "tokens_per_step": args.tokens,
            "optimizer": "torch.optim.AdamW(weight_decay=0.01), grad norm clip 1.0",
            "loss": "next-token loss on seeded random tokens",
            "delta_encoding": "per tensor min(2*n, 6*changed, n/8 + 2*changed)",
        },
        "machine": machine_info(),
        "runs": rounded(runs, 6),
    }
    out = args.out or result_path("bench_delta_opportunity_cpu.py", variant)
    emit_json(doc, out)


if __name__ == "__main__":
    main()
