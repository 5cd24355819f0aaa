# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run the sharded_rdt planner against real vLLM model classes on CPU.

`run_planner_checks(tp_size, cases)` starts ``tp_size`` processes that form a
real tensor-parallel group (gloo), build each tiny model with vLLM's own model
loader, and check the planner on it. This needs no engine, scheduler or KV
cache, so a case costs about a second once vLLM is imported. Each rank returns a
plain `CaseReport` per case; tests assert on those.

What a case checks, on one rank:

* the bake leaves every parameter and buffer object, its value and its
  ``weight_loader`` exactly as before (twice, with equal digests);
* landing the plan the way a sync does (`land_chunks`: the pull plan of one
  consumer, each chunk packed by the producer's ``pack_chunk`` and landed by
  the engine's ``ChunkLander``) fills the checkpoint-format parameters exactly
  as ``model.load_weights`` of the same tensors does. Both run inside the same
  meta-restored session with every tensor pre-filled with a sentinel, so a
  region either path misses shows up. (On CPU, kernel formats live in oneDNN
  handles rather than parameters, and the processing that produces them is the
  same code on the same input, so the checkpoint format is where the two paths
  can differ; the lander's module steps are therefore ``IN_PLACE`` here, and
  the in-engine test covers the layerwise reload ones.)
* how many bytes ``load_weights`` fills, against the plan's byte count;
* baking without one QKV input reports ``qkv_proj`` as partly covered;
* the plan baked again on the same model class built on the meta device
  (`build_meta_model`, no storage at all), for the comparison of the two plans.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.weight_transfer.testing.multirank import free_port
from vllm.distributed.weight_transfer.testing.tiny_models import (
    TinyModelSpec,
    build_tiny_model,
)

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan
    from vllm.distributed.weight_transfer.pull.routing import RdtRouter
    from vllm.distributed.weight_transfer.sharded_rdt.lander import ModuleSteps

_SENTINEL_FLOAT = -1234.5
_SENTINEL_INT = 77


@dataclass(frozen=True)
class PlannerCase:
    """One model to check: the tiny model of ``arch`` served in ``dtype``."""

    arch: str
    dtype: str


@dataclass
class CaseReport:
    arch: str
    dtype: str
    rank: int
    tp_size: int
    digest: str = ""
    second_digest: str = ""
    bake_seconds: float = 0.0
    restore_mismatches: list[str] = field(default_factory=list)
    landing_mismatches: list[str] = field(default_factory=list)
    compared_tensors: int = 0
    plan_nbytes: int = 0
    filled_nbytes: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    full_bytes_by_source: dict[str, int] = field(default_factory=dict)
    unused_names: list[str] = field(default_factory=list)
    partial_modules: list[str] = field(default_factory=list)
    incomplete_error: str = ""
    dump: str = ""
    meta_digest: str = ""
    meta_dump: str = ""
    meta_param_devices: list[str] = field(default_factory=list)
    meta_model_real_buffers: list[str] = field(default_factory=list)
    error: str = ""


def run_planner_checks(
    tp_size: int,
    cases: Sequence[PlannerCase],
    timeout_s: float = 400.0,
) -> list[list[CaseReport]]:
    """Reports per rank, then per case (``result[rank][case]``)."""
    import multiprocessing

    folders = [str(build_tiny_model(TinyModelSpec(arch=c.arch))) for c in cases]  # type: ignore[arg-type]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, tp_size, port, list(cases), folders, queue),
            daemon=True,
        )
        for rank in range(tp_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, list[dict[str, Any]]] = {}
    try:
        for _ in procs:
            rank, payload = queue.get(timeout=timeout_s)
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [[CaseReport(**r) for r in results[rank]] for rank in range(tp_size)]


def _rank_main(
    rank: int,
    tp_size: int,
    port: int,
    cases: list[PlannerCase],
    folders: list[str],
    queue: Any,
) -> None:
    reports: list[dict[str, Any]] = []
    try:
        # The CPU communicator names its shared-memory segments after this id,
        # which a CPU worker sets; one id per group keeps runs apart.
        os.environ["VLLM_DIST_IDENT"] = f"sharded-rdt-checks-{port}"
        torch.set_num_threads(1)
        # vLLM creates the expert-parallel group only for an MoE config.
        moe = [f for c, f in zip(cases, folders, strict=True) if "moe" in c.arch]
        _init_distributed(rank, tp_size, port, (moe or folders)[0])
        for case, folder in zip(cases, folders, strict=True):
            report = CaseReport(case.arch, case.dtype, rank, tp_size)
            try:
                _check_case(report, folder, tp_size)
            except Exception:
                report.error = traceback.format_exc()
            reports.append(dataclasses.asdict(report))
    except Exception:
        reports = [
            dataclasses.asdict(
                CaseReport(c.arch, c.dtype, rank, tp_size, error=traceback.format_exc())
            )
            for c in cases
        ]
    finally:
        _shutdown_distributed()
    queue.put((rank, reports))


def _shutdown_distributed() -> None:
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    try:
        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # teardown of a group that failed to start
        traceback.print_exc()


def _init_distributed(rank: int, tp_size: int, port: int, folder: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    # CPU workers make accelerator calls no-ops; model loading relies on it.
    _set_torch_accelerator_to_noop()
    with set_current_vllm_config(_engine_config(folder, "float32", tp_size)):
        init_distributed_environment(
            world_size=tp_size,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=tp_size)


def _engine_config(folder: str, dtype: str, tp_size: int):
    from vllm.distributed.weight_transfer.testing.tiny_engine import TINY_ENGINE_ARGS
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=folder,
        dtype=dtype,  # type: ignore[arg-type]
        tensor_parallel_size=tp_size,
        skip_tokenizer_init=True,
        **TINY_ENGINE_ARGS,
    ).create_engine_config()


def _build_model(folder: str, dtype: str, tp_size: int):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    config = _engine_config(folder, dtype, tp_size)
    with set_current_vllm_config(config):
        model = get_model(vllm_config=config)
    return model, config


def build_meta_model(folder: str, dtype: str, tp_size: int):
    """The model class of ``folder`` built by vLLM (``initialize_model``) with
    every parameter and buffer on the meta device: no storage and no weights
    read, so a full-size config costs what its module objects cost. Needs the
    tensor-parallel group of ``tp_size`` ranks, like `_build_model`."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = _engine_config(folder, dtype, tp_size)
    with (
        set_current_vllm_config(config),
        set_default_torch_dtype(config.model_config.dtype),
        torch.device("meta"),
    ):
        model = initialize_model(vllm_config=config)
    return model, config


def checkpoint_tensors(
    folder: str, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Fresh seeded values for every tensor of the folder's checkpoint, in the
    order a trainer would list them: embeddings, layers, then the rest."""
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118

    def order(name: str) -> int:
        if "embed" in name:
            return 0
        return 1 if any(part.isdigit() for part in name.split(".")) else 2

    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shapes[name], generator=gen).to(dtype)
        for name in sorted(shapes, key=order)
    }


def _resident_state(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    state: dict[str, tuple[Any, ...]] = {}
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                key = f"{module_name}.{name}"
                if tensor is None:
                    state[key] = (None,)
                    continue
                state[key] = (
                    tensor,
                    tensor.detach().clone(),
                    vars(tensor).get("weight_loader"),
                )
    return state


def _state_mismatches(
    before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]
) -> list[str]:
    problems = [f"{k}: slot added or removed" for k in before.keys() ^ after.keys()]
    for key in before.keys() & after.keys():
        old, new = before[key], after[key]
        if old[0] is None or new[0] is None:
            if old[0] is not new[0]:
                problems.append(f"{key}: None-ness changed")
            continue
        if old[0] is not new[0]:
            problems.append(f"{key}: different tensor object")
        if not torch.equal(old[1], new[1]):
            problems.append(f"{key}: value changed")
        if old[2] is not new[2]:
            problems.append(f"{key}: weight_loader changed")
    return sorted(problems)


def load_checkpoint_format(
    model: torch.nn.Module, fill: Callable[[], None]
) -> dict[str, torch.Tensor]:
    """Run ``fill`` against sentinel-filled checkpoint-format parameters (the
    ones layerwise reload materializes) and return a copy of all of them; the
    model is restored afterwards."""
    from vllm.distributed.weight_transfer.plan.bake import (
        checkpoint_format_session,
    )
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
    )
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad(), checkpoint_format_session(model):
        filled: dict[str, torch.Tensor] = {}
        for module_name, module in model.named_modules():
            for name, tensor in list(module.named_parameters(recurse=False)) + list(
                module.named_buffers(recurse=False)
            ):
                if not tensor.is_meta:
                    continue
                real = materialize_meta_tensor(tensor)
                real.fill_(
                    _SENTINEL_FLOAT if real.is_floating_point() else _SENTINEL_INT
                )
                real.weight_loader = _get_original_loader(tensor)  # type: ignore[attr-defined]
                setattr(module, name, real)
                filled[f"{module_name}.{name}"] = real
        fill()
        for key, tensor in filled.items():
            out[key] = tensor.detach().clone()
    return out


def land_chunks(
    model: torch.nn.Module,
    plan: WorkerPlan,
    tensors: dict[str, torch.Tensor],
    steps: ModuleSteps | None = None,
    router: RdtRouter | None = None,
) -> None:
    """Land ``plan`` in ``model`` from ``tensors`` through the production path
    of one sync: the pull plan of consumer 0 under ``router`` (default: a lone
    producer and a lone consumer), each chunk packed by the producer's
    ``pack_chunk`` and landed, in order, by the engine's ``ChunkLander`` with
    ``steps``."""
    from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
    from vllm.distributed.weight_transfer.pull.producer import pack_chunk
    from vllm.distributed.weight_transfer.pull.routing import RdtRouter
    from vllm.distributed.weight_transfer.sharded_rdt.lander import ChunkLander

    pulls = build_pull_plan(plan, router or RdtRouter(1, 1), consumer_id=0)
    lander = ChunkLander(model, plan, pulls, steps)
    lander.begin()
    for index, chunk in enumerate(pulls.chunks):
        data = torch.empty(chunk.nbytes, dtype=torch.uint8)
        pack_chunk(chunk, tensors, data)
        lander.land(index, data)


def _filled_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    total = 0
    for tensor in tensors.values():
        sentinel = _SENTINEL_FLOAT if tensor.is_floating_point() else _SENTINEL_INT
        total += int((tensor != sentinel).sum()) * tensor.element_size()
    return total


def _check_case(report: CaseReport, folder: str, tp_size: int) -> None:
    import time

    from vllm.distributed.weight_transfer.base import ParamMeta
    from vllm.distributed.weight_transfer.plan.bake import (
        IncompletePlanError,
        bake_worker_plan,
    )
    from vllm.distributed.weight_transfer.sharded_rdt.lander import IN_PLACE

    dtype = getattr(torch, report.dtype)
    model, config = _build_model(folder, report.dtype, tp_size)
    checkpoint = checkpoint_tensors(folder, dtype, seed=1234)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in checkpoint.items()]
    worker = f"{report.arch}/{report.dtype}/tp{report.rank}of{tp_size}"

    before = _resident_state(model)
    started = time.perf_counter()
    plan = bake_worker_plan(model, metas, worker=worker, vllm_config=config)
    report.bake_seconds = time.perf_counter() - started
    report.restore_mismatches = _state_mismatches(before, _resident_state(model))
    report.second_digest = bake_worker_plan(
        model, metas, worker=worker, vllm_config=config
    ).digest()
    report.digest = plan.digest()
    report.dump = plan.dump()
    report.plan_nbytes = plan.nbytes
    report.bytes_by_source = plan.bytes_by_source()
    report.full_bytes_by_source = {
        n: t.numel() * t.element_size() for n, t in checkpoint.items()
    }
    report.unused_names = list(plan.unused_names)

    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        loaded = load_checkpoint_format(
            model,
            lambda: model.load_weights(iter(checkpoint.items())),
        )
        landed = load_checkpoint_format(
            model, lambda: land_chunks(model, plan, checkpoint, IN_PLACE)
        )
    report.compared_tensors = len(loaded)
    report.landing_mismatches = sorted(
        key
        for key in loaded.keys() | landed.keys()
        if key not in loaded
        or key not in landed
        or not torch.equal(loaded[key].view(-1), landed[key].view(-1))
    )
    report.filled_nbytes = _filled_nbytes(loaded)

    dropped = "model.layers.0.self_attn.k_proj.weight"
    partial_metas = [m for m in metas if m.name != dropped]
    partial_plan = bake_worker_plan(
        model, partial_metas, worker=worker, vllm_config=config, allow_partial=True
    )
    report.partial_modules = [p.describe() for p in partial_plan.partial_modules]
    try:
        bake_worker_plan(model, partial_metas, worker=worker, vllm_config=config)
    except IncompletePlanError as err:
        report.incomplete_error = str(err)
    report.restore_mismatches += _state_mismatches(before, _resident_state(model))
    _bake_on_meta(report, folder, tp_size, metas, worker)


def _bake_on_meta(
    report: CaseReport,
    folder: str,
    tp_size: int,
    metas: list[Any],
    worker: str,
) -> None:
    """Bake this rank's plan again on a meta-built model (no weight storage)."""
    from vllm.distributed.weight_transfer.plan.bake import bake_worker_plan

    meta_model, meta_config = build_meta_model(folder, report.dtype, tp_size)
    report.meta_param_devices = sorted({str(t.device) for t in meta_model.parameters()})
    # vLLM caches rotary-embedding modules by their settings (``get_rope``), so
    # the meta model reuses the loaded model's, buffer included.
    report.meta_model_real_buffers = sorted(
        name for name, t in meta_model.named_buffers() if not t.is_meta
    )
    meta_plan = bake_worker_plan(
        meta_model, metas, worker=worker, vllm_config=meta_config
    )
    report.meta_digest = meta_plan.digest()
    report.meta_dump = meta_plan.dump()


# Worker-side steps for a real engine, sent with ``LLM.collective_rpc`` (which
# needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to ship a function). Each receives
# the worker and returns plain data.


def _worker_checkpoint(worker: Any, seed: int | None) -> dict[str, torch.Tensor]:
    """The engine's own checkpoint (``seed=None``) or seeded fresh values of
    the same names and shapes, in the engine's dtype."""
    model_config = worker.vllm_config.model_config
    folder = model_config.model
    if seed is not None:
        return checkpoint_tensors(folder, model_config.dtype, seed)
    from safetensors.torch import load_file

    loaded = load_file(os.path.join(folder, "model.safetensors"))
    order = checkpoint_tensors(folder, model_config.dtype, 0)
    return {name: loaded[name].to(model_config.dtype) for name in order}


def worker_bake(worker: Any) -> dict[str, Any]:
    """Bake this worker's plan, keep it on the worker, and report on it."""
    from vllm.distributed.weight_transfer.base import ParamMeta
    from vllm.distributed.weight_transfer.plan.bake import bake_worker_plan

    model = worker.model_runner.model
    checkpoint = _worker_checkpoint(worker, seed=None)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in checkpoint.items()]
    before = _resident_state(model)
    plan = bake_worker_plan(
        model, metas, worker=f"rank{worker.rank}", vllm_config=worker.vllm_config
    )
    worker.sharded_rdt_test_plan = plan
    return {
        "digest": plan.digest(),
        "nbytes": plan.nbytes,
        "restore_mismatches": _state_mismatches(before, _resident_state(model)),
    }


def worker_update(worker: Any, seed: int | None, via_plan: bool) -> None:
    """One weight update through the worker's production landing path: a
    ``LayerwiseReloadSession`` fed either by the baked plan (`land_chunks`,
    with the lander's default layerwise reload steps) or by ``load`` of the
    same checkpoint tensors (``model.load_weights``, the reference)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.landing.layerwise import (
        LayerwiseReloadSession,
    )

    model = worker.model_runner.model
    checkpoint = _worker_checkpoint(worker, seed)
    session = LayerwiseReloadSession(model, worker.vllm_config.model_config)
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        session.start()
        if via_plan:
            session.begin_landing()
            land_chunks(model, worker.sharded_rdt_test_plan, checkpoint)
        else:
            session.load(list(checkpoint.items()))
        session.finish()
