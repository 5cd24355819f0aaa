# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sharded_rdt pull data plane over NIXL, without vLLM, next to a raw NIXL
read of the same bytes between the same two processes, in one run.

A producer process (a trainer rank) holds a model's parameters (the parameter
list of Qwen3-8B, bf16, or a smaller one) on ``--device``; a consumer process
(an inference worker of a tensor-parallel group of ``--tp``) pulls, for every
decoder layer, only its shard: the first ``1/tp`` rows of column-parallel
weights (embedding, q/k/v, gate/up, lm_head) and the first ``1/tp`` columns of
row-parallel ones (o_proj, down_proj; strided, so the producer packs them),
with norms whole. One sync, as the fork's engine runs it:

* producer: ``begin_sync``; per decoder-layer group ``wait_credit`` and
  ``publish``; ``end_sync``;
* consumer: per chunk, a ``pull`` request (the producer replays the slices'
  view chains and packs them into a registered serve buffer), one NIXL READ
  into the consumer's registered receive buffer, and a ``done`` notice; the
  request for the next chunk is sent before the current one is read.

Measured, per sync: wall time on the consumer from the start of the sync to
its last chunk landed (``sync``; landing is one copy of each chunk out of the
receive buffer), the same without the landing copy (``pull_only``);
``raw_nixl``: one NIXL READ of the same number of bytes from a registered
buffer of the producer's into one of the consumer's (the
transport's limit); and ``copy``: one same-process copy of those bytes on the
device. Every sync is verified: a checksum of what the consumer received equals
the producer's shard.

Run (CPU here; on the lent GPU machine through the stand-ins of
``tools/fork/device``, with the nixl wheels installed)::

    python benchmarks/weight_transfer/bench_sharded_pull_nixl.py --device cpu \
        --model small
    PYTHONPATH=.device-carry/site:tools/fork/device/site:. python3 \
        benchmarks/weight_transfer/bench_sharded_pull_nixl.py --device cuda \
        --model 8b --out result.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, cast

import torch
from _bench_common import emit_json, result_path

DTYPE = torch.bfloat16
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    q: int
    kv: int
    head_dim: int
    vocab: int


MODELS = {
    "8b": Shape("Qwen3-8B", 36, 4096, 12288, 4096, 1024, 128, 151936),
    "small": Shape("Qwen3-small", 8, 1024, 3072, 1024, 512, 64, 32000),
}


def param_list(m: Shape) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (m.vocab, m.hidden))
    ]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (m.q, m.hidden)),
            (p + "self_attn.k_proj.weight", (m.kv, m.hidden)),
            (p + "self_attn.v_proj.weight", (m.kv, m.hidden)),
            (p + "self_attn.o_proj.weight", (m.hidden, m.q)),
            (p + "self_attn.q_norm.weight", (m.head_dim,)),
            (p + "self_attn.k_norm.weight", (m.head_dim,)),
            (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
            (p + "input_layernorm.weight", (m.hidden,)),
            (p + "post_attention_layernorm.weight", (m.hidden,)),
        ]
    out += [("model.norm.weight", (m.hidden,)), ("lm_head.weight", (m.vocab, m.hidden))]
    return out


def shard_chain(name: str, shape: tuple[int, ...], tp: int) -> tuple[Any, ...]:
    """The view chain that cuts TP rank 0's shard out of ``name``."""
    from vllm.distributed.weight_transfer.plan.ops import ViewOp

    if len(shape) == 1 or tp == 1:
        return ()
    column = name.endswith(("embed_tokens.weight", "lm_head.weight")) or any(
        f".{k}." in name for k in COLUMN_PARALLEL
    )
    dim = 0 if column else 1
    return (ViewOp("narrow", (dim, 0, shape[dim] // tp)),)


def pull_plan(params, tp: int):
    """The consumer's pull plan, built the way the engine's bake builds it."""
    from vllm.distributed.weight_transfer.plan.ops import SliceSpec
    from vllm.distributed.weight_transfer.plan.worker_plan import (
        Region,
        SliceCopy,
        build_plan,
    )
    from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
    from vllm.distributed.weight_transfer.pull.routing import RdtRouter

    copies = []
    for name, shape in params:
        chain = shard_chain(name, shape, tp)
        out = list(shape)
        for op in chain:
            dim, _, length = op.args
            out[dim] = length
        spec = SliceSpec(name, chain, tuple(out), "bfloat16")
        module, param = name.rsplit(".", 1)
        stride = [1] * len(out)
        for d in range(len(out) - 2, -1, -1):
            stride[d] = stride[d + 1] * out[d + 1]
        copies.append(
            SliceCopy(
                spec, Region(module, param, 0, tuple(out), tuple(stride), "bfloat16")
            )
        )
    names = [n for n, _ in params]
    plan = build_plan(worker="bench", names=names, copies=copies)
    return build_pull_plan(plan, RdtRouter(1, 1), 0)


def shard_checksum(tensors: dict[str, torch.Tensor], params, tp: int) -> float:
    """Sum of the consumer's shard (the chains are single narrows)."""
    total = 0.0
    for name, shape in params:
        t = tensors[name]
        for op in shard_chain(name, shape, tp):
            t = t.narrow(*op.args)
        total += float(t.double().sum())
    return total


def landed_checksum(landed: torch.Tensor, chunks) -> float:
    """Sum of every slice in the landed chunks (laid end to end)."""
    total = 0.0
    base = 0
    for chunk in chunks:
        for packed in chunk.slices:
            start = base + packed.offset
            raw = landed[start : start + packed.spec.nbytes]
            total += float(raw.view(DTYPE).double().sum())
        base += chunk.nbytes
    return total


def make_tensors(params, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in params:
        t = torch.empty(shape, dtype=DTYPE, device=device)
        t.view(-1).uniform_(-1, 1, generator=gen)
        out[name] = t
    return out


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- producer process -----------------------------------------------------------


def producer_main(model: str, tp: int, device_name: str, raw_bytes: int, conn) -> None:
    try:
        from vllm.distributed.weight_transfer.base import layerwise_groups
        from vllm.distributed.weight_transfer.pull.nixl import (
            NixlProducerServer,
        )

        device = torch.device(device_name)
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        params = param_list(MODELS[model])
        names = [n for n, _ in params]
        groups = layerwise_groups(names)
        tensors = make_tensors(params, device)
        server = NixlProducerServer(
            dict(
                rank=0,
                names=[n for g in groups for n in g],
                group_lens=[len(g) for g in groups],
                served_names=names,
                stall_timeout_s=120.0,
                device=device,
            ),
            "127.0.0.1",
        )
        # The raw-read baseline's source, registered before any consumer
        # fetches this agent's metadata.
        raw = torch.empty(raw_bytes, dtype=torch.uint8, device=device)
        raw.fill_(7)
        server._register(raw)
        mem = "VRAM" if device.type == "cuda" else "DRAM"
        dev = device.index if device.type == "cuda" else 0
        conn.send(
            (
                "ready",
                {
                    "endpoint": server.endpoint(),
                    "raw": (raw.data_ptr(), raw_bytes, dev, mem),
                    "checksum": shard_checksum(tensors, params, tp),
                },
            )
        )
        while conn.recv() == "sync":
            server.begin_sync([0])
            for gi, group in enumerate(groups):
                server.wait_credit()
                server.publish(gi, {n: tensors[n] for n in group})
            server.end_sync()
            conn.send(("synced", None))
        server.close()
        conn.send(("closed", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def expect(conn, kind: str, timeout: float = 600.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"producer sent no {kind!r} within {timeout}s")
    got, value = conn.recv()
    if got != kind:
        raise RuntimeError(f"producer: expected {kind!r}, got {got!r}: {value}")
    return value


# -- consumer (this process) --------------------------------------------------------


def run(model: str, tp: int, device_name: str, rounds: int) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.pull.nixl import (
        NixlConsumerTransport,
    )

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    params = param_list(MODELS[model])
    pulls = pull_plan(params, tp)
    chunks = list(pulls.chunks)
    payload = pulls.payload_bytes
    moved = sum(c.nbytes for c in chunks)  # the slices plus alignment padding
    model_bytes = sum(DTYPE.itemsize * int(torch.Size(s).numel()) for _, s in params)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=producer_main,
        args=(model, tp, device_name, moved, child),
        daemon=True,
    )
    proc.start()
    try:
        ready = expect(parent, "ready")
        transport = NixlConsumerTransport(0, 120.0)
        link = transport.connect(0, ready["endpoint"])
        link.register(0, pulls.chunks, pulls.digest(0))
        receive = transport.receive_buffer(pulls.max_chunk_bytes, device)
        landed = torch.empty(moved, dtype=torch.uint8, device=device)
        times: dict[bool, list[float]] = {True: [], False: []}
        checksum_ok = []
        # Syncs that land every chunk (verified), then syncs that only pull.
        for land in [True] * (rounds + 1) + [False] * rounds:
            sync_device(device)
            started = time.perf_counter()
            parent.send("sync")
            offset = 0
            for i, chunk in enumerate(chunks):
                following = chunks[i + 1] if i + 1 < len(chunks) else None
                link.pull(chunk, receive[: chunk.nbytes], following)
                if land:  # one copy out of the receive buffer
                    landed[offset : offset + chunk.nbytes].copy_(
                        receive[: chunk.nbytes]
                    )
                offset += chunk.nbytes
            sync_device(device)
            times[land].append(time.perf_counter() - started)
            expect(parent, "synced")
            if land:
                got = landed_checksum(landed, chunks)
                checksum_ok.append(
                    abs(got - ready["checksum"]) <= 1e-9 * abs(got) + 1e-6
                )
        warmup, measured = times[True][0], times[True][1:]
        pull_only = times[False]
        # Raw NIXL: one READ of the same bytes from the producer's registered
        # buffer into one of ours.
        raw_dst = transport.receive_buffer(moved, device)
        addr, nbytes, dev, mem = ready["raw"]
        raw_times = []
        for _ in range(rounds + 1):
            sync_device(device)
            started = time.perf_counter()
            transport.read(
                cast(Any, link).remote_agent, raw_dst, (addr, nbytes, dev), mem
            )
            sync_device(device)
            raw_times.append(time.perf_counter() - started)
        copy_times = []
        for _ in range(rounds + 1):
            sync_device(device)
            started = time.perf_counter()
            landed.copy_(raw_dst)
            sync_device(device)
            copy_times.append(time.perf_counter() - started)
        parent.send("stop")
        expect(parent, "closed")
        link.close()
        transport.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    best = min(measured)
    pull_best = min(pull_only)
    raw_best = min(raw_times[1:])
    copy_best = min(copy_times[1:])
    return {
        "model": MODELS[model].name,
        "tp": tp,
        "device": device_name,
        "model_bytes": model_bytes,
        "pulled_bytes": payload,
        "moved_bytes": moved,
        "pulled_fraction": payload / model_bytes,
        "chunks": len(chunks),
        "warmup_sync_s": warmup,
        "sync_s": measured,
        "sync_best_s": best,
        "sync_GBps": moved / best / 1e9,
        "pull_only_s": pull_only,
        "pull_only_GBps": moved / pull_best / 1e9,
        "pull_only_fraction_of_raw_nixl": raw_best / pull_best,
        "raw_nixl_s": raw_times[1:],
        "raw_nixl_GBps": moved / raw_best / 1e9,
        "copy_GBps": moved / copy_best / 1e9,
        "sync_fraction_of_raw_nixl": raw_best / best,
        "verified": all(checksum_ok),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(result_path(__file__)))
    args = p.parse_args()
    results = [run(args.model, tp, args.device, args.rounds) for tp in args.tp]
    doc = {
        "machine": {
            "device": (
                torch.cuda.get_device_name(0)
                if args.device.startswith("cuda")
                else platform.processor() or platform.machine()
            ),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "results": results,
    }
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
