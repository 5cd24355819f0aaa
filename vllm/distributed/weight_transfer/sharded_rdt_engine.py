# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's import path for the sharded_rdt worker engine; the code lives in
``sharded_rdt/worker.py`` (engine), ``sharded_rdt/consumer.py`` (transport
choice and consumer plan) and ``sharded_rdt/wire.py`` (messages)."""

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

__all__ = [
    "ShardedRDTWeightTransferEngine",
    "ShardedRDTWeightTransferInitInfo",
    "ShardedRDTWeightTransferUpdateInfo",
    "choose_transport",
    "make_consumer_transport",
    "planned_bytes",
]
