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
  these shapes, ``3d9eb0e:benchmarks/results/ipc_cuda_pinned_h200.json``);
* ``quantize_per_channel``: the bfloat16 weights already landed, each
  quantized into preallocated codes and scales with torch operations (a
  reference quantizer: vLLM's fused kernel is not available on this machine,
  where vLLM does not run);
* ``land_then_quantize``: both, one after the other: the worker-side path;
* ``quantize_per_channel_fused`` and ``land_then_quantize_fused``: the same
  with a fused Triton kernel, one program per row (the row read once, the
  codes and scale written once), as a fused worker-side quantizer would;
* ``flat_copy_codes``: one device copy of the codes and scales' bytes, the
  data plane of landing codes the trainer quantized (the trainer-side path,
  ``fp8_codes`` / ``codes_landing``, moves these bytes instead of the
  bfloat16 ones);
* ``trainer_quantize_fork`` and ``trainer_quantize_fork_then_land_codes``:
  the fork's trainer-side quantizer (``fp8_codes.quantize_fp8_per_channel``,
  allocating its outputs as ``Fp8ChannelCodes`` does) over the trainer's
  weights, alone and followed by the codes' copy: the trainer-side path;
* ``trainer_quantize_int8_fork`` and ``..._then_land_codes``: the same for
  the fork's int8 quantizer (``int8_codes.quantize_int8_per_channel``, what
  ``Int8ChannelCodes`` sends to an engine serving a W8A8 int8 checkpoint;
  the fused kernel of ``row_quantizer`` on CUDA, shared with FP8's), whose
  codes and scales are as many bytes as FP8's;
* ``trainer_quantize_block_fork`` and ``..._then_land_codes``: the fork's
  block FP8 quantizer (``fp8_codes.quantize_fp8_per_block``, what
  ``Fp8BlockCodes`` sends to an engine serving a 128x128-tile FP8
  checkpoint; torch operations), followed by a copy of the codes' bytes
  (its scales, one per tile, are a few hundred KB more).

Prints each mode's time over ``flat_copy_bf16`` and the bytes each path
moves; every weight each quantizer wrote is checked against a float64
reference of the same quantizer (codes equal, scales equal); the int8
quantizer's first four tensors are checked against the same function run on
the host (it divides exactly on both). The block quantizer divides by a
Python number, as vLLM's own does, which torch on CUDA computes through the
reciprocal: ``differences_from_the_host`` records the share of its codes and
scales that differ from the host's (information, not a check). Writes JSON
with ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from _bench_common import device_times, emit_json, result_path

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


def fused_quantizer():
    """A Triton kernel doing ``quantize_into`` in one program per row: the
    row read once (bfloat16), its absmax and scale, the codes written once;
    what a fused worker-side quantizer costs. None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _rows(w_ptr, c_ptr, s_ptr, cols, fp8_max, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        w = tl.load(w_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(w), axis=0)
        # Correctly rounded divisions (``/`` may lower to an approximate one).
        scale = tl.maximum(tl.math.div_rn(amax, fp8_max), 1.1754943508222875e-38)
        q = tl.minimum(tl.maximum(tl.math.div_rn(w, scale), -fp8_max), fp8_max)
        tl.store(c_ptr + row * cols + offs, q.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    def run(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
        rows, cols = w.shape
        block = triton.next_power_of_2(cols)
        _rows[(rows,)](w, codes, scale, cols, FP8_MAX, BLOCK=block, num_warps=8)

    return run


def _fp8_max(device: torch.device) -> torch.Tensor:
    return torch.full((1, 1), FP8_MAX, dtype=torch.float32, device=device)


def _same_as_reference(w: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether codes ``c`` and scales ``s`` of ``w`` equal a float64
    reference of the same quantizer."""
    # (float64 division rounded once to float64, then once to float32: the
    # correctly rounded float32 quotient)
    ref_scale = (w.double().abs().amax(dim=1, keepdim=True) / FP8_MAX).float()
    ref_codes = (w.float() / ref_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    same_codes = torch.equal(c.view(torch.uint8), ref_codes.view(torch.uint8))
    return torch.equal(s, ref_scale) and same_codes


def _mismatched(landed, codes, scales) -> list[int]:
    """Tensors whose codes or scales differ from the reference."""
    bad = []
    for i, (w, c, s) in enumerate(zip(landed, codes, scales, strict=True)):
        if not _same_as_reference(w, c, s):
            bad.append(i)
        c.zero_()  # the next quantizer writes them anew
        s.zero_()
    return bad


def fork_trainer_quantizer():
    """The fork's trainer-side quantizer (``fp8_codes.quantize_fp8_per_channel``,
    what ``Fp8ChannelCodes`` runs on each linear weight, allocating its
    codes and scales); None where the fork's module cannot be imported."""
    try:
        from vllm.distributed.weight_transfer.quant.fp8 import (
            quantize_fp8_per_channel,
        )
    except ImportError:
        return None
    return quantize_fp8_per_channel


def fork_int8_quantizer():
    """The fork's trainer-side int8 quantizer (``int8_codes``, what
    ``Int8ChannelCodes`` runs for an engine serving a W8A8 int8 checkpoint);
    None where the fork's module cannot be imported."""
    try:
        from vllm.distributed.weight_transfer.quant.int8 import (
            quantize_int8_per_channel,
        )
    except ImportError:
        return None
    return quantize_int8_per_channel


def fork_block_quantizer():
    """The fork's block FP8 quantizer (``fp8_codes.quantize_fp8_per_block``,
    what ``Fp8BlockCodes`` runs); None where it cannot be imported."""
    try:
        from vllm.distributed.weight_transfer.quant.fp8 import (
            quantize_fp8_per_block,
        )
    except ImportError:
        return None
    return quantize_fp8_per_block


def _differing(
    on_device: tuple[torch.Tensor, torch.Tensor], on_host: tuple[torch.Tensor, ...]
) -> dict[str, float]:
    """The share of codes and of scales that differ between the two runs."""
    codes, scale = (t.cpu() for t in on_device)
    host_codes, host_scale = on_host
    return {
        "codes": round(
            (codes.view(torch.uint8) != host_codes.view(torch.uint8))
            .float()
            .mean()
            .item(),
            6,
        ),
        "scales": round((scale != host_scale).float().mean().item(), 6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=str(result_path(__file__)))
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

    fused = fused_quantizer()

    def quantize_fused() -> None:
        assert fused is not None
        for w, c, s in zip(landed, codes, scales, strict=True):
            fused(w, c, s)

    def land_then_quantize_fused() -> None:
        land()
        quantize_fused()

    def flat_copy_codes() -> None:
        flat_dst[:code_bytes].copy_(flat_src[:code_bytes])

    fork = fork_trainer_quantizer()

    def trainer_quantize() -> None:
        assert fork is not None
        for w in trainer:
            fork(w)

    def trainer_quantize_then_land_codes() -> None:
        trainer_quantize()
        flat_copy_codes()

    int8 = fork_int8_quantizer()

    def trainer_quantize_int8() -> None:
        assert int8 is not None
        for w in trainer:
            int8(w)

    def trainer_quantize_int8_then_land_codes() -> None:
        trainer_quantize_int8()
        flat_copy_codes()  # int8 codes and scales: the same bytes as FP8's

    block = fork_block_quantizer()

    def trainer_quantize_block() -> None:
        assert block is not None
        for w in trainer:
            block(w)

    def trainer_quantize_block_then_land_codes() -> None:
        trainer_quantize_block()
        flat_copy_codes()  # the codes' bytes (per-row scales' size, close)

    land()  # quantize reads landed weights
    modes = {
        "flat_copy_bf16": flat_copy_bf16,
        "quantize_per_channel": quantize,
        "land_then_quantize": land_then_quantize,
        "flat_copy_codes": flat_copy_codes,
    }
    if fused is not None:
        modes["quantize_per_channel_fused"] = quantize_fused
        modes["land_then_quantize_fused"] = land_then_quantize_fused
    if fork is not None:
        modes["trainer_quantize_fork"] = trainer_quantize
        modes["trainer_quantize_fork_then_land_codes"] = (
            trainer_quantize_then_land_codes
        )
    if int8 is not None:
        modes["trainer_quantize_int8_fork"] = trainer_quantize_int8
        modes["trainer_quantize_int8_fork_then_land_codes"] = (
            trainer_quantize_int8_then_land_codes
        )
    if block is not None:
        modes["trainer_quantize_block_fork"] = trainer_quantize_block
        modes["trainer_quantize_block_fork_then_land_codes"] = (
            trainer_quantize_block_then_land_codes
        )
    results: dict = {}
    checked: dict[str, list[int]] = {}
    for name, fn in modes.items():
        fn()  # warm-up
        times = device_times(fn, args.reps)
        results[name] = {
            "best_s": round(min(times), 5),
            "median_s": round(statistics.median(times), 5),
        }
        if name in ("quantize_per_channel", "quantize_per_channel_fused"):
            checked[name] = _mismatched(landed, codes, scales)
    if fork is not None:
        checked["trainer_quantize_fork"] = [
            i for i, w in enumerate(trainer) if not _same_as_reference(w, *fork(w))
        ]
    if int8 is not None:
        # The same arithmetic on the host (IEEE division and round half to
        # even on both): the first tensors' codes and scales must be equal.
        checked["trainer_quantize_int8_fork_vs_cpu"] = [
            i
            for i, w in enumerate(trainer[:4])
            if not all(
                torch.equal(a.cpu(), b)
                for a, b in zip(int8(w), int8(w.cpu()), strict=True)
            )
        ]
    host_differences: dict[str, list[dict[str, float]]] = {}
    if block is not None:
        # Not a check: the block quantizer divides by a Python number as
        # vLLM's does, which torch on CUDA computes through the reciprocal,
        # so its scales (and some codes) differ from the host's; on each
        # device it equals vLLM's own quantizer run there.
        host_differences["trainer_quantize_block_fork"] = [
            _differing(block(w), block(w.cpu())) for w in trainer[:4]
        ]
    flat = results["flat_copy_bf16"]["best_s"]
    for r in results.values():
        r["over_flat_copy_bf16"] = round(r["best_s"] / flat, 3)
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
        "quantizers_match_reference": {k: not v for k, v in checked.items()},
        "mismatched_tensors": {k: v[:8] for k, v in checked.items()},
        "differences_from_the_host": host_differences,
    }
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
