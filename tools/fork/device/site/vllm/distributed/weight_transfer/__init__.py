# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-in package init for running the fork's weight-transfer data planes on a
machine without vLLM: the package spans every ``vllm/distributed/weight_transfer``
folder on sys.path (the repo's, and the carried upstream base module) and
re-exports the names the package's real ``__init__`` exports."""

import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ModuleSource,
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)

__all__ = [
    "ModuleSource",
    "ParamMeta",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferEngine",
]
