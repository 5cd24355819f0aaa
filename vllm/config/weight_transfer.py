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
    `WeightTransferEngineFactory` is accepted (plugins may register more). As in
    upstream, the name is checked only when the worker creates its engine; an
    unknown or empty name fails there, with the list of registered backends.
    """

    update_timeout_s: float = 600.0
    """How long an open weight update (``ipc``, ``sharded_rdt``) may go without
    a message from the trainer. The worker checks it at the update's next call:
    past it, the update is aborted (layers that did not complete go back to
    their previous weights; the engine is fenced if any weight had landed) and
    the call fails with the reason. A trainer that starts a new sync abandons
    such an update by itself.
    """

    def __post_init__(self) -> None:
        if not self.update_timeout_s > 0:
            raise ValueError(
                "weight_transfer_config.update_timeout_s must be a positive number "
                f"of seconds, got {self.update_timeout_s!r}"
            )
