# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Throughput of the ``ws1`` payload checksum against a plain copy.

    python benchmarks/weight_transfer/bench_payload_checksum.py [--mib 256]
        [--device cpu|cuda] [--threads N] [--chunk-mib 4 16 64]

Loads ``verification/checksum.py`` by path, so it runs with only torch
installed. Times both row-sum strategies (one matrix product, or a sum plus a
matrix-vector product). On CUDA it also checks that the device result equals
the CPU result for the same bytes.
"""

import argparse
import importlib.util
import time
from pathlib import Path

import torch

_PATH = (
    Path(__file__).resolve().parents[2]
    / "vllm/distributed/weight_transfer/verification/checksum.py"
)
_spec = importlib.util.spec_from_file_location("wt_checksum", _PATH)
assert _spec is not None and _spec.loader is not None
checksum = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checksum)


def best_of(fn, device: torch.device, reps: int = 5) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--chunk-mib", type=int, nargs="*", default=[])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = args.mib * 1024 * 1024
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    buf = host.to(device)
    dst = torch.empty_like(buf)
    t_copy = best_of(lambda: dst.copy_(buf), device)
    print(
        f"device={device} threads={torch.get_num_threads()} size={args.mib} MiB\n"
        f"  copy_      {t_copy * 1e3:8.2f} ms  {n / t_copy / 1e9:8.2f} GB/s"
    )
    chunks = [c * 1024 * 1024 for c in args.chunk_mib] or [None]
    for fused in (False, True):
        checksum._FUSED_ROW_SUMS[device.type] = fused
        for chunk in chunks:

            def run(chunk=chunk):
                return checksum.payload_checksum(buf, chunk_bytes=chunk)

            t = best_of(run, device)
            label = "default" if chunk is None else f"{chunk >> 20} MiB"
            impl = "mm" if fused else "sum+mv"
            print(
                f"  ws1 {impl:>6} {label:>7}{t * 1e3:8.2f} ms  "
                f"{n / t / 1e9:8.2f} GB/s  ({t / t_copy:.1f}x copy)"
            )
    if device.type != "cpu":
        same = checksum.payload_checksum(buf) == checksum.payload_checksum(host)
        print(f"  {device.type} result equals cpu result: {same}")


if __name__ == "__main__":
    main()
