# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One sync of any trainer (``ipc``, ``sharded_rdt``, a LoRA push): the
calls every trainer makes around the bytes its backend moves, written once
(``run_sync``). A backend supplies its send step and a few choices; every
rank of a multi-process trainer calls ``run_sync`` with the same choices,
and the sender (the only rank that talks to the server) makes the calls::

    1. start_update(client, who, take_over, wait_s)    ; the update opens
    2. send()                                          ; the backend's bytes
    3. if verify:
         client.update_weights({"prepare": publication_id})
                                                       ; every worker checks
                                                         and writes its receipt
         pub.verify(expected(), timeout_s=receipt_timeout_s, **verify_options)
         on_verified(pub)                              ; nothing committed yet
    4. commit_update(client, weight_version)           ; the commit (below)
    on a failure in 2-4:
       abort_update(client, "<abort_as>: <error>")     ; the server keeps or
                                                         fences its weights
       on_abort()                                      ; the backend's cleanup
    on a failure in 1-4:
       fence: pub.fail(client, error, expected())      ; served version
                                                         "fenced:..." unless
                                                         every worker kept
                                                         its weights
       else:  the failure is recorded in pub's sync line; the served version
              is left as it is (a LoRA push: only an adapter failed)
    pub.close()                                        ; always

With a ``group`` of several trainer ranks, steps 1, 3 and 4 run on the
sender and their failure raises on every rank (``group.on_sender``); ``send``
runs on every rank. A start that fails is not aborted: nothing was opened.

The commit (step 4)::

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
reads KV computed by the old weights (running requests are recomputed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
from vllm.distributed.weight_transfer.trainer.group import TrainerGroup, on_sender
from vllm.distributed.weight_transfer.trainer.start_update import (
    DEFAULT_WAIT_S,
    start_update,
)
from vllm.distributed.weight_transfer.verification import (
    ABORT_FIELD,
    PREPARE_FIELD,
    TrainerPublication,
    describe_error,
)
from vllm.distributed.weight_transfer.verification.receipts import ExpectedWorkers
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["abort_update", "commit_update", "run_sync"]


def run_sync(
    client: VLLMWeightSyncClient,
    send: Callable[[], None],
    *,
    who: str,
    pub: TrainerPublication | None,
    expected: Callable[[], ExpectedWorkers],
    receipt_timeout_s: float,
    weight_version: str | None | Callable[[], str | None] = None,
    verify: bool | None = None,
    group: TrainerGroup | None = None,
    is_sender: bool = True,
    take_over: bool = True,
    wait_s: float = DEFAULT_WAIT_S,
    abort_as: str | None = None,
    fence: bool = True,
    verify_options: Mapping[str, Any] | None = None,
    on_verified: Callable[[TrainerPublication], None] | None = None,
    on_abort: Callable[[], None] | None = None,
) -> None:
    """One sync; see the module docstring.

    ``who`` names this trainer to ``start_update`` and, unless ``abort_as``
    is given, in the abort reason. ``pub`` is the sender's publication (None
    when unverified or on another rank); ``verify`` (default: ``pub`` is
    given) says whether every rank joins step 3. ``weight_version`` is the
    version the commit sets, or a function read right before the commit.
    ``expected()`` names the workers whose receipts count."""
    if verify is None:
        verify = pub is not None
    options = dict(verify_options or {})

    def step(what: str, call: Callable[[], Any]) -> None:
        if group is None:
            call()
        else:
            on_sender(group, is_sender, what, call)

    def check_receipts() -> None:
        assert pub is not None  # the sender holds it whenever it verifies
        client.update_weights({PREPARE_FIELD: pub.header.publication_id})
        pub.verify(expected(), timeout_s=receipt_timeout_s, **options)
        if on_verified is not None:
            on_verified(pub)

    def commit() -> None:
        version = weight_version() if callable(weight_version) else weight_version
        commit_update(client, version)

    try:
        step(
            "start_weight_update",
            lambda: start_update(client, who, take_over=take_over, wait_s=wait_s),
        )
        try:
            send()
            if verify:
                step("verify receipts", check_receipts)
            step("finish_weight_update", commit)
        except BaseException as e:
            if is_sender:
                # Also after a failed finish: vLLM's Worker keeps the update
                # open until an engine call raises or a finish returns.
                abort_update(client, f"{abort_as or who}: {describe_error(e)}")
            if on_abort is not None:
                on_abort()
            raise
    except BaseException as e:
        if pub is not None:
            _failed(client, pub, e, expected if fence else None)
        raise
    finally:
        if pub is not None:
            pub.close()


def _failed(
    client: VLLMWeightSyncClient,
    pub: TrainerPublication,
    error: BaseException,
    expected: Callable[[], ExpectedWorkers] | None,
) -> None:
    """Fence the served version for ``error`` (``pub.fail``), unless every
    worker of ``expected()`` kept its weights; without ``expected``, only
    record the failure in ``pub``'s sync line."""
    if expected is None:
        pub.record.finish(ok=False, error=error)
        pub.record.log(logger)
        return
    workers: ExpectedWorkers | None = None
    try:
        workers = expected()
    except Exception as why:  # the server may be gone
        logger.debug("expected workers unknown: %s", why)
    pub.fail(client, error, workers)


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
