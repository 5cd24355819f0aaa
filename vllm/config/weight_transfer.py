# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from typing import Literal

from vllm.config.utils import config


@config
class WeightTransferConfig:
    """Selects how an RL trainer pushes fresh weights into this engine's workers."""

    backend: Literal["nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n"] | str = (
        "nccl"
    )
    """Name of the worker-side weight transfer engine. Any name registered with
    `WeightTransferEngineFactory` is accepted (plugins may register more); the name
    is resolved when the worker creates its engine, and an unknown name fails there
    with the list of registered backends.
    """

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend.strip():
            raise ValueError(
                "weight_transfer_config.backend must be a non-empty backend name, "
                f"got {self.backend!r}"
            )
