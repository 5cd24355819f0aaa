# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fork's full-resync trainer engines (``ipc``, ``sharded_rdt``)
share: upstream's ``trainer_init`` entry point (each sync resends every weight
it reads from a ``WeightSource``, so construction without one is refused up
front, naming the backend, and the rest is the engine's ``from_init_info``),
one sync on every rank (``_run_sync``: ``sync.run_sync`` with what an engine
knows of itself), and the model versions their publications carry
(``ModelVersions``)."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Self

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    TTrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.trainer.group import TrainerGroup
from vllm.distributed.weight_transfer.trainer.sync import run_sync
from vllm.distributed.weight_transfer.verification import TrainerPublication
from vllm.distributed.weight_transfer.verification.receipts import ExpectedWorkers

__all__ = ["FullResyncTrainerEngine", "ModelVersions"]


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

    # The last publication whose receipts verified (sender only).
    last_publication: TrainerPublication | None = None

    def _run_sync(
        self,
        send: Callable[[], None],
        *,
        group: TrainerGroup,
        pub: TrainerPublication | None,
        verify: bool,
        expected: Callable[[], ExpectedWorkers],
        weight_version: str | None,
        **choices: Any,
    ) -> None:
        """One sync of this rank (``sync.run_sync``): ``send`` on every rank
        of ``group``, the rest on the sender; ``last_publication`` is set
        once the receipts verified. ``choices`` are ``run_sync``'s others."""
        info: Any = self.init_info  # type: ignore[attr-defined]
        run_sync(
            self.client,
            send,
            who=f"{info.backend} trainer rank {info.rank}",
            pub=pub,
            verify=verify,
            expected=expected,
            receipt_timeout_s=info.receipt_timeout_s,
            weight_version=weight_version,
            group=group,
            is_sender=self.is_sender,
            on_verified=self._verified,
            **choices,
        )

    def _verified(self, pub: TrainerPublication) -> None:
        self.last_publication = pub

    @classmethod
    @abstractmethod
    def from_init_info(
        cls,
        init_info: TTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> Self:
        """Build (and connect) this rank's engine; every trainer rank calls it."""


class ModelVersions:
    """The model version of each publication a trainer engine opens: counting
    up from ``first`` when one is given, else the wall clock in microseconds
    and at least one more than the last. Workers refuse versions that go
    backwards, so a restarted trainer, or one resumed from an older
    checkpoint, still publishes a version they accept."""

    def __init__(self, first: int | None) -> None:
        self._explicit = first is not None
        self._next = first

    def next(self) -> int:
        if self._explicit:
            assert self._next is not None
            version = self._next
        else:
            version = max(time.time_ns() // 1000, self._next or 0)
        self._next = version + 1
        return version
