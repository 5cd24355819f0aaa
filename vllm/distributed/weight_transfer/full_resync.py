# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fork's full-resync trainer engines (``ipc``, ``sharded_rdt``)
share: upstream's ``trainer_init`` entry point (each sync resends every weight
it reads from a ``WeightSource``, so construction without one is refused up
front, naming the backend, and the rest is the engine's ``from_init_info``),
the model versions their publications carry (``ModelVersions``), and a
publication's life around one sync (``_publishing``, ``_commit_publication``):
any failure fences the served version, success stamps ``weight_version`` only
after every receipt verified."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, Self

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    TTrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.verification import (
    TrainerPublication,
    set_served_version,
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

    # The last publication whose receipts verified (sender only).
    last_publication: TrainerPublication | None = None

    @contextmanager
    def _publishing(
        self, pub: TrainerPublication | None
    ) -> Iterator[TrainerPublication | None]:
        """One sync's publication (None when unverified or not the sender):
        any failure inside sets the served version to ``fenced:...``, and the
        publication is closed at the end."""
        try:
            yield pub
        except BaseException as e:
            if pub is not None:
                pub.fail(self.client, e)
            raise
        finally:
            if pub is not None:
                pub.close()

    def _commit_publication(
        self,
        pub: TrainerPublication,
        expected: Collection[int] | int,
        weight_version: str | None,
        timeout_s: float,
        **verify_options: Any,
    ) -> None:
        """Verify every expected worker's receipt, then make
        ``weight_version`` the served version."""
        pub.verify(expected, timeout_s=timeout_s, **verify_options)
        self.last_publication = pub
        if weight_version is not None:
            set_served_version(self.client, weight_version)

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
