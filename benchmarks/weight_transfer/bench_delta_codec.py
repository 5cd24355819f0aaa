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

``--rebuild`` (with ``--device cuda``) also times, per change rate, the
three ways a worker uses a delta (``pull/delta_bases``, the delta already
read): written in place into the served tensors (``delta_in_place``: the
``ws1`` checksum of the chunk's 8 device tensors taken where they lie and
checked against the delta's base, the positions split over them, the new
checksum from the changed values, then the write; no copy kept, no gather,
no landing copy); rebuilt from the served tensors (``land_delta``: the
chunk gathered from them into its receive buffer, checksummed there and
written; no copy kept); and from a kept copy in host memory (the delta
applied to the host copy with its carried checksum, then the chunk copied
host to device, as a GPU worker whose chunk vLLM processes after loading
does).

``--models 8b,30b`` times the same on the chunks a ``sharded_rdt`` producer
serves a TP 1 worker of Qwen3-8B or Qwen3-30B-A3B (``--moe-layers`` of its
48, all by default) in bf16: one chunk per gather group
(``layerwise_groups``: the embedding, each decoder layer, the final norm with
``lm_head``), each tensor at a 16-byte aligned offset, shapes from
``bench_ipc_cuda.py``. Each distinct chunk size is measured (the layers of a
model are all one size); a model's encode, apply and copy times are the sums
over its chunks.

    .venv/bin/python benchmarks/weight_transfer/bench_delta_codec.py \\
        [--device cpu|cuda] [--mib 256] [--rates 0.005 0.01 0.03 0.1 0.3] \\
        [--threads N] [--models 8b,30b [--moe-layers N]] [--rebuild]
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


def time_chunk(nbytes: int, rates: list[float], reps: int, device) -> dict:
    """Copy, digest, and per change rate encode and apply times of one bf16
    chunk of ``nbytes`` random bytes (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    base = base.to(device)
    digest = payload_checksum(base)
    target = base.clone()
    scratch = torch.empty_like(base)
    copy_s = best_s(lambda: scratch.copy_(base), reps)
    digest_s = best_s(lambda: payload_checksum(base), reps)
    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(rates):
        new = changed_copy(base, rate, seed=i + 1)
        delta = encode_delta(base, new, unit=2, base_version=0, base_digest=digest)
        if delta is None:
            rows.append({"rate": rate, "delta": None})
            continue

        def encode(new: torch.Tensor = new) -> None:
            encode_delta(base, new, unit=2, base_version=0, base_digest=digest)

        def apply(delta: Any = delta) -> None:
            apply_delta(target, delta, held_version=0, held_digest=digest)

        encode_s = best_s(encode, reps)
        apply_s = best_s(apply, reps)
        assert torch.equal(target, new), "apply_delta did not produce the new bytes"
        target.copy_(base)
        rows.append(
            {
                "rate": rate,
                "changed_fraction": delta.count / (nbytes // 2),
                "delta_bytes_fraction": delta.encoded_nbytes / nbytes,
                "encode_s": encode_s,
                "apply_s": apply_s,
            }
        )
        del new, delta
    return {"copy_s": copy_s, "digest_s": digest_s, "rows": rows}


def time_rebuild(nbytes: int, rates: list[float], reps: int, device) -> list[dict]:
    """Per change rate, the seconds of a worker's two rebuilds of one bf16
    chunk of ``nbytes`` from a delta (see the module docstring)."""
    from vllm.distributed.weight_transfer.pull.delta_bases import (
        OfferedDelta,
        ServedBytes,
        delta_in_place,
        land_delta,
    )

    g = torch.Generator().manual_seed(0)
    host_base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    base = host_base.to(device)
    digest = payload_checksum(base)
    served = [piece.clone() for piece in base.chunk(8)]
    pieces = []
    offset = 0
    for piece in served:
        pieces.append((offset, piece))
        offset += piece.numel()
    into = torch.empty_like(base)
    host_copy = host_base.clone()

    def gather(buf: torch.Tensor) -> None:
        offset = 0
        for piece in served:
            buf[offset : offset + piece.numel()].copy_(piece)
            offset += piece.numel()

    rows = []
    for i, rate in enumerate(rates):
        new = changed_copy(base, rate, seed=i + 1)
        delta = encode_delta(base, new, unit=2, base_version=0, base_digest=digest)
        if delta is None:
            continue
        header, wire = delta.to_wire()

        def read_into(buf: torch.Tensor, wire: torch.Tensor = wire) -> None:
            buf.copy_(wire)

        offered = OfferedDelta(header, wire.numel(), read_into)

        def from_served(offered: OfferedDelta = offered) -> None:
            land_delta(offered, into, ServedBytes(0, gather))

        host_delta = delta.on(torch.device("cpu"))

        def from_host(host_delta: Any = host_delta) -> None:
            apply_delta(host_copy, host_delta, held_version=0, held_digest=digest)
            into.copy_(host_copy)

        served_s = best_s(from_served, reps)
        assert torch.equal(into, new), "the rebuild from served bytes is not exact"
        host_s = best_s(from_host, reps)
        assert torch.equal(into, new), "the rebuild from a host copy is not exact"
        host_copy.copy_(host_base)
        held = ServedBytes(0, gather, pieces=pieces)

        def check(offered: OfferedDelta = offered, held: Any = held) -> Any:
            # (As the other two: no checksum of the new bytes asked for.)
            return delta_in_place(offered, into, held, checksum=False)

        check_s = best_s(check, reps)
        plan = check()
        write_s = best_s(plan.write, reps)  # (the same values again: idempotent)
        assert torch.equal(torch.cat(served), new), "the in-place write is not exact"
        for piece, original in zip(served, base.chunk(8), strict=True):
            piece.copy_(original)
        rows.append(
            {
                "rate": rate,
                "rebuild_served_s": served_s,
                "rebuild_host_s": host_s,
                "in_place_s": check_s + write_s,
                "in_place_check_s": check_s,
                "in_place_write_s": write_s,
            }
        )
        del new, delta
    return rows


def with_rates(nbytes: int, timed: dict) -> dict:
    """``timed`` (times summed over ``nbytes``) with GB/s and copy ratios."""

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    copy_s = timed["copy_s"]
    rows = []
    for row in timed["rows"]:
        if row.get("delta", 1) is not None:
            row = dict(
                row,
                encode_gbps=gbps(row["encode_s"]),
                apply_gbps=gbps(row["apply_s"]),
                encode_over_copy=row["encode_s"] / copy_s,
                apply_over_copy=row["apply_s"] / copy_s,
            )
        rows.append(row)
    return dict(
        timed,
        copy_gbps=gbps(copy_s),
        digest_over_copy=timed["digest_s"] / copy_s,
        rows=rows,
    )


def print_table(title: str, nbytes: int, doc: dict) -> None:
    print(
        f"{title}: {nbytes / 1e9:.3f} GB bf16\n"
        f"  copy    {doc['copy_s'] * 1e3:8.1f} ms {doc['copy_gbps']:7.2f} GB/s\n"
        f"  digest  {doc['digest_s'] * 1e3:8.1f} ms "
        f"({doc['digest_over_copy']:.2f}x copy)"
    )
    for row in doc["rows"]:
        if row.get("delta", 1) is None:
            print(f"  {row['rate']:6.1%} changed: the whole chunk is smaller; no delta")
            continue
        print(
            f"  {row['rate']:6.1%} changed ({row['delta_bytes_fraction']:6.2%} of "
            f"the bytes): encode {row['encode_s'] * 1e3:7.1f} ms "
            f"{row['encode_gbps']:6.2f} GB/s ({row['encode_over_copy']:5.2f}x "
            f"copy), apply {row['apply_s'] * 1e3:7.1f} ms {row['apply_gbps']:6.2f} "
            f"GB/s ({row['apply_over_copy']:5.2f}x copy)"
        )


def model_chunks(models: str, moe_layers: int | None) -> list[tuple[str, list[int]]]:
    """(model name, the byte size of each chunk a TP 1 worker pulls), one
    chunk per gather group, tensors 16-byte aligned within it."""
    from bench_ipc_cuda import DTYPE, model_runs, param_list

    from vllm.distributed.weight_transfer.base import layerwise_groups

    out = []
    for shape, layers, _ in model_runs(models, moe_layers or 0):
        params = dict(param_list(shape, layers or None))
        sizes = []
        for group in layerwise_groups(list(params)):
            total = 0
            for name in group:
                n = DTYPE.itemsize
                for d in params[name]:
                    n *= d
                total += -(-n // 16) * 16
            sizes.append(total)
        label = shape.name if not layers else f"{shape.name} ({layers} layers)"
        out.append((label, sizes))
    return out


def model_doc(
    label: str, sizes: list[int], rates: list[float], reps: int, device
) -> dict:
    """Each distinct chunk size timed once; times summed over every chunk."""
    counts: dict[int, int] = {}
    for n in sizes:
        counts[n] = counts.get(n, 0) + 1
    total = {"copy_s": 0.0, "digest_s": 0.0}
    rows: dict[float, dict[str, Any]] = {}
    for nbytes, count in counts.items():
        timed = time_chunk(nbytes, rates, reps, device)
        total["copy_s"] += count * timed["copy_s"]
        total["digest_s"] += count * timed["digest_s"]
        for row in timed["rows"]:
            acc = rows.setdefault(
                row["rate"],
                {
                    "rate": row["rate"],
                    "encode_s": 0.0,
                    "apply_s": 0.0,
                    "changed": 0.0,
                    "delta_bytes": 0.0,
                    "whole_chunks": 0,
                },
            )
            if row.get("delta", 1) is None:
                acc["whole_chunks"] += count
                continue
            acc["encode_s"] += count * row["encode_s"]
            acc["apply_s"] += count * row["apply_s"]
            acc["changed"] += count * row["changed_fraction"] * nbytes / 2
            acc["delta_bytes"] += count * row["delta_bytes_fraction"] * nbytes
        if device.type == "cuda":
            torch.cuda.empty_cache()
    nbytes = sum(sizes)
    summed = []
    for acc in rows.values():
        changed, delta_bytes = acc.pop("changed"), acc.pop("delta_bytes")
        if acc["whole_chunks"] == len(sizes):
            summed.append({"rate": acc["rate"], "delta": None})
            continue
        summed.append(
            dict(
                acc,
                changed_fraction=changed / (nbytes / 2),
                delta_bytes_fraction=delta_bytes / nbytes,
            )
        )
    doc = with_rates(nbytes, dict(total, rows=summed))
    return dict(
        {"model": label, "bytes": nbytes, "chunks": len(sizes)},
        chunk_bytes=sorted(counts),
        **doc,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=list(RATES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads")
    ap.add_argument(
        "--models", default="", help="8b, 30b or 8b,30b: time model chunks instead"
    )
    ap.add_argument("--moe-layers", type=int, default=0, help="0: all 48")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument(
        "--rebuild",
        action="store_true",
        help="also time a worker's three uses of a delta",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    doc: dict[str, Any] = {
        "benchmark": "delta_codec",
        "dtype": "bfloat16",
        "reps": args.reps,
        "machine": machine_info(),
    }
    if args.models:
        doc["models"] = []
        for label, sizes in model_chunks(args.models, args.moe_layers):
            one = model_doc(label, sizes, args.rates, args.reps, device)
            print_table(f"{label}, {len(sizes)} chunks", one["bytes"], one)
            doc["models"].append(one)
    else:
        nbytes = args.mib * 1024 * 1024
        one = with_rates(nbytes, time_chunk(nbytes, args.rates, args.reps, device))
        print_table(f"one chunk of {args.mib} MiB on {device}", nbytes, one)
        doc.update(chunk_bytes=nbytes, **one)
        if args.rebuild:
            doc["rebuild"] = time_rebuild(nbytes, args.rates, args.reps, device)
            for row in doc["rebuild"]:
                print(
                    f"  rebuild at {row['rate']:6.1%}: from served bytes "
                    f"{row['rebuild_served_s'] * 1e3:7.2f} ms "
                    f"({row['rebuild_served_s'] / one['copy_s']:5.2f}x copy), from a "
                    f"host copy {row['rebuild_host_s'] * 1e3:7.2f} ms "
                    f"({row['rebuild_host_s'] / one['copy_s']:5.2f}x copy), in "
                    f"place {row['in_place_s'] * 1e3:7.2f} ms "
                    f"({row['in_place_s'] / one['copy_s']:5.2f}x copy)"
                )
    emit_json(rounded(doc, 6), args.out)


if __name__ == "__main__":
    main()
