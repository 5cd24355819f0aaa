# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mounts the RL HTTP routes on the API server (``VLLM_SERVER_DEV_MODE=1``).

The routes are upstream's router, unchanged. The fork adds
``WeightSyncMetricsMiddleware`` around them, so ``/metrics`` carries the
``vllm:weight_transfer_*`` sync metrics by default, next to upstream's
``vllm:rl_weight_update_operation_*`` metrics. The middleware reads what each
weight route was sent and answered, which is all the sync observer needs; see
``vllm.distributed.weight_transfer.serving.metrics``.

Inside it sits ``WeightUpdateGuard``: while an ``ipc`` or ``sharded_rdt``
update lands in place or commits from staging, the server holds generation
itself, ``/resume`` is refused, and an in-place update has an eager deadline;
see ``vllm.distributed.weight_transfer.serving.update_guard``.

Innermost sits ``AdapterIdGuard``: one LoRA id names one adapter, whether a
trainer pushed it or ``/v1/load_lora_adapter`` numbered it; see
``vllm.distributed.weight_transfer.serving.lora_routes``.

``GET /weight_update_status`` (``weight_update_status``) is the fork's one
added route: the serving version next to the update in flight (the staged
version, with staging on).
"""

from fastapi import FastAPI


def register_rl_api_routers(app: FastAPI) -> None:
    from vllm.distributed.weight_transfer.serving.lora_routes import AdapterIdGuard
    from vllm.distributed.weight_transfer.serving.metrics import (
        WeightSyncMetricsMiddleware,
    )
    from vllm.distributed.weight_transfer.serving.non_finite_outputs import (
        NonFiniteOutputs,
    )
    from vllm.distributed.weight_transfer.serving.update_guard import WeightUpdateGuard
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.entrypoints.rl.weight_update_status import router as status_router

    app.include_router(router)
    app.include_router(status_router)
    # The last one added runs first: the metrics see what the guard answers,
    # and the guard what the adapter id guard answers (``lora_routes``).
    app.add_middleware(NonFiniteOutputs)  # a NaN output: 500, naming the weights
    app.add_middleware(AdapterIdGuard)
    app.add_middleware(WeightUpdateGuard)
    app.add_middleware(WeightSyncMetricsMiddleware)
