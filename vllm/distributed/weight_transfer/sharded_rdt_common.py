# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's import path for what both sharded_rdt sides share (vLLM's Ray
executor imports ``check_ray_rdt_version`` from here). The routing and
settings live in ``pull/routing.py``, the messages in ``sharded_rdt/wire.py``."""

from vllm.distributed.weight_transfer.pull.routing import (
    ALLOWED_OPS,
    DEFAULT_GATHER_LOOKAHEAD,
    DEFAULT_NUM_RDT_BUFFERS,
    DEFAULT_STALL_TIMEOUT_S,
    PRODUCE_METHOD_NAME,
    RDT_MIN_RAY_VERSION,
    SUPPORTED_OPS,
    TRANSPORTS,
    VIEW_OPS,
    RdtRouter,
    assign_producer_indices,
    buffer_alloc_bytes,
    check_ray_rdt_version,
    register_nixl_memory,
    serve_share_key,
)
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
    ShardedRDTWeightTransferUpdateInfo,
)

__all__ = [
    "ALLOWED_OPS",
    "DEFAULT_GATHER_LOOKAHEAD",
    "DEFAULT_NUM_RDT_BUFFERS",
    "DEFAULT_STALL_TIMEOUT_S",
    "PRODUCE_METHOD_NAME",
    "RDT_MIN_RAY_VERSION",
    "RdtRouter",
    "SUPPORTED_OPS",
    "ShardedRDTWeightTransferInitInfo",
    "ShardedRDTWeightTransferUpdateInfo",
    "TRANSPORTS",
    "VIEW_OPS",
    "assign_producer_indices",
    "buffer_alloc_bytes",
    "check_ray_rdt_version",
    "register_nixl_memory",
    "serve_share_key",
]
