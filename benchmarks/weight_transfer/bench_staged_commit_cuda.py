# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark (CUDA): the data-plane floor of a staged commit on one GPU.

A staged update holds the worker's shard in checkpoint format (``q_proj``,
``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` apart) until the commit,
which writes every staged byte into the served, kernel-format tensors (fused
``qkv_proj`` and ``gate_up_proj``). This script times that write for a
Qwen3-8B-sized shard in bfloat16 (TP=1, 16.4 GB), with nothing else running,
for staging on the device and in pinned host memory:

* ``device_copy_per_tensor``: one ``copy_`` per staged tensor into its slice of
  the kernel tensor, from device staging;
* ``device_foreach_copy``: the same copies in one ``torch._foreach_copy_``;
* ``host_pinned_per_tensor``: one non-blocking ``copy_`` per tensor from
  pinned host staging (PCIe / C2C bound);
* ``flat_device_copy``: one device copy of the same number of bytes, the
  peer every mode is compared with (``fraction_of_flat``).

Every mode is checked bit for bit: each kernel slice equals its staged
tensor. The fork's commit today goes through vLLM's layerwise
reload, which copies each byte twice and runs vLLM's per-layer processing;
these numbers are the floor a commit that only copies would reach.

Run (on the GPU machine): ``python3 benchmarks/weight_transfer/
bench_staged_commit_cuda.py --out benchmarks/results/staged_commit_cuda/h200.json``
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _bench_common import device_times, emit_json, result_path, utc_now

# Qwen3-8B's shapes (hidden 4096, intermediate 12288, 36 layers, 32 query and
# 8 key/value heads of 128, vocabulary 151936), served at TP=1.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = (
    4096,
    12288,
    36,
    32,
    8,
    128,
    151936,
)


Layout = list[tuple[str, tuple[int, ...], list[tuple[str, int, int]]]]


def layout() -> Layout:
    """Kernel tensors: (name, shape, [(staged tensor, row start, rows)])."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out: Layout = [("embed", (VOCAB, HIDDEN), [("embed", 0, VOCAB)])]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [
            (
                p + "qkv",
                (q + 2 * kv, HIDDEN),
                [(p + "q", 0, q), (p + "k", q, kv), (p + "v", q + kv, kv)],
            ),
            (p + "o", (HIDDEN, q), [(p + "o", 0, HIDDEN)]),
            (
                p + "gate_up",
                (2 * INTER, HIDDEN),
                [(p + "gate", 0, INTER), (p + "up", INTER, INTER)],
            ),
            (p + "down", (HIDDEN, INTER), [(p + "down", 0, HIDDEN)]),
            (p + "norm1", (HIDDEN,), [(p + "norm1", 0, HIDDEN)]),
            (p + "norm2", (HIDDEN,), [(p + "norm2", 0, HIDDEN)]),
            (p + "q_norm", (HEAD_DIM,), [(p + "q_norm", 0, HEAD_DIM)]),
            (p + "k_norm", (HEAD_DIM,), [(p + "k_norm", 0, HEAD_DIM)]),
        ]
    out += [
        ("norm", (HIDDEN,), [("norm", 0, HIDDEN)]),
        ("lm_head", (VOCAB, HIDDEN), [("lm_head", 0, VOCAB)]),
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(result_path(__file__)))
    args = p.parse_args()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    kernel: dict[str, torch.Tensor] = {}
    staged_dev: dict[str, torch.Tensor] = {}
    pairs: list[tuple[torch.Tensor, str]] = []  # (kernel slice, staged name)
    for name, shape, parts in layout():
        kernel[name] = torch.zeros(shape, dtype=dtype, device=dev)
        for staged, start, rows in parts:
            sub = (rows, *shape[1:])
            staged_dev[staged] = torch.randn(
                sub, dtype=torch.float32, device=dev, generator=gen
            ).to(dtype)
            pairs.append((kernel[name].narrow(0, start, rows), staged))
    nbytes = sum(t.numel() * t.element_size() for t in staged_dev.values())
    staged_host = {
        n: t.to("cpu", non_blocking=False).pin_memory() for n, t in staged_dev.items()
    }
    print(
        f"{len(staged_dev)} staged tensors into {len(kernel)} kernel tensors, "
        f"{nbytes / 1e9:.2f} GB"
    )

    dsts = [d for d, _ in pairs]
    modes = {
        "device_copy_per_tensor": lambda: [d.copy_(staged_dev[s]) for d, s in pairs],
        "device_foreach_copy": lambda: torch._foreach_copy_(
            dsts, [staged_dev[s] for _, s in pairs]
        ),
        "host_pinned_per_tensor": lambda: [
            d.copy_(staged_host[s], non_blocking=True) for d, s in pairs
        ],
    }
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    flat = device_times(lambda: flat_dst.copy_(flat_src), args.repeats + 1)[1:]
    flat_s = statistics.median(flat)
    results = {}
    for mode, fn in modes.items():
        for t in kernel.values():
            t.zero_()
        times = device_times(fn, args.repeats + 1)[1:]  # first: warm-up
        ok = all(torch.equal(d, staged_dev[s]) for d, s in pairs)
        median = statistics.median(times)
        results[mode] = {
            "seconds_median": round(median, 5),
            "seconds": [round(t, 5) for t in times],
            "gb_per_s": round(nbytes / median / 1e9, 1),
            "fraction_of_flat": round(flat_s / median, 4),
            "bit_exact": ok,
        }
        print(
            f"{mode}: {median * 1e3:.1f} ms ({nbytes / median / 1e9:.0f} GB/s, "
            f"{flat_s / median:.1%} of a flat copy), bit-exact {ok}"
        )
    doc = {
        "benchmark": "staged_commit_floor_cuda",
        "time_utc": utc_now(),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shard": "Qwen3-8B shapes, bfloat16, TP=1",
        "staged_tensors": len(staged_dev),
        "kernel_tensors": len(kernel),
        "bytes": nbytes,
        "flat_device_copy": {
            "seconds_median": round(flat_s, 5),
            "gb_per_s": round(nbytes / flat_s / 1e9, 1),
        },
        "modes": results,
    }
    emit_json(doc, args.out)
    return 0 if all(r["bit_exact"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
