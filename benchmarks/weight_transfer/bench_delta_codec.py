# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Encode and apply rates of the chunk delta codec (``pull/delta.py``) against
a copy of the same chunk, measured in the same run.

One bf16 chunk (256 MiB by default) of random bit patterns; for each change
rate a copy with that fraction of its elements changed (one bit flipped each).
Timed, each as the best of ``--reps`` after one warm-up:

* ``copy``: ``copy_`` of the chunk into a preallocated tensor (the floor a
  whole-chunk landing pays);
* ``encode``: ``encode_delta`` of base and new, the base's digest given;
* ``apply``: ``apply_delta`` into a chunk, the held digest given (the checks
  of the positions, one index write, and the checksum after it from the
  changed elements);
* ``digest``: the ``ws1`` checksum of the chunk, what ``apply_delta`` adds
  when the caller does not pass the digest it holds.

Rates are the chunk's bytes over the time (GB/s); ratios are the time over
the copy's. Prints a JSON document; ``--out`` writes it too (not by default).

    .venv/bin/python benchmarks/weight_transfer/bench_delta_codec.py \\
        [--device cpu|cuda] [--mib 256] [--rates 0.005 0.01 0.03 0.1 0.3] \\
        [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402
    device_times,
    emit_json,
    machine_info,
    rounded,
)

from vllm.distributed.weight_transfer.pull.delta import (  # noqa: E402
    apply_delta,
    encode_delta,
)
from vllm.distributed.weight_transfer.verification.checksum import (  # noqa: E402
    payload_checksum,
)

RATES = (0.005, 0.01, 0.03, 0.1, 0.3)


def best_s(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of ``reps`` calls of ``fn`` after one warm-up."""
    return min(device_times(fn, reps + 1)[1:])


def changed_copy(base: torch.Tensor, rate: float, seed: int) -> torch.Tensor:
    """``base`` with about ``rate`` of its bf16 elements changed."""
    g = torch.Generator(device=base.device).manual_seed(seed)
    words = base.clone().view(torch.int16)
    mask = torch.rand(words.numel(), generator=g, device=base.device) < rate
    words[mask] ^= 1
    return words.view(torch.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    nbytes = args.mib * 1024 * 1024
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    base = base.to(device)
    digest = payload_checksum(base)
    target = base.clone()
    scratch = torch.empty_like(base)
    copy_s = best_s(lambda: scratch.copy_(base), args.reps)
    digest_s = best_s(lambda: payload_checksum(base), args.reps)

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    print(
        f"device={device} threads={torch.get_num_threads()} chunk={args.mib} MiB "
        f"bf16\n  copy    {copy_s * 1e3:8.1f} ms {gbps(copy_s):7.2f} GB/s\n"
        f"  digest  {digest_s * 1e3:8.1f} ms {gbps(digest_s):7.2f} GB/s "
        f"({digest_s / copy_s:.2f}x copy)"
    )
    rows = []
    for i, rate in enumerate(args.rates):
        new = changed_copy(base, rate, seed=i + 1)
        delta = encode_delta(base, new, unit=2, base_version=0, base_digest=digest)
        if delta is None:
            print(f"  {rate:6.1%} changed: the whole chunk is smaller; no delta")
            rows.append({"rate": rate, "delta": None})
            continue

        def encode(new: torch.Tensor = new) -> None:
            encode_delta(base, new, unit=2, base_version=0, base_digest=digest)

        def apply(delta: Any = delta) -> None:
            apply_delta(target, delta, held_version=0, held_digest=digest)

        encode_s = best_s(encode, args.reps)
        apply_s = best_s(apply, args.reps)
        assert torch.equal(target, new), "apply_delta did not produce the new bytes"
        target.copy_(base)
        row = {
            "rate": rate,
            "changed_fraction": delta.count / (nbytes // 2),
            "delta_bytes_fraction": delta.encoded_nbytes / nbytes,
            "encode_s": encode_s,
            "apply_s": apply_s,
            "encode_gbps": gbps(encode_s),
            "apply_gbps": gbps(apply_s),
            "encode_over_copy": encode_s / copy_s,
            "apply_over_copy": apply_s / copy_s,
        }
        rows.append(row)
        print(
            f"  {rate:6.1%} changed ({row['delta_bytes_fraction']:6.2%} of the "
            f"bytes): encode {encode_s * 1e3:7.1f} ms {row['encode_gbps']:6.2f} "
            f"GB/s ({row['encode_over_copy']:5.2f}x copy), apply "
            f"{apply_s * 1e3:7.1f} ms {row['apply_gbps']:6.2f} GB/s "
            f"({row['apply_over_copy']:5.2f}x copy)"
        )
        del new, delta
    doc = {
        "benchmark": "delta_codec",
        "chunk_bytes": nbytes,
        "dtype": "bfloat16",
        "reps": args.reps,
        "machine": machine_info(),
        "copy_s": copy_s,
        "copy_gbps": gbps(copy_s),
        "digest_s": digest_s,
        "digest_over_copy": digest_s / copy_s,
        "rows": rows,
    }
    emit_json(rounded(doc, 6), args.out)


if __name__ == "__main__":
    main()
