# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CUDA data plane of the ``ipc`` backend on one GPU, against its limits and
against upstream vLLM 0.32's packed IPC, measured side by side in one run.

A trainer process holds a model's parameters (realistic shapes: the parameter
lists of Qwen3-8B and Qwen3-30B-A3B, bf16); a worker process on the same GPU
holds preallocated destination tensors of the same shapes, as a vLLM worker
holds its weights. One sync moves every parameter from the trainer's tensors
into the worker's. Measured, per model:

* ``d2d_copy``      one device-to-device copy of the same bytes (one tensor into
                    another, same process): the one-way copy limit;
* ``fork_packed``   the fork's trainer engine (``IPCTrainerWeightTransferEngine``,
                    packed) -> JSON update messages over a pipe -> the worker maps
                    the buffer once and copies each view into its destination;
* ``fork_packed_no_overlap`` / ``fork_packed_keep_buffer``: the same with
                    ``overlap_chunks=False`` / ``keep_packed_buffer=True``;
* ``fork_packed_2x_cap`` twice the cap (kept): what a user gets by giving the
                    fork more memory;
* ``fork_unpacked`` the same with one exported tensor per parameter (no packing
                    copy; every parameter's memory is shared in place);
* ``fork_packed_foreach`` ``fork_packed`` with the worker landing each message
                    in one ``torch._foreach_copy_`` instead of a copy per tensor;
* ``fork_shared_params`` / ``fork_shared_params_foreach``: the trainer's
                    tensors placed in one CUDA allocation (``SharedParameters``),
                    which every chunk names (no packing copy) and the worker
                    maps once for all syncs (``first_sync_seconds`` includes
                    that mapping; ``place_seconds`` is the one-time placement);
* ``fork_shared_params_planned`` (with ``--plans-dir``): the same trainer, and
                    a worker that holds vLLM's kernel-format tensors (fused QKV,
                    gate-up, stacked experts) and lands each chunk with the
                    planned landing bound once over the kept mapping
                    (``chunk_programs``: the plan ``bench_plan_scale.py
                    --plans-dir`` baked for the model at TP 1, compiled into a
                    copy table): one copy per byte from the trainer's
                    parameters into the served layout, which the worker engine
                    does with ``landing="planned"``;
* ``fork_shared_params_planned_pinned``: ``fork_shared_params_planned`` with
                    the source users send a placed module with
                    (``SharedParameters.source``), which knows when no
                    parameter moved: after the first sync, each sends only
                    the layout id the worker parsed then and the handle, and
                    walks no tensor (the other shared modes walk every
                    tensor of a plain dict source, as a user's own source is);
* ``fork_shared_params_planned_pinned_after_step``: the same, each sync
                    called right after an update of every trainer tensor
                    (``torch._foreach_add_``, as an optimizer step ends an RL
                    step) left queued on the device; reported: what the sync
                    adds to that step (step and sync, minus the step alone
                    measured just before), against the flat copy;
* ``..._pinned_check_first`` (adopted and placed): the same with the
                    trainer's ``check_while_landing=False``: the source is
                    checked (every parameter read, 3-10 ms for 9,435) before
                    each short message instead of on a helper thread while
                    the workers land it;
* ``fork_shared_params_planned_one_chunk``: the same with a packed-buffer cap
                    above the model's size, so one message carries every
                    tensor (nothing is packed, so the cap allocates nothing):
                    the cost of the per-chunk round trips;
* ``fork_packed_planned`` (with ``--plans-dir``): the same trainer packing
                    into a buffer it frees after each sync (the default); the
                    worker maps it anew every sync and runs each layout's
                    program, bound at the first sync and kept without its
                    sources, from the new mapping (``ChunkPrograms.anywhere``);
                    verified the same way;
* ``fork_packed_planned_kept`` (with ``--plans-dir``; last): the trainer's
                    tensors outside any shared allocation (as a trainer whose
                    tensors are new at every sync, FSDP's ``full_tensor()``,
                    holds them), packed into a buffer it keeps
                    (``keep_packed_buffer=True``), which the worker maps once
                    and binds each chunk's planned landing to: one copy into
                    the buffer and one out of it per byte. Verified on one
                    more sync after the timed ones, chunk by chunk as each
                    lands (the buffer's halves are rewritten by later chunks);
* ``upstream_packed`` upstream 0.32's ``packed_ipc_producer`` ->
                    ``packed_ipc_consumer`` (taken from the pinned release's
                    ``packed_tensor.py``, carried to the run, not part of the fork)
                    -> copy into the destinations.

Every mode is verified: a checksum of the worker's destinations equals the
trainer's; the planned modes compare every planned copy bit for bit instead
(the served layout differs from the trainer's). Each mode reports its best
sync against the flat copy (``fraction_of_device_copy``; ``fraction_of_d2d``
is the same ratio from the byte rates), its median sync without the first
(``fraction_of_device_copy_median``), and its speed against
``upstream_packed`` and ``fork_packed`` when they ran (``vs_upstream_packed``,
``vs_fork_packed``). Prints one JSON document (also
written to ``--out``).

Runs where vLLM is not installed (the lent GPU machine) through the stand-ins in
``tools/fork/device``; run ``tools/fork/device/prepare.sh`` first, then::

    PYTHONPATH=.device-carry/site:.device-carry/upstream:tools/fork/device/site:. \
        python3 benchmarks/weight_transfer/bench_ipc_cuda.py --out result.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from _bench_common import emit_json, result_path

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    moe_intermediate: int = 0


QWEN3_8B = ModelShape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936)
QWEN3_30B_A3B = ModelShape(
    "Qwen3-30B-A3B", 48, 2048, 6144, 32, 4, 128, 151936, 128, 768
)


def model_runs(
    models: str, moe_layers: int
) -> list[tuple[ModelShape, int | None, str]]:
    """The shapes ``--models`` names ("8b", "30b", comma-separated), each with
    its layer count (None: all; ``moe_layers`` for Qwen3-30B-A3B) and the
    name its baked plan has under ``--plans-dir``."""
    runs: list[tuple[ModelShape, int | None, str]] = []
    if "8b" in models:
        runs.append((QWEN3_8B, None, "qwen3-8b"))
    if "30b" in models:
        runs.append((QWEN3_30B_A3B, moe_layers, "qwen3-30b-a3b"))
    return runs


def param_list(m: ModelShape, layers: int | None = None) -> list[tuple[str, tuple]]:
    """Checkpoint names and shapes, in checkpoint order."""
    out: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    for i in range(m.layers if layers is None else layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, m.hidden)),
            (p + "self_attn.k_proj.weight", (kv, m.hidden)),
            (p + "self_attn.v_proj.weight", (kv, m.hidden)),
            (p + "self_attn.o_proj.weight", (m.hidden, q)),
            (p + "self_attn.q_norm.weight", (m.head_dim,)),
            (p + "self_attn.k_norm.weight", (m.head_dim,)),
        ]
        if m.experts:
            out.append((p + "mlp.gate.weight", (m.experts, m.hidden)))
            for e in range(m.experts):
                pe = f"{p}mlp.experts.{e}."
                out += [
                    (pe + "gate_proj.weight", (m.moe_intermediate, m.hidden)),
                    (pe + "up_proj.weight", (m.moe_intermediate, m.hidden)),
                    (pe + "down_proj.weight", (m.hidden, m.moe_intermediate)),
                ]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
                (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
                (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
            ]
        out += [
            (p + "input_layernorm.weight", (m.hidden,)),
            (p + "post_attention_layernorm.weight", (m.hidden,)),
        ]
    out += [("model.norm.weight", (m.hidden,)), ("lm_head.weight", (m.vocab, m.hidden))]
    return out


def nbytes_of(params: list[tuple[str, tuple]]) -> int:
    total = 0
    for _, shape in params:
        n = DTYPE.itemsize
        for s in shape:
            n *= s
        total += n
    return total


def make_tensors(params, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in params:
        t = torch.empty(shape, dtype=DTYPE, device="cuda")
        t.view(-1).uniform_(-1, 1, generator=gen)
        # A trainer's weights are module parameters.
        out[name] = torch.nn.Parameter(t, requires_grad=False)
    return out


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for i, (_, t) in enumerate(sorted(tensors.items())):
        total += t.double().sum() * ((i % 97) + 1)
    return float(total)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# --------------------------------------------------------------------------
# worker process: destinations + the landing of each mode


def _planned_worker(plan_path: str, sent: list[tuple[str, tuple]]):
    """The served tensors a baked plan writes for the names the trainer sends
    (by region qualname), and the chunk programs that land into them."""
    import gzip

    from vllm.distributed.weight_transfer.ipc.chunk_programs import ChunkPrograms
    from vllm.distributed.weight_transfer.plan.copy_exec import empty_dests
    from vllm.distributed.weight_transfer.plan.copy_table import compile_copy_table
    from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan

    opener = gzip.open if plan_path.endswith(".gz") else open
    with opener(plan_path, "rt") as f:
        plan = WorkerPlan.from_json(json.load(f))
    metas = {n: (shape, "bfloat16") for n, shape in sent}
    table = compile_copy_table(plan, metas, only_sources=metas)
    served = {
        spec.name: t
        for spec, t in zip(table.dests, empty_dests(table, "cuda"), strict=True)
    }
    programs = ChunkPrograms(plan, served, frozenset(metas))
    summary = table.summary()
    summary["unplanned_names"] = len(set(metas) - {s.name for s in table.sources})
    return programs, summary


def _verify_planned(programs, sources: dict[str, torch.Tensor]) -> dict:
    """Every planned copy of the names the trainer sent, compared bit for bit:
    the region of the served tensor against the slice the model's loader
    would take of the trainer's tensor (read through the kept mapping)."""
    from vllm.distributed.weight_transfer.plan.ops import replay_slice

    bad, checked = [], 0
    for copy in programs.plan.copies:
        source = sources.get(copy.slice.source)
        if source is None:
            continue
        region = copy.region
        served = programs.served[region.qualname]
        view = served.as_strided(
            region.shape, region.stride, served.storage_offset() + region.offset
        )
        got = view.contiguous().view(torch.int16)
        want = replay_slice(source, copy.slice).contiguous().view(torch.int16)
        checked += 1
        if not torch.equal(got, want):
            bad.append(f"{copy.slice.source} -> {region.qualname}")
    return {"copies_checked": checked, "bit_exact": not bad, "first_bad": bad[:5]}


def _left_out(covered: frozenset, views: list) -> int:
    return sum(1 for v in views if v.name not in covered)


def _worker(conn, params) -> None:
    torch.cuda.set_device(0)
    dest = {n: torch.empty(s, dtype=DTYPE, device="cuda") for n, s in params}
    from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
    from vllm.distributed.weight_transfer.ipc.chunk_programs import chunk_in_mapping
    from vllm.distributed.weight_transfer.ipc.layout_memo import (
        LayoutMemo,
        layout_fact,
    )
    from vllm.distributed.weight_transfer.ipc.reads import read_message
    from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo

    importer = BufferImporter(torch.device("cuda", 0), local_rank=0)
    last_reads = None
    layouts = LayoutMemo()
    programs = None
    names_left = 0
    # The mapped source of every name a program was bound for (to verify).
    planned_sources: dict[str, torch.Tensor] = {}
    # Set: verify each chunk's copies as soon as it lands (a packed buffer's
    # bytes are rewritten by later chunks), summing into ``verified``.
    verify_each = False
    verified = {"copies_checked": 0, "bit_exact": True, "first_bad": []}
    # Per planned message, when ``--phases`` asks: seconds from its arrival
    # to parsed, mapped, bound, launched and landed (synchronized).
    phases: list[dict[str, float]] = []
    conn.send("ready")
    while True:
        kind, payload = conn.recv()
        arrived = time.perf_counter()
        if kind == "stop":
            return
        if kind == "zero":
            for t in dest.values():
                t.zero_()
            torch.cuda.synchronize()
            conn.send("ok")
        elif kind == "checksum":
            conn.send(checksum(dest))
        elif kind == "planned_setup":
            # The planned modes run last: their served tensors replace the
            # checkpoint-shaped ones (zero and checksum then act on them).
            if programs is None:
                dest.clear()
                torch.cuda.empty_cache()
                programs, summary = _planned_worker(*payload)
                dest.update(programs.served)
            else:  # a later planned mode: same plan, programs bound anew
                planned_sources.clear()
                programs.clear()
            conn.send(summary)
        elif kind == "verify_each":
            verify_each = payload
            verified = {"copies_checked": 0, "bit_exact": True, "first_bad": []}
            conn.send("ok")
        elif kind == "verified_each":
            conn.send(verified)
        elif kind == "fork_update":
            message, land = payload
            if land == "planned":
                # As the worker engine parses: a chunk with an earlier
                # layout reuses that message's checked views.
                info = layouts.parse(json.loads(message))
            else:
                info = IPCWeightTransferUpdateInfo.from_dict(json.loads(message))
            parsed = time.perf_counter()
            # As the worker engine maps a message (a short one over kept
            # buffers reuses the last reads).
            reads = read_message(info, importer, last_reads)
            read = time.perf_counter()
            last_reads = reads if reads.kept else None
            bufs, handles = reads.buffers, reads.handles
            if land == "planned":
                # As the worker engine does for a chunk in a kept mapping:
                # the chunk's bound program, reused while its layout holds.
                assert programs is not None
                key, mapped = chunk_in_mapping(reads.mapped, bufs, info)

                def sources(names, mapped=mapped):
                    found = mapped(names)
                    planned_sources.update(found)
                    return found

                if handles[0].persistent:
                    addresses = reads.mapped.addresses
                    bound = programs.bound(key, addresses, info.names, sources)
                else:
                    # A buffer mapped anew every sync: the layout's program
                    # run from it, as the worker engine does on a GPU.
                    assert len(bufs) == 1
                    found = programs.anywhere(key[1], bufs[0], info.names, sources)
                    assert found is not None, "the buffer broke the alignment"
                    bound = found
                launching = time.perf_counter()
                bound()
                launched = time.perf_counter()
                if verify_each:
                    torch.cuda.synchronize()
                    now = _verify_planned(programs, mapped(sorted(bound.names)))
                    verified["copies_checked"] += now["copies_checked"]
                    verified["bit_exact"] &= now["bit_exact"]
                    verified["first_bad"] += now["first_bad"]
                # As the worker engine does: the names the program leaves
                # out, found once per layout.
                names_left += layout_fact(
                    info, ("left out", bound.names), partial(_left_out, bound.names)
                )
                torch.cuda.synchronize()
                landed = time.perf_counter()
                # As the worker engine does once the update commits.
                layouts.landed(info)
                layouts.commit()
                phases.append(
                    {
                        "parse": parsed - arrived,
                        "map": read - parsed,
                        "bind": launching - read,
                        "launch": launched - launching,
                        "after_launch_to_landed": landed - launched,
                        "whole": landed - arrived,
                    }
                )
                del bufs
                conn.send("ok")
                continue
            srcs, dsts = [], []
            for v in info.views():
                raw = bufs[v.buffer][v.offset : v.offset + v.nbytes]
                srcs.append(raw.view(v.dtype).view(v.shape))
                dsts.append(dest[v.name])
            if land == "foreach":  # one batched copy for the whole message
                torch._foreach_copy_(dsts, srcs)
            else:  # one copy_ per tensor
                for d, src in zip(dsts, srcs, strict=True):
                    d.copy_(src)
            torch.cuda.synchronize()
            del bufs, srcs, dsts
            if not info.packed:
                importer.close()
            conn.send("ok")
        elif kind == "fork_finish":
            # As the worker engine does: a trainer's SharedParameters buffer
            # stays mapped for the next sync, everything else is released.
            importer.close(keep_persistent=True)
            if last_reads is not None and last_reads.generation != importer.generation:
                last_reads = None
            conn.send("ok")
        elif kind == "phases":
            conn.send(list(phases))
            phases.clear()
        elif kind == "mappings":
            conn.send(importer.mappings_opened)
        elif kind == "planned_verify":
            assert programs is not None
            conn.send(_verify_planned(programs, planned_sources))
        elif kind == "programs":
            conn.send(
                {
                    "programs_bound": 0 if programs is None else programs.binds,
                    "names_not_in_programs": names_left,
                }
            )
        elif kind == "upstream_chunk":
            from packed_tensor_upstream import (
                PackedBufferImporter,
                packed_ipc_consumer,
            )

            if not hasattr(_worker, "importer"):
                _worker.importer = PackedBufferImporter()  # type: ignore[attr-defined]
            handle, names, shapes, dtype_names, sizes = payload
            for name, tensor in packed_ipc_consumer(
                handle,
                names,
                shapes,
                dtype_names,
                sizes,
                0,
                importer=_worker.importer,  # type: ignore[attr-defined]
            ):
                dest[name].copy_(tensor)
            torch.cuda.synchronize()
            conn.send("ok")
        elif kind == "upstream_finish":
            _worker.importer.close()  # type: ignore[attr-defined]
            conn.send("ok")


class PipeClient:
    """A VLLMWeightSyncClient whose update_weights lands in the worker process
    (``land``: "loop", one copy_ per tensor, or "foreach", one batched copy
    per message)."""

    def __init__(self, conn, land: str = "loop") -> None:
        self.conn = conn
        self.land = land
        self.messages = 0  # update messages carrying tensors
        # perf_counter at each update_weights call's send and reply, and
        # each finish call's start and end (``--phases``)
        self.marks: list[tuple[str, float]] = []

    def init_weight_transfer_engine(self, init_info) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.messages += 1
        self.marks.append(("update_call", time.perf_counter()))
        self.conn.send(("fork_update", (json.dumps(update_info), self.land)))
        if _reply(self.conn) != "ok":
            raise RuntimeError("worker failed")
        self.marks.append(("update_reply", time.perf_counter()))

    def finish_weight_update(self, weight_version=None) -> None:
        self.marks.append(("finish_call", time.perf_counter()))
        self.conn.send(("fork_finish", None))
        _reply(self.conn)
        self.marks.append(("finish_reply", time.perf_counter()))


WORKER_TIMEOUT_S = 120.0


def _reply(conn, timeout_s: float = WORKER_TIMEOUT_S):
    """The worker's answer; a worker that died or hangs fails the run."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the worker process did not answer within {timeout_s}s")
    return conn.recv()


def _call(conn, kind, payload=None):
    conn.send((kind, payload))
    return _reply(conn)


# --------------------------------------------------------------------------
# trainer side


def bench_d2d(
    tensors: dict[str, torch.Tensor], nbytes: int, reps: int, cap: int | None = None
) -> dict:
    """One flat device copy of ``nbytes`` and one copy per tensor. With
    ``cap`` below ``nbytes`` (a model whose two copies do not fit next to
    the worker's) the flat copy moves the same bytes as back-to-back copies
    of a ``cap``-byte buffer, and the per-tensor copy is skipped."""
    step = nbytes if cap is None else min(cap, nbytes)
    flat_src = torch.empty(step, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for start in range(0, nbytes, step):
            size = min(step, nbytes - start)
            flat_dst[:size].copy_(flat_src[:size])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    best_flat = min(times)
    del flat_src, flat_dst
    if step < nbytes:
        torch.cuda.empty_cache()
        return {
            "flat_seconds": best_flat,
            "flat_GBps": gbps(nbytes, best_flat),
            "flat_copy_bytes": step,
        }
    dst = {n: torch.empty_like(t) for n, t in tensors.items()}
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for n, src in tensors.items():
            dst[n].copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del dst
    torch.cuda.empty_cache()
    return {
        "flat_seconds": best_flat,
        "flat_GBps": gbps(nbytes, best_flat),
        "per_tensor_seconds": min(times),
        "per_tensor_GBps": gbps(nbytes, min(times)),
    }


def bench_fork(
    tensors,
    conn,
    reps: int,
    packed: bool,
    buffer_bytes: int,
    land: str = "loop",
    verify_each: bool = False,
    source=None,
    after_step: bool = False,
    **options,
) -> dict:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerInitInfo,
        IPCTrainerWeightTransferEngine,
    )

    class Source(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            yield from tensors.items()

    engine = IPCTrainerWeightTransferEngine.trainer_init(
        # The data plane alone: this pipe worker writes no receipts.
        IPCTrainerInitInfo(
            rank=0,
            packed=packed,
            packed_buffer_size_bytes=buffer_bytes,
            verify_publication=False,
            **options,
        ),
        client=(client := PipeClient(conn, land)),
        source=source if source is not None else Source(),
    )
    mapped_before = _call(conn, "mappings")
    times, peaks, steps, step_and_sync = [], [], [], []
    timeline: list[dict[str, float]] = []
    trainer_tensors = list(tensors.values())
    for _ in range(reps):
        _call(conn, "zero")
        torch.cuda.synchronize()
        if after_step:
            # The step alone: an update of every tensor, as an optimizer step
            # ends an RL trainer's step.
            t = time.perf_counter()
            torch._foreach_add_(trainer_tensors, 1.0)
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        client.marks.clear()
        t = time.perf_counter()
        if after_step:
            # The same step, left queued on the device as a trainer leaves it
            # when it calls send_weights next.
            torch._foreach_add_(trainer_tensors, 1.0)
        engine.send_weights()
        torch.cuda.synchronize()
        end = time.perf_counter()
        times.append(end - t)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        if _PHASES:
            timeline.append(_trainer_phases(t, client.marks, end))
    if after_step:
        # What the sync adds to the step (each rep's pair; the step's time
        # is taken out).
        step_and_sync = times
        times = [both - step for both, step in zip(times, steps, strict=True)]
    assert engine.last_plan is not None
    checked_meanwhile = engine.checked_while_landing
    checked: dict = {}
    if verify_each:  # one more sync, each chunk checked as it lands
        _call(conn, "verify_each", True)
        engine.send_weights()
        checked = _call(conn, "verified_each")
        _call(conn, "verify_each", False)
    engine.shutdown()
    extra: dict = {}
    if _PHASES:
        pinned = getattr(source, "pinned", None)
        extra["phases"] = {
            "trainer": timeline,
            "worker": _call(conn, "phases"),
            # the trainer's check that no parameter moved, alone
            "pinned_check_seconds": _time_each(pinned, 20) if pinned else None,
        }
    if after_step:
        extra = {
            "step_seconds": steps,
            "step_and_sync_seconds": step_and_sync,
            "seconds_are": "step and sync minus the step alone, per rep",
        }
    return {
        **checked,
        **extra,
        "seconds": min(times),
        "all_seconds": times,
        "worker_mappings_opened": _call(conn, "mappings") - mapped_before,
        "chunks": len(engine.last_plan.chunks),
        # SharedParameters: chunks in the one allocation travel as one message
        "messages_per_sync": client.messages / (reps + verify_each),
        "overlapped": engine.last_plan.overlapped,
        # syncs whose pinned source was checked while the workers landed
        "checked_while_landing": checked_meanwhile,
        "buffer_cap_bytes": buffer_bytes,
        "trainer_extra_peak_bytes": max(peaks),
        "checksum": _call(conn, "checksum"),
    }


# ``--phases``: record where each sync's time goes, trainer and worker.
_PHASES = False


def _trainer_phases(start: float, marks: list[tuple[str, float]], end: float) -> dict:
    """One sync's trainer-side timeline (seconds): until the first update
    call, in update calls (send to reply, the worker's landing included),
    between them, in the finish call, and after it until the device is idle."""
    out = {"before_first_update": 0.0, "in_updates": 0.0, "between": 0.0}
    out.update(finish=0.0, after_finish=0.0, whole=end - start)
    last = start
    for what, at in marks:
        if what == "update_call":
            key = "before_first_update" if last == start else "between"
            out[key] += at - last
        elif what == "update_reply":
            out["in_updates"] += at - last
        elif what == "finish_call":
            out["between"] += at - last
        elif what == "finish_reply":
            out["finish"] += at - last
        last = at
    out["after_finish"] = end - last
    return out


def _time_each(call: Callable[[], object], times: int) -> dict:
    """Seconds per ``call()``: min and median of ``times`` calls."""
    seconds = []
    for _ in range(times):
        t = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t)
    seconds.sort()
    return {"min": seconds[0], "median": seconds[len(seconds) // 2]}


# SharedParameters placed by the shared-params modes, with the module holding
# the placed parameters under the tensors' names (closed after the model).
_PLACED: list = []
# ``SharedParameters.place``'s segment size (``--max-segment-gib``); None:
# its default.
_MAX_SEGMENT_BYTES: int | None = None


def _holder_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``tensors`` under their own dotted
    names (a submodule per prefix), as a trainer's model holds them."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def bench_shared_params(
    tensors,
    conn,
    reps: int,
    buffer_bytes: int,
    land: str = "loop",
    plan_path: str | None = None,
    sent: list | None = None,
    pinned: bool = False,
    after_step: bool = False,
    adopt: bool = False,
    check_while_landing: bool = True,
) -> dict:
    """The trainer's tensors placed in one CUDA allocation
    (``SharedParameters``): each chunk names it, nothing is packed, and the
    worker maps it once for every sync. The first such mode places them and
    leaves ``tensors`` holding the placed tensors (same values; the originals
    are freed); later ones reuse the placement. With ``plan_path`` the worker
    first swaps its destinations for the plan's served tensors and lands
    through chunk programs (``land="planned"``). ``pinned``: the trainer sends
    with ``SharedParameters.source``, not a dict source. ``after_step``: each
    sync follows an update of every trainer tensor left queued on the device
    (``bench_fork``), and the time reported is what the sync adds to it.
    ``adopt``: the tensors are shared where they are instead
    (``SharedParameters.adopt``: each storage a segment, nothing copied),
    sent with the pinned source, and stop being shared after the mode; run
    these modes before any that place. ``check_while_landing``: the
    trainer engine's option of that name (off: the pinned source is
    checked before each short message, not while it lands)."""
    from vllm.distributed.weight_transfer.ipc.shared_params import (
        SharedParameters,
        shared_place,
    )

    result: dict = {}
    adopted = None
    if adopt:
        if shared_place(next(iter(tensors.values()))) is not None:
            raise RuntimeError("the adopt modes must run before the modes that place")
        holder = _holder_of(tensors)  # its parameters alias the tensors
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        adopted = SharedParameters.adopt(holder)
        result["adopt_seconds"] = time.perf_counter() - t
        result["adopt_extra_bytes"] = torch.cuda.memory_allocated() - before
        result["segments"] = adopted.num_segments
    elif shared_place(next(iter(tensors.values()))) is None:
        holder = _holder_of(tensors)
        # The holder's parameters alone keep the originals, so each goes
        # once placed (the dict gets the placed tensors back below).
        names = list(tensors)
        tensors.clear()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        shared = (
            SharedParameters.place(holder)
            if _MAX_SEGMENT_BYTES is None
            else SharedParameters.place(holder, max_segment_bytes=_MAX_SEGMENT_BYTES)
        )
        torch.cuda.synchronize()
        result["place_seconds"] = time.perf_counter() - t
        # Placing fills one segment at a time and frees each original once
        # copied: what it needs beyond the tensors themselves.
        result["place_extra_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        result["segments"] = shared.num_segments
        _PLACED.append((shared, holder))
        del shared
        placed = dict(holder.named_parameters())
        for name in names:
            tensors[name] = placed[name].data
        del placed
        torch.cuda.empty_cache()
    if plan_path is not None:
        result["copy_table"] = _call(conn, "planned_setup", (plan_path, sent))
    source = None
    if adopted is not None:
        source = adopted.source(holder)
    elif pinned:
        shared, holder = _PLACED[-1]
        source = shared.source(holder)
    result.update(
        bench_fork(
            tensors,
            conn,
            reps,
            True,
            buffer_bytes,
            land=land,
            source=source,
            after_step=after_step,
            check_while_landing=check_while_landing,
        )
    )
    result["first_sync_seconds"] = result["all_seconds"][0]
    if plan_path is not None:
        result.update(_call(conn, "programs"))
        result.update(_call(conn, "planned_verify"))
    if adopted is not None:
        # Stop sharing and let the next modes find the tensors unshared
        # (the trainer engine and the source hold the object in cycles).
        adopted.close()
        del adopted, source, holder
        gc.collect()
        torch.cuda.empty_cache()
    return result


def bench_packed_planned_kept(
    tensors,
    conn,
    reps: int,
    buffer_bytes: int,
    plan_path: str,
    sent: list,
    keep: bool = True,
) -> dict:
    """The planned landing bound over a packed buffer the trainer keeps: the
    placements of the shared modes are closed first, so the trainer finds
    no tensor in a shared allocation and packs every one (one copy), into
    the same buffer at every sync, which the worker keeps mapped. With
    ``keep=False`` the trainer frees its buffer after each sync (the
    default), the worker maps it anew every sync and runs each layout's
    program from it (``ChunkPrograms.anywhere``)."""
    for placed, _ in _PLACED:
        placed.close()
    result: dict = {"copy_table": _call(conn, "planned_setup", (plan_path, sent))}
    result.update(
        bench_fork(
            tensors,
            conn,
            reps,
            True,
            buffer_bytes,
            land="planned",
            verify_each=True,
            keep_packed_buffer=keep,
        )
    )
    result["first_sync_seconds"] = result["all_seconds"][0]
    result.update(_call(conn, "programs"))
    return result


def bench_upstream(tensors, conn, reps: int, buffer_bytes: int) -> dict:
    from packed_tensor_upstream import packed_ipc_producer

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    times, peaks = [], []
    for _ in range(reps):
        _call(conn, "zero")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        chunks = 0
        for chunk in packed_ipc_producer(
            iter(tensors.items()),
            uuid,
            post_iter_func=lambda item: item[1],
            buffer_size_bytes=buffer_bytes,
        ):
            _call(
                conn,
                "upstream_chunk",
                (
                    chunk.ipc_handle,
                    chunk.names,
                    chunk.shapes,
                    chunk.dtype_names,
                    chunk.tensor_sizes,
                ),
            )
            chunks += 1
        _call(conn, "upstream_finish")
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        times.append(time.perf_counter() - t)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    return {
        "seconds": min(times),
        "all_seconds": times,
        "chunks": chunks,
        "trainer_extra_peak_bytes": max(peaks),
        "checksum": _call(conn, "checksum"),
    }


def run_model(
    shape: ModelShape,
    layers: int | None,
    reps: int,
    buffer_bytes: int,
    plan_path: str | None = None,
    only: set[str] | None = None,
    d2d_cap: int | None = None,
):
    params = param_list(shape, layers)
    nbytes = nbytes_of(params)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, params), daemon=True)
    proc.start()
    # The worker sets up CUDA and its destinations first.
    ready = _reply(parent, timeout_s=300.0)
    assert ready == "ready", ready
    tensors = make_tensors(params, seed=0)
    expected = checksum(tensors)
    result: dict = {
        "model": shape.name,
        "layers": layers if layers is not None else shape.layers,
        "tensors": len(params),
        "bytes": nbytes,
        "buffer_bytes": buffer_bytes,
        "reps": reps,
    }
    result["d2d_copy"] = bench_d2d(tensors, nbytes, reps, d2d_cap)
    same = (tensors, parent, reps, True, buffer_bytes)
    modes: dict[str, tuple[Callable[..., dict], tuple, dict]] = {
        # the defaults: chunks alternate between the buffer's halves (a tensor
        # larger than a half travels alone); GPU buffers freed after each sync
        "fork_packed": (bench_fork, same, {}),
        "upstream_packed": (bench_upstream, (tensors, parent, reps, buffer_bytes), {}),
        "fork_packed_no_overlap": (bench_fork, same, {"overlap_chunks": False}),
        "fork_packed_keep_buffer": (bench_fork, same, {"keep_packed_buffer": True}),
        # twice the cap (twice upstream's memory)
        "fork_packed_2x_cap": (
            bench_fork,
            (tensors, parent, reps, True, 2 * buffer_bytes),
            {"keep_packed_buffer": True},
        ),
        "fork_unpacked": (
            bench_fork,
            (tensors, parent, reps, False, buffer_bytes),
            {},
        ),
        # the worker lands each message with one batched copy
        "fork_packed_foreach": (bench_fork, same, {"land": "foreach"}),
        # the trainer's tensors in one shared CUDA allocation, mapped once;
        # last: it moves ``tensors`` into that allocation
        "fork_shared_params": (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {},
        ),
        "fork_shared_params_foreach": (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {"land": "foreach"},
        ),
    }
    if plan_path is not None:
        # last of all: the worker's destinations become the served layout
        planned = {"land": "planned", "plan_path": plan_path, "sent": params}
        # the trainer's own storages shared where they are, nothing placed
        # (first: the shared modes below move the tensors)
        adopted = {**planned, "adopt": True}
        modes["fork_adopted_planned_pinned"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            adopted,
        )
        modes["fork_adopted_planned_pinned_after_step"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {**adopted, "after_step": True},
        )
        # the check that nothing moved made before each short message, not
        # while it lands (``check_while_landing=False``)
        modes["fork_adopted_planned_pinned_check_first"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {**adopted, "check_while_landing": False},
        )
        modes["fork_shared_params_planned"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            planned,
        )
        # the same, sent with the source that knows when nothing moved: the
        # layout's id instead of the layout, no walk of the tensors
        pinned = {**planned, "pinned": True}
        modes["fork_shared_params_planned_pinned"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            pinned,
        )
        # the same right after an optimizer-like update of every tensor that
        # the trainer leaves queued on the device (as RL steps end): the
        # host's work before the first device wait overlaps that update
        modes["fork_shared_params_planned_pinned_after_step"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {**pinned, "after_step": True},
        )
        modes["fork_shared_params_planned_pinned_check_first"] = (
            bench_shared_params,
            (tensors, parent, reps, buffer_bytes),
            {**pinned, "check_while_landing": False},
        )
        # the same with a cap above the model's size: one message per sync
        # (nothing is packed, so the cap costs no memory here); what the
        # per-chunk round trips cost
        modes["fork_shared_params_planned_one_chunk"] = (
            bench_shared_params,
            (tensors, parent, reps, 2 * nbytes),
            {"land": "planned", "plan_path": plan_path, "sent": params},
        )
        # last: they close the shared placement, so the trainer packs; the
        # default (a buffer freed after each sync), then a kept buffer
        modes["fork_packed_planned"] = (
            bench_packed_planned_kept,
            (tensors, parent, reps, buffer_bytes),
            {"plan_path": plan_path, "sent": params, "keep": False},
        )
        modes["fork_packed_planned_kept"] = (
            bench_packed_planned_kept,
            (tensors, parent, reps, buffer_bytes),
            {"plan_path": plan_path, "sent": params},
        )
    if only is not None:
        modes = {k: v for k, v in modes.items() if k in only}
    for mode, (fn, fn_args, options) in modes.items():
        try:
            r = fn(*fn_args, **options)
            r["GBps"] = gbps(nbytes, r["seconds"])
            if "bit_exact" in r:  # the planned mode: served layout, checked per copy
                r.pop("checksum")
                r["verified"] = r["bit_exact"] and r["copies_checked"] == len(params)
            else:
                r["verified"] = abs(r.pop("checksum") - expected) <= 1e-6 * abs(
                    expected
                )
        except Exception as e:  # record and go on to the next mode
            r = {"error": f"{type(e).__name__}: {e}"}
        result[mode] = r
        print(mode, json.dumps(r), flush=True)
    d2d = result["d2d_copy"]["flat_GBps"]
    flat = result["d2d_copy"]["flat_seconds"]
    upstream = result.get("upstream_packed", {}).get("GBps")
    packed = result.get("fork_packed", {}).get("seconds")
    for mode in modes:
        r = result[mode]
        if "GBps" not in r:
            continue
        r["fraction_of_d2d"] = r["GBps"] / d2d
        # The same against the flat copy, best sync and median sync (the
        # first sync, which maps and binds, left out of the median).
        timed = r["all_seconds"][1:] if len(r["all_seconds"]) > 1 else r["all_seconds"]
        r["fraction_of_device_copy"] = flat / r["seconds"]
        r["fraction_of_device_copy_median"] = flat / statistics.median(timed)
        if upstream and mode.startswith("fork"):
            r["vs_upstream_packed"] = r["GBps"] / upstream
        if packed and mode != "fork_packed" and mode.startswith("fork"):
            r["vs_fork_packed"] = packed / r["seconds"]
    if "vs_upstream_packed" in result.get("fork_packed", {}):
        result["fork_packed_vs_upstream_packed"] = result["fork_packed"][
            "vs_upstream_packed"
        ]
    parent.send(("stop", None))
    proc.join(60)
    while _PLACED:
        _PLACED.pop()[0].close()
    del tensors, modes, same
    gc.collect()  # the per-mode Source classes are freed by the cyclic GC
    torch.cuda.empty_cache()
    return result


def _plan_path(plans_dir: str | None, model: str) -> str | None:
    if plans_dir is None:
        return None
    for suffix in (".json.gz", ".json"):
        path = Path(plans_dir) / f"{model}_tp1_rank0{suffix}"
        if path.exists():
            return str(path)
    raise FileNotFoundError(f"no plan {model}_tp1_rank0.json[.gz] in {plans_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(result_path(__file__)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--buffer-gib",
        type=float,
        default=1.25,
        help="packed buffer size for both engines; upstream's must hold the "
        "largest tensor (Qwen3's 1.16 GiB embedding), the fork sizes itself",
    )
    parser.add_argument(
        "--moe-layers",
        type=int,
        default=24,
        help="decoder layers of Qwen3-30B-A3B to use (48 is the whole model; "
        "trainer and worker copies of it need about 122 GB)",
    )
    parser.add_argument("--models", default="8b,30b")
    parser.add_argument(
        "--plans-dir",
        default=None,
        help="folder of plans baked by bench_plan_scale.py --plans-dir "
        "(qwen3-8b_tp1_rank0.json[.gz], qwen3-30b-a3b_tp1_rank0.json[.gz]): "
        "adds the fork_shared_params_planned mode",
    )
    parser.add_argument(
        "--modes", default=None, help="comma-separated modes to run (default: all)"
    )
    parser.add_argument(
        "--d2d-cap-gib",
        type=float,
        default=None,
        help="measure the flat device copy as back-to-back copies of a buffer "
        "this large (for models whose two extra copies do not fit: "
        "Qwen3-30B-A3B's 48 layers); skips the per-tensor copy",
    )
    parser.add_argument(
        "--max-segment-gib",
        type=float,
        default=None,
        help="the shared modes place the trainer's tensors in segments of at "
        "most this size (default: SharedParameters' own)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="record, per sync, where the time goes on the trainer (before, "
        "in and between update calls, the finish call) and on the worker "
        "(parse, map, bind, launch, land) and time the pinned check alone",
    )
    args = parser.parse_args()
    if args.phases:
        global _PHASES
        _PHASES = True
    buffer_bytes = int(args.buffer_gib * 2**30)
    only = set(args.modes.split(",")) if args.modes else None
    if args.max_segment_gib is not None:
        global _MAX_SEGMENT_BYTES
        _MAX_SEGMENT_BYTES = int(args.max_segment_gib * 2**30)
    runs = model_runs(args.models, args.moe_layers)
    doc = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "results": [
            run_model(
                s,
                layers,
                args.reps,
                buffer_bytes,
                _plan_path(args.plans_dir, plan),
                only,
                None if args.d2d_cap_gib is None else int(args.d2d_cap_gib * 2**30),
            )
            for s, layers, plan in runs
        ],
    }
    emit_json(doc, args.out)


if __name__ == "__main__":
    main()
