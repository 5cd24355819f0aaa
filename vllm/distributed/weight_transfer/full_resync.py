# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer-side entry point shared by the fork's full-resync engines
(``ipc``, ``sharded_rdt``): each sync resends every weight it reads from a
``WeightSource``, so construction without one is refused up front, naming
the backend, and the rest is the engine's ``from_init_info``."""

from __future__ import annotations

from abc import abstractmethod
from typing import Self

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    TTrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
)


class FullResyncTrainerEngine(TrainerWeightTransferEngine[TTrainerInitInfo]):
    """Upstream's ``trainer_init`` contract, with the source check in one
    place; subclasses implement ``from_init_info``."""

    @classmethod
    def trainer_init(
        cls,
        init_info: TTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(
                f"the {init_info.backend} trainer engine requires a WeightSource: "
                "it needs source= (e.g. ModuleSource(model)) at trainer_init"
            )
        return cls.from_init_info(init_info, client, source)

    @classmethod
    @abstractmethod
    def from_init_info(
        cls,
        init_info: TTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> Self:
        """Build (and connect) this rank's engine; every trainer rank calls it."""
