# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark (CUDA): what worker-side FP8 quantization adds to a sync of
Qwen3-8B's linear layers, and what trainer-side codes would move, on one GPU.

An engine started with ``quantization="fp8_per_channel"`` receives the
trainer's bfloat16 weights and quantizes each linear layer as it lands: one
float32 scale per output row (its absolute maximum over 448, float8 e4m3's
largest value) and the weight divided by it as float8 codes. This script
times, for Qwen3-8B's 252 linear weights (TP 1, 36 layers; 13.9 GB in
bfloat16), with nothing else running:

* ``flat_copy_bf16``: one device copy of the bfloat16 bytes, the data plane
  of a full-precision sync (the fork's one-copy path reaches 83-86% of it on
  these shapes, ``ipc_cuda_pinned_h200.json``);
* ``quantize_per_channel``: the bfloat16 weights already landed, each
  quantized into preallocated codes and scales with torch operations (a
  reference quantizer: vLLM's fused kernel is not available on this machine,
  where vLLM does not run);
* ``land_then_quantize``: both, one after the other: the worker-side path;
* ``flat_copy_codes``: one device copy of the codes and scales' bytes, the
  data plane of landing codes the trainer quantized (not built: the
  trainer-side path moves these bytes instead of the bfloat16 ones).

Prints each mode's time over ``flat_copy_bf16`` and the bytes each path
moves; every quantized weight is checked against a float64 reference of the
same quantizer (codes equal, scales equal). Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

HIDDEN, INTERMEDIATE, LAYERS = 4096, 12288, 36
Q_OUT, KV_OUT = 32 * 128, 8 * 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def linear_shapes() -> list[tuple[int, int]]:
    per_layer = [
        (Q_OUT, HIDDEN),  # q_proj
        (KV_OUT, HIDDEN),  # k_proj
        (KV_OUT, HIDDEN),  # v_proj
        (HIDDEN, Q_OUT),  # o_proj
        (INTERMEDIATE, HIDDEN),  # gate_proj
        (INTERMEDIATE, HIDDEN),  # up_proj
        (HIDDEN, INTERMEDIATE),  # down_proj
    ]
    return per_layer * LAYERS


def quantize_into(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Per-output-row FP8: ``scale`` = row absmax / 448 (float32), ``codes``
    = w / scale as float8 e4m3."""
    scale.copy_(w.abs().amax(dim=1, keepdim=True))  # exact in float32
    # A tensor divisor: divided, not multiplied by a rounded reciprocal (what
    # torch does with a Python number on CUDA), so the scale is the exact
    # quotient rounded once.
    scale.div_(_fp8_max(w.device)).clamp_(min=torch.finfo(torch.float32).tiny)
    codes.copy_((w.float() / scale).clamp_(-FP8_MAX, FP8_MAX))


def _fp8_max(device: torch.device) -> torch.Tensor:
    return torch.full((1, 1), FP8_MAX, dtype=torch.float32, device=device)


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = linear_shapes()
    trainer = [
        (torch.randn(s, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        for s in shapes
    ]
    landed = [torch.empty_like(w) for w in trainer]
    codes = [torch.empty(s, dtype=FP8, device="cuda") for s in shapes]
    scales = [
        torch.empty((s[0], 1), dtype=torch.float32, device="cuda") for s in shapes
    ]
    bf16_bytes = sum(w.numel() * w.element_size() for w in trainer)
    code_bytes = sum(c.numel() for c in codes) + sum(s.numel() * 4 for s in scales)
    flat_src = torch.empty(bf16_bytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)

    def flat_copy_bf16() -> None:
        flat_dst.copy_(flat_src)

    def land() -> None:
        torch._foreach_copy_(landed, trainer)

    def quantize() -> None:
        for w, c, s in zip(landed, codes, scales, strict=True):
            quantize_into(w, c, s)

    def land_then_quantize() -> None:
        land()
        quantize()

    def flat_copy_codes() -> None:
        flat_dst[:code_bytes].copy_(flat_src[:code_bytes])

    land()  # quantize reads landed weights
    modes = {
        "flat_copy_bf16": flat_copy_bf16,
        "quantize_per_channel": quantize,
        "land_then_quantize": land_then_quantize,
        "flat_copy_codes": flat_copy_codes,
    }
    results: dict = {}
    for name, fn in modes.items():
        fn()  # warm-up
        times = timed(fn, args.reps)
        results[name] = {
            "best_s": round(min(times), 5),
            "median_s": round(statistics.median(times), 5),
        }
    flat = results["flat_copy_bf16"]["best_s"]
    for r in results.values():
        r["over_flat_copy_bf16"] = round(r["best_s"] / flat, 3)
    # The quantizer against a float64 reference, every tensor.
    bad = []
    for i, (w, c, s) in enumerate(zip(landed, codes, scales, strict=True)):
        ref_scale = (w.double().abs().amax(dim=1, keepdim=True) / FP8_MAX).float()
        # (the division by a float64 tensor rounds once to float64, then once
        # to float32: the correctly rounded float32 quotient, as above)
        ref_codes = (w.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        if not (
            torch.equal(s, ref_scale)
            and torch.equal(c.view(torch.uint8), ref_codes.view(torch.uint8))
        ):
            bad.append(i)
    doc = {
        "benchmark": "bench_quantize_step_cuda",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "commit": os.environ.get("BENCH_COMMIT"),
        "model": "Qwen3-8B linear weights, TP 1",
        "tensors": len(shapes),
        "bytes_bf16": bf16_bytes,
        "bytes_codes_and_scales": code_bytes,
        "codes_over_bf16_bytes": round(code_bytes / bf16_bytes, 4),
        "results": results,
        "quantizer_matches_reference": not bad,
        "mismatched_tensors": bad[:8],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
