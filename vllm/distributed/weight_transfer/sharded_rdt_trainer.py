# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's import path for the sharded_rdt trainer engine; the code lives in
``sharded_rdt/trainer.py``, its shared settings in ``pull/routing.py``."""

from vllm.distributed.weight_transfer.pull.routing import (
    DEFAULT_GATHER_LOOKAHEAD,
    DEFAULT_NUM_RDT_BUFFERS,
    DEFAULT_STALL_TIMEOUT_S,
    PRODUCE_METHOD_NAME,
    TRANSPORTS,
)
from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
    ShardedRDTTrainerInitInfo,
    ShardedRDTTrainerWeightTransferEngine,
    metadata_digest,
    ownership_table,
)
from vllm.distributed.weight_transfer.verification import DEFAULT_RECEIPT_TIMEOUT_S

__all__ = [
    "DEFAULT_GATHER_LOOKAHEAD",
    "DEFAULT_NUM_RDT_BUFFERS",
    "DEFAULT_RECEIPT_TIMEOUT_S",
    "DEFAULT_STALL_TIMEOUT_S",
    "PRODUCE_METHOD_NAME",
    "ShardedRDTTrainerInitInfo",
    "ShardedRDTTrainerWeightTransferEngine",
    "TRANSPORTS",
    "metadata_digest",
    "ownership_table",
]
