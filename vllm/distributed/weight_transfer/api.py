# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's public names for trainers, in one place.

Upstream's names keep upstream's paths (``ipc_engine``, ``sharded_rdt_trainer``,
``clients``, ``factory``, the package itself); this module adds what only the
fork has, and repeats the upstream-path names a trainer script needs so that
one import serves it:

- backends' trainer settings: ``IPCTrainerInitInfo``,
  ``ShardedRDTTrainerInitInfo``;
- clients: ``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``,
  ``OfflineLLMWeightSyncClient``;
- weight sources: ``CheckpointNamesSource`` (in-memory names that are not the
  checkpoint's), ``SharedParameters`` (a trainer's parameters in shared
  allocations, for ``ipc``);
- trainer-side quantized codes: ``Fp8ChannelCodes``, ``Fp8BlockCodes``,
  ``Int8ChannelCodes``, ``Int8TensorCodes``, and ``read_static_activations``
  for a checkpoint's static activation scales;
- LoRA adapter pushes: ``LoRAAdapter``, ``LoRAPusher``, ``push_lora_adapter``,
  ``memory_path``, ``LoRASource``, ``LoRATrainerInitInfo``, and
  ``split_adapter_label`` to read a served version label.

Docs, examples and benchmarks import fork names from here; the packages
(``ipc/``, ``sharded_rdt/``, ``lora/``, ...) are the implementation.
"""

from vllm.distributed.weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    OfflineLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
)
from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters
from vllm.distributed.weight_transfer.ipc.trainer import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.lora.labels import split_adapter_label
from vllm.distributed.weight_transfer.lora.pusher import (
    LoRAAdapter,
    LoRAPusher,
    push_lora_adapter,
)
from vllm.distributed.weight_transfer.lora.trainer import (
    LoRASource,
    LoRATrainerInitInfo,
)
from vllm.distributed.weight_transfer.lora.wire import memory_path
from vllm.distributed.weight_transfer.quant.fp8 import (
    Fp8BlockCodes,
    Fp8ChannelCodes,
    read_static_activations,
)
from vllm.distributed.weight_transfer.quant.int8 import (
    Int8ChannelCodes,
    Int8TensorCodes,
)
from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
    ShardedRDTTrainerInitInfo,
)
from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

__all__ = [
    "CheckpointNamesSource",
    "Fp8BlockCodes",
    "Fp8ChannelCodes",
    "HTTPVLLMWeightSyncClient",
    "IPCTrainerInitInfo",
    "Int8ChannelCodes",
    "Int8TensorCodes",
    "LoRAAdapter",
    "LoRAPusher",
    "LoRASource",
    "LoRATrainerInitInfo",
    "OfflineLLMWeightSyncClient",
    "RayVLLMWeightSyncClient",
    "ShardedRDTTrainerInitInfo",
    "SharedParameters",
    "memory_path",
    "push_lora_adapter",
    "read_static_activations",
    "split_adapter_label",
]
