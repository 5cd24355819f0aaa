# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fork's full-resync trainer engines (``ipc``, ``sharded_rdt``)
share: upstream's ``trainer_init`` entry point (each sync resends every weight
it reads from a ``WeightSource``, so construction without one is refused up
front, naming the backend, and the rest is the engine's ``from_init_info``),
the model versions their publications carry (``ModelVersions``), a
publication's life around one sync (``_publishing``, ``_verify_publication``):
any failure fences the served version, and the commit (``commit_update``)
comes only after every receipt verified.

The end of every sync, after the last weight was sent::

    verified: update_weights({"prepare": publication_id})  ; receipts written
              verify every expected worker's receipt         ; nothing committed
    commit_update(client, weight_version):
        pause_generation("keep")   if the client can and generation runs
        finish_weight_update(weight_version)                  ; the commit
        reset_prefix_cache(reset_running_requests=True)       ; if the client can
        resume_generation()        if it paused

Against the fork's ``vllm serve`` (``client.server_holds_commit``) the server
does the pause, the reset and the resume within the finish request itself
(``update_guard``), so the commit is that one call and a trainer that dies
during it cannot leave generation paused.

Holding generation for just the commit puts the switch, the version label and
the cache reset between the same two engine steps: every output token is
labelled with the weights that produced it, and no request after the switch
reads KV computed by the old weights (running requests are recomputed)."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, Self

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    TTrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.verification import (
    ABORT_FIELD,
    PREPARE_FIELD,
    TrainerPublication,
)
from vllm.distributed.weight_transfer.verification.receipts import ExpectedWorkers
from vllm.logger import init_logger

logger = init_logger(__name__)


def abort_update(client: VLLMWeightSyncClient, reason: str) -> None:
    """Best effort: close the open update on the server with the trainer's
    abort message, then the finish vLLM's Worker needs to close it. A staged
    update is dropped; an in-place one is fenced if weights had landed."""
    for method, args in (
        ("update_weights", ({ABORT_FIELD: reason[:2000]},)),
        ("finish_weight_update", ()),
    ):
        try:
            getattr(client, method)(*args)
        except Exception as e:  # the server may have aborted on its own
            logger.debug("abort: %s raised %s", method, e)


def commit_update(client: VLLMWeightSyncClient, weight_version: str | None) -> None:
    """Finish the open update with generation held for just this call (when
    the client can hold it and nobody else did), then drop the KV cache the
    old weights computed; see the module docstring."""
    if getattr(client, "server_holds_commit", False):
        # The fork's server holds generation around the finish and drops the
        # old KV cache within the same request (update_guard).
        client.finish_weight_update(
            *(() if weight_version is None else (weight_version,))
        )
        return
    hold = _can_hold(client)
    try:
        if hold:
            client.pause_generation(mode="keep")  # type: ignore[attr-defined]
        # Upstream's clients take the version at finish; without one, the
        # call has upstream's bare form.
        client.finish_weight_update(
            *(() if weight_version is None else (weight_version,))
        )
        reset = getattr(client, "reset_prefix_cache", None)
        if callable(reset):
            try:
                reset(reset_running_requests=True)
            except NotImplementedError as e:  # an actor class without it
                logger.warning("the KV cache of the old weights stays: %s", e)
    finally:
        if hold:
            _resume(client)


def _resume(client: Any) -> None:
    """Resume generation; once more if the first call fails (a pause left in
    place would hold generation for ever, and the next commit would take it
    for someone else's)."""
    try:
        client.resume_generation()
    except Exception as e:
        logger.warning("resume_generation failed (%s); trying once more", e)
        client.resume_generation()


def _can_hold(client: Any) -> bool:
    """Whether the commit should hold generation: the client can, and nobody
    else paused it (whoever did resumes it)."""
    if not callable(getattr(client, "pause_generation", None)):
        return False
    try:
        return not client.is_paused()
    except NotImplementedError as e:  # an actor class without the methods
        logger.warning("committing without holding generation: %s", e)
        return False


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
        self,
        pub: TrainerPublication | None,
        expected: Callable[[], ExpectedWorkers] | None = None,
    ) -> Iterator[TrainerPublication | None]:
        """One sync's publication (None when unverified or not the sender):
        any failure inside sets the served version to ``fenced:...``, unless
        every worker of ``expected()`` reported that it kept its weights (a
        staged update); the publication is closed at the end."""
        try:
            yield pub
        except BaseException as e:
            if pub is not None:
                workers: ExpectedWorkers | None = None
                if expected is not None:
                    try:
                        workers = expected()
                    except Exception as why:  # the server may be gone
                        logger.debug("expected workers unknown: %s", why)
                pub.fail(self.client, e, workers)
            raise
        finally:
            if pub is not None:
                pub.close()

    def _verify_publication(
        self,
        pub: TrainerPublication,
        expected: Collection[int] | int,
        timeout_s: float,
        **verify_options: Any,
    ) -> None:
        """Ask every worker to prepare (check and write its receipt), then
        verify every expected worker's receipt; nothing is committed yet."""
        self.client.update_weights({PREPARE_FIELD: pub.header.publication_id})
        pub.verify(expected, timeout_s=timeout_s, **verify_options)
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
