# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's import path for the sharded_rdt worker engine; the code lives in
``sharded_rdt/worker.py`` (engine), ``sharded_rdt/consumer.py`` (transport
choice and consumer plan) and ``sharded_rdt/wire.py`` (messages)."""

from vllm.distributed.weight_transfer.common.wire_fields import dtype_from_name
from vllm.distributed.weight_transfer.sharded_rdt.consumer import (
    choose_transport,
    make_consumer_transport,
    planned_bytes,
)
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
    ShardedRDTWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.sharded_rdt.worker import (
    ShardedRDTWeightTransferEngine,
)

# upstream 0.32's tests import the dtype lookup under this private name
_dtype_from_name = dtype_from_name

__all__ = [
    "ShardedRDTWeightTransferEngine",
    "ShardedRDTWeightTransferInitInfo",
    "ShardedRDTWeightTransferUpdateInfo",
    "choose_transport",
    "make_consumer_transport",
    "planned_bytes",
]
