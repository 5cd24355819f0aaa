# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a worker's served linear layers hold, for ``collective_rpc`` in tests
of ``WeightTransferConfig.cpu_linear``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.buffers.handles import ShmHandle


def linear_layer_states(worker: Any) -> dict[str, dict[str, Any]]:
    """For ``collective_rpc``: per linear layer of the served model, whether
    it keeps a plain weight tensor (its element count), whether it runs
    torch's linear, and whether its post-load processing keeps the loaded
    bytes (tried on a copy under the engine's config)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.landing.cpu_linear import (
        post_load_keeps_bytes,
    )
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.model
    states: dict[str, dict[str, Any]] = {}
    with set_current_vllm_config(worker.vllm_config):
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            linear = getattr(module, "cpu_linear", None)
            weight: Any = module.weight
            states[name] = {
                "weight_numel": int(weight.numel()),
                "plain": getattr(linear, "__name__", "") == "_plain_linear",
                "keeps_bytes": post_load_keeps_bytes(module),
            }
    return states


def planned_landing_state(worker: Any) -> dict[str, Any]:
    """For ``collective_rpc``: the worker's planned landing
    (``WeightTransferConfig.landing="planned"``), ``{"refused": why}`` when
    the model's loaders could not be planned, or ``{}`` when it has none:
    the names and bytes that land straight in served tensors, and the modules
    left to the layerwise reload with the reason."""
    engine = worker.weight_transfer_engine
    plan = getattr(engine, "landing_plan", None)
    if plan is None:
        refused = getattr(engine, "landing_refused", None)
        return {} if refused is None else {"refused": refused}
    return {
        "direct_names": sorted(plan.direct_names),
        "direct_bytes": plan.direct_bytes,
        "reloaded": dict(plan.reloaded),
        "still_bound": plan.still_bound(),
    }


def chunk_program_state(worker: Any) -> dict[str, int]:
    """For ``collective_rpc``: the bound copy programs an ``ipc`` worker keeps
    for chunks it reads from a kept mapping (``chunk_programs``): how many it
    holds, how many it bound since its landing plan was baked, how many times
    it ran one again without binding, and how many checkpoint names they
    land; ``{}`` without any."""
    programs = getattr(worker.weight_transfer_engine, "chunk_programs", None)
    if programs is None:
        return {}
    return {
        "programs": len(programs),
        "binds": programs.binds,
        "reused": programs.reused,
        "names": programs.names_bound(),
    }


def short_messages(worker: Any) -> int:
    """For ``collective_rpc``: how many update messages an ``ipc`` worker
    parsed in their short form (a layout id it parsed before, and a handle:
    ``LayoutMemo``)."""
    layouts = getattr(worker.weight_transfer_engine, "layouts", None)
    return 0 if layouts is None else layouts.compact


def kept_shared_segments(worker: Any) -> list[str]:
    """For ``collective_rpc``: names of the shared-memory segments an ``ipc``
    worker keeps mapped between updates (a trainer's ``SharedParameters``, or
    the packed buffer it keeps)."""
    importer = getattr(worker.weight_transfer_engine, "_importer", None)
    if importer is None:
        return []
    return sorted(
        handle.name
        for handle in importer.kept()
        if isinstance(handle, ShmHandle) and handle.persistent
    )
