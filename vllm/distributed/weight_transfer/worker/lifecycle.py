# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The update lifecycle of a worker engine that lands checkpoint-format
tensors through vLLM's layerwise reload (``ipc``, ``sharded_rdt``), written
once so every backend keeps the same invariant: after any request the served
model is the old weights, the new weights, or fenced with a reason.

``LayerwiseWorkerEngine`` owns the ``LayerwiseReloadSession`` and the
``WorkerPublication`` (fence, manifest checks, receipts) of the open update:

- ``start_weight_update`` opens a session (the model is touched only when
  the first weights arrive) and starts a publication.
- ``update_weights`` reads its message's kind through
  ``common.messages.message_kind``, the rule the API server's guard and
  metrics use. ``{"abort": reason}`` closes the update (the next finish then
  closes quietly; any other message before it is refused naming the abort's
  reason). Any other message is refused before anything
  changes when no update is open or the engine is fenced; otherwise its
  publication header is checked and the backend's ``receive_weights`` moves
  and lands the bytes. Any failure aborts the session (layers that did not
  complete go back to their weights), lets the backend clean up
  (``_on_update_failed``) and fails the publication: the engine is fenced
  when a weight had already landed (``_mark_landed``), and the error is never
  blank.
- ``update_weights`` with ``{"prepare": publication_id}`` (the trainer sent
  every weight): the worker checks what it holds and writes its receipt
  before anything is committed, so the trainer can verify every worker of
  every engine before any of them commits. A refusal fails the update.
- ``finish_weight_update`` completes the session and commits the
  publication (its receipt, unless ``prepare`` wrote it); a failure fences.
  A fenced engine refuses it and says how to recover.

Staging (``WeightTransferConfig.staging`` other than ``"off"``): the session
is a ``StagedUpdate`` instead. The bytes go to memory the worker owns, the
model keeps serving the old weights through the whole transfer, and
``finish_weight_update`` commits them in one call after the checks. Any
failure before the commit (a refused message, the deadline, the trainer's
abort, a failed prepare or pre-commit check) drops the staging and leaves the
engine unfenced; only a failure inside the commit fences.

The rule for ``finish_weight_update`` after a failed update (tested for both
backends in ``tests/distributed/weight_transfer/worker/test_lifecycle.py``):
when nothing had landed, the update is already closed and finish returns
quietly, the model untouched; when a weight had landed, the engine is fenced and
finish raises ``WeightsFencedError`` naming the reason and the way out (an abort
message, then finish, then a full update); after the trainer's abort message
finish closes quietly either way.

Messages of a kind a feature registered (``worker.handlers``) go to that
kind's handler instead of ``receive_weights``, after the same checks (not
aborted, not prepared, fence open). The handler keeps its own state, reads
the tensors its messages carry in a trainer's buffers through the backend's
``carried_tensors`` (None: the backend maps no trainer's buffers), names the
publication header a prepare message must carry while its push is open, and
is told when the update prepares, commits, fails or ends.

Backends implement ``_make_publication`` and ``receive_weights`` (which
lands through ``_session_for`` and calls ``_mark_landed`` before the first
weight reaches the model; with staging, ``_session_for`` returns the
``StagedUpdate`` and ``_mark_landed`` changes nothing), and may hook ``_on_start``,
``_on_new_publication``, ``_on_update_failed``, ``_on_committed`` and
``_on_update_closed``;
``_on_init`` sets up a backend's own state, once, when the engine is made.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TInitInfo,
    TUpdateInfo,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.common.messages import (
    MessageKind,
    message_kind,
    worker_index,
)
from vllm.distributed.weight_transfer.landing.layerwise import (
    LayerwiseReloadSession,
    refuse_unreloadable_layers,
    unreloadable_layers,
)
from vllm.distributed.weight_transfer.verification import (
    WeightsFencedError,
    WeightState,
    WorkerPublication,
    abort_reason,
    describe_error,
    fenced_message,
    is_prepare_request,
)
from vllm.distributed.weight_transfer.worker.handlers import (
    CarriedTensors,
    MessageHandler,
    handles,
    make_handler,
)
from vllm.distributed.weight_transfer.worker.kv_scrub import zero_non_finite_kv
from vllm.distributed.weight_transfer.worker.staged import (
    StagedUpdate,
    check_staging_fits_at_start,
)
from vllm.distributed.weight_transfer.worker.staging_pool import StagingPool
from vllm.logger import init_logger

logger = init_logger(__name__)

UpdateSession = LayerwiseReloadSession | StagedUpdate


class LayerwiseWorkerEngine(WeightTransferEngine[TInitInfo, TUpdateInfo]):
    """See the module docstring."""

    # Names the backend in errors and logs.
    backend_name: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session: UpdateSession | None = None
        # What the last staged commit did (``StagedUpdate.committed``).
        self.last_staged_commit: dict[str, int] = {}
        # Staging buffers kept from one staged update to the next.
        self.staging_pool = StagingPool()
        if self.staging != "off":
            # Refused now, not at the first update, when staging cannot hold
            # even one copy of this worker's weights.
            needed = check_staging_fits_at_start(
                self.staging,  # type: ignore[arg-type]
                self.model,
                self.device,
                getattr(self.vllm_config, "cache_config", None),
            )
            logger.info(
                "Weight updates are staged (staging=%r): each keeps at least "
                "%.3f GiB, one copy of this worker's weights",
                self.staging,
                needed / 2**30,
            )
        # Created on first use (``_make_publication`` may query the device).
        self._pub: WorkerPublication | None = None
        # Set once a weight of the open update was handed to the model.
        self._landed = False
        # An abort message's reason, until the finish that closes the update.
        self._aborted: str | None = None
        # Layers vLLM cannot process again (read at the first update).
        self._unreloadable: list[str] | None = None
        # Set once the update's receipt went out (the prepare message).
        self._prepared = False
        # Handlers of the registered message kinds (``worker.handlers``),
        # each made at the first message of its kind.
        self._handlers: dict[MessageKind, MessageHandler] = {}
        self._on_init()

    # -- backend hooks -------------------------------------------------------

    @abstractmethod
    def _make_publication(self) -> WorkerPublication:
        """This worker's publication state, built once."""

    def _on_init(self) -> None:
        """The engine was made (the lifecycle's state is set); the backend
        sets up its own."""

    def _on_start(self) -> None:
        """A new update opens (after any open one was aborted)."""

    def _on_new_publication(self) -> None:
        """The first message of a publication passed its header checks."""

    def _on_update_failed(self, reason: str) -> None:
        """The open update failed or was aborted; its session is closed."""

    def _on_committed(self) -> None:
        """The update committed: the new weights serve."""

    def _on_update_closed(self) -> None:
        """The update is over (finished, failed, aborted or shut down)."""

    def carried_tensors(self, message: dict[str, Any]) -> CarriedTensors | None:
        """The tensors ``message`` (in this backend's format) carries in a
        trainer's buffers, for a registered kind's handler that reads them
        itself; None when this backend maps no trainer's buffers."""
        return None

    # -- what backends use -----------------------------------------------------

    @property
    def pub(self) -> WorkerPublication:
        """This worker's publication state (verified publication, fencing)."""
        if self._pub is None:
            self._pub = self._make_publication()
        return self._pub

    def _handler_for(self, kind: MessageKind) -> MessageHandler:
        """The handler of ``kind``'s messages, made on first use."""
        handler = self._handlers.get(kind)
        if handler is None:
            handler = self._handlers[kind] = make_handler(kind, self)
        return handler

    def _discard_handled(self, reason: str | None = None) -> None:
        for handler in self._handlers.values():
            handler.discard(reason)

    @property
    def fence_status(self) -> dict[str, Any]:
        """The worker's update state (``FenceStatus.to_dict``), for diagnostics."""
        return self.pub.fence.status.to_dict()

    @property
    def staging(self) -> str:
        """``WeightTransferConfig.staging``: ``"off"``, ``"device"`` or ``"host"``."""
        return getattr(self.config, "staging", "off") or "off"

    def _session_for(self, what: str) -> UpdateSession:
        """The open update's session, within its deadline, or an error that
        says why there is none."""
        session = self._session
        if session is None or not session.is_open:
            raise RuntimeError(
                session.closed_message(what)
                if session is not None
                else f"{what} needs an open update; call start_weight_update first"
            )
        session.check_deadline(what)
        return session

    def _refuse_if_unreloadable(self) -> None:
        """Refuse base-weight updates, before anything lands, on a model
        with layers vLLM cannot process again
        (``layerwise_session.unreloadable_layers``; read once per worker)."""
        if self._unreloadable is None:
            self._unreloadable = unreloadable_layers(self.model)
        refuse_unreloadable_layers(self._unreloadable)

    def _mark_landed(self) -> None:
        """Call before handing the first weight of an update to the model: a
        failure from here on fences the engine. Staged updates hand nothing
        to the model before the commit, which marks it itself."""
        if isinstance(self._session, StagedUpdate):
            return
        self.pub.touch()
        self._landed = True

    # -- lifecycle ---------------------------------------------------------------

    def start_weight_update(self) -> None:
        if self._session is not None and self._session.is_open:
            self._session.abort("a new update started")
        self._on_update_closed()
        self.pub.start()
        self._landed = False
        self._aborted = None
        self._prepared = False
        self._discard_handled("a new update started")
        self._on_start()
        timeout_s = getattr(self.config, "update_timeout_s", None)
        session: UpdateSession
        if self.staging == "off":
            session = LayerwiseReloadSession(
                self.model,
                self.model_config,
                on_abort=self._session_aborted,
                timeout_s=timeout_s,
            )
        else:
            session = StagedUpdate(
                self.model,
                self.model_config,
                where=self.staging,  # type: ignore[arg-type]
                model_device=self.device,
                timeout_s=timeout_s,
                pool=self.staging_pool,
            )
        session.start()
        self._session = session

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The kind by the rule the API server's guard and metrics use too.
        kind = message_kind(update_info)
        if kind is MessageKind.ABORT:
            try:
                reason = abort_reason(update_info)
            except BaseException as e:  # a malformed abort still closes it
                self._close_aborted(f"malformed abort message ({describe_error(e)})")
                raise
            self._close_aborted(reason or "")
            return
        try:
            self._refuse_if_aborted()
            if kind is MessageKind.PREPARE and is_prepare_request(update_info):
                what = f"{self.backend_name} prepare"
                self.pub.fence.check_open(what)
                session = self._session_for(what)
                header = next(
                    (
                        h
                        for h in (x.prepare_header() for x in self._handlers.values())
                        if h is not None
                    ),
                    None,
                )
                self.pub.check_prepare(update_info, header)
                self._prepare(session)
                return
            if self._prepared:
                raise ValueError(
                    "update_weights after the trainer's prepare message: the "
                    "receipts are written, so no more weights may join this "
                    "update; finish it or abort it"
                )
            # No update open, or fenced: refused before anything changes (the
            # failure path below then only tells the backend).
            self.pub.fence.check_open(f"{self.backend_name} update_weights")
            # A registered kind goes to its handler, which may give it back
            # to land as base weights.
            if handles(kind) and self._handler_for(kind).handle(update_info):
                return
            checker = self.pub.checker
            message = self.pub.begin_message(update_info)
            if self.pub.checker is not checker and self.pub.header is not None:
                self._on_new_publication()
            # After the header, so the refusal's receipt says nothing changed.
            self._refuse_if_unreloadable()
            self.receive_weights(self.parse_update_info(message))
        except BaseException as e:
            self._fail_update(e)
            if isinstance(e, Exception) and not str(e).strip():
                # The server returns the message to the trainer; never a blank.
                raise RuntimeError(
                    f"{self.backend_name} update_weights failed: {describe_error(e)}"
                ) from e
            raise

    def finish_weight_update(self) -> None:
        if self._aborted is not None:
            # The finish that closes an update the trainer aborted: the
            # trainer knows, and vLLM's Worker keeps an update open for as
            # long as finish raises.
            self._aborted = None
            self._on_update_closed()
            return
        session, self._session = self._session, None
        try:
            state = self.pub.fence.state
            if state != WeightState.UPDATING:
                if session is not None and session.is_open:
                    session.abort("finish after a failure")
                if state == WeightState.FENCED:
                    raise WeightsFencedError(
                        fenced_message(self.pub.fence.status.reason or "unknown")
                        + ". vLLM's worker keeps this update open while "
                        "finish_weight_update raises: close it with "
                        "update_weights {'abort': '<reason>'} and then "
                        "finish_weight_update (the fork's trainers do this on "
                        "failure), then send a full update"
                    )
                # An earlier failure closed the update with the weights intact.
                return
            try:
                for handler in self._handlers.values():
                    handler.prepare()
                if isinstance(session, StagedUpdate) and session.is_open:
                    self._commit_staged(session)
                elif session is not None and session.is_open:
                    session.finish()
            except BaseException as e:
                self.pub.fail(e, weights_intact=not self._landed)
                self._discard_handled(describe_error(e))
                if isinstance(e, Exception) and not str(e).strip():
                    raise RuntimeError(
                        f"{self.backend_name} finish_weight_update failed: "
                        f"{describe_error(e)}"
                    ) from e
                raise
            self.pub.finish()
            self._on_committed()
            # NaN or infinity the old weights wrote into the KV cache dies here.
            zero_non_finite_kv(self.vllm_config)
            for handler in self._handlers.values():
                handler.commit()
        finally:
            self._discard_handled()
            self._on_update_closed()

    def shutdown(self) -> None:
        self._close_session("the engine is shutting down")
        self.staging_pool.drop()
        self._on_update_closed()
        for handler in self._handlers.values():
            handler.close()

    # -- internals -----------------------------------------------------------

    def _refuse_if_aborted(self) -> None:
        """Refuse a message that follows an abort of this update, naming the
        abort's reason (whoever sent it); only the finish may follow."""
        if self._aborted is not None:
            raise RuntimeError(
                f"{self.backend_name} update_weights refused: this update was "
                f"aborted ({self._aborted}); finish_weight_update closes it, "
                "then start a new sync"
            )

    def _prepare(self, session: UpdateSession) -> None:
        """Check what this worker holds and write its receipt; nothing is
        committed (the trainer's prepare message, or a staged finish)."""
        for handler in self._handlers.values():
            handler.prepare()
        if isinstance(session, StagedUpdate):
            session.prepare()
        self.pub.prepare()
        self._prepared = True

    def _commit_staged(self, session: StagedUpdate) -> None:
        """Finish a staged update: the checks and the receipt (unless the
        prepare message did them), then the commit, which alone fences on
        failure."""
        try:
            if session.prepared:
                # Prepared at the trainer's prepare message: a served tensor
                # may have been replaced since (prepare itself checks it).
                session.check_bound("finish_weight_update")
            if not self.pub.receipt_sent:
                self._prepare(session)
            # Checked before the first write, so a late commit, or one whose
            # bound served tensors were replaced since, is dropped, not fenced.
            session.check_deadline("finish_weight_update")
        except BaseException as e:
            session.abort(describe_error(e))
            raise
        self.pub.touch()
        self._landed = True
        record = self.pub.record
        if record is not None:
            with record.phase("commit"):
                session.finish()
        else:
            session.finish()
        self.last_staged_commit = dict(session.committed)

    def _session_aborted(self, reason: str, landed: bool) -> None:
        """The session aborted itself (a forward pass during landing, or the
        deadline)."""
        self.pub.fail(reason, weights_intact=not (landed and self._landed))

    def _close_session(self, reason: str) -> None:
        self._discard_handled(reason)
        session, self._session = self._session, None
        if session is not None:
            session.abort(reason)

    def _fail_update(self, error: BaseException) -> None:
        """Close the open update after ``error``: restore what did not
        complete, let the backend clean up, fence if a weight had landed."""
        reason = describe_error(error)
        try:
            self._close_session(reason)
            self._on_update_failed(reason)
        finally:
            try:
                self.pub.fail(error, weights_intact=not self._landed)
            finally:
                self._on_update_closed()

    def _close_aborted(self, reason: str) -> None:
        """Close the open update on the trainer's ``{"abort": reason}``.

        Never raises: the trainer already knows the update failed, and the
        ``finish_weight_update`` it sends next closes the update quietly, so
        vLLM's Worker is ready for the resync. The engine is fenced if the
        update had touched a weight.
        """
        logger.warning("Trainer aborted the weight update: %s", reason)
        if self.pub.fence.state == WeightState.UPDATING:
            self.pub.fail(
                f"the trainer aborted the update: {reason}",
                weights_intact=not self._landed,
            )
        self._aborted = reason
        self._close_session(reason)
        try:
            self._on_update_failed(reason)
        finally:
            self._on_update_closed()


def global_worker_rank(vllm_config: Any) -> int:
    """The worker's rank across data-parallel replicas: the index vLLM's
    ``Worker`` uses to pick its element of a list payload."""
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_index = getattr(parallel, "data_parallel_index", 0) or 0
    world_size = getattr(parallel, "world_size", 1) or 1
    try:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank_in_group
    except (AssertionError, ImportError):
        rank = 0
    return worker_index(dp_index, world_size, rank)
