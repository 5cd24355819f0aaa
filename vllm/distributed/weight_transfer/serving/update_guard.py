# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Holds ``vllm serve``'s generation on the server side while a weight update
lands or commits, so no client has to pause it, and none can leave it paused.

An in-place update (``ipc`` or ``sharded_rdt`` with ``staging="off"``) writes
the served weights layer by layer while it is open. A forward pass in that
window would run on a model that is neither the old nor the new one; the
worker's forward pre-hook then aborts the update and fences the engine, but
the engine core's version label, which stamps every output, would still name
the old weights until the trainer's next call. ``WeightUpdateGuard``, an ASGI
middleware mounted with the RL routes, closes that window:

- **Classify.** Every ``update_weights`` body is classified by
  ``common.messages.classify_update``, the rule the workers read it by: one
  message for all workers, or a list of exactly one message per worker
  (``data_parallel_index * world_size + rank``), all of one kind (weights,
  adapter, abort or prepare). Any other body (a list of the wrong length, a
  list mixing kinds, an element that is not an object, a body without
  ``update_info``) is answered 422 naming why, before it reaches the engine:
  what it would do differs from worker to worker, so the guard cannot know
  whether to hold.
- **No bypass.** ``POST /collective_rpc`` naming a worker method that opens,
  feeds or closes an update (``common.messages.WEIGHT_TRANSFER_METHODS``) is
  answered 403 naming the RL routes to use: through it, weights would land
  without the hold, the classification and the version label.
- **One update at a time.** The guard tracks the update the workers hold
  open (from a successful start to a successful finish, a failed
  ``update_weights``, which closes it on the workers, or the deadline). A
  start while one is open is answered 409 naming the open update (its
  publication, adapter, age) and how to close it, in one log line and
  without reaching the engine; ``stale_updates.start_update`` reads that
  answer to take over from a dead trainer. A weights, adapter or prepare
  message while none is open, or one naming a publication that was already
  closed (aborted, abandoned, failed or expired), is answered 409 naming how
  that update ended. The finish of an aborted update may not carry a
  ``weight_version`` (409): it commits nothing, so no label may name it.
- **Hold.** Before the first message that carries base weights reaches the
  engine, generation is paused with ``mode="keep"`` unless someone else has
  already paused it. Requests in flight are frozen and new ones wait; a
  ``start_weight_update`` alone holds nothing, because the model is untouched
  until weights arrive.
- **Release.** The hold ends when ``finish_weight_update`` succeeds, or when
  the update closes on the workers otherwise (a failed ``update_weights``).
  A failed finish keeps the hold: vLLM's worker keeps the update open, and
  generation waits for the trainer's abort and finish, or the deadline. If
  the guard took the pause, the release resets the prefix cache with running
  requests (frozen requests are recomputed on the weights now served) and
  resumes generation.
- **Fence label.** Once base weights were accepted, an update that ends
  other than by a successful finish (anyone's ``{"abort": reason}``, a
  failed ``update_weights``, the deadline) sets the served version to
  ``fenced:<publication id>: <cause>`` before generation resumes, so no
  output of the mixed model carries the old label.
- **Refuse resume.** ``POST /resume`` while the hold is on is answered 409
  with what to do; a resume would let a forward run on the landing model. A
  client that sends ``POST /pause`` during the hold takes the pause over: the
  guard will not resume generation at the release.
- **Deadline.** While the hold is on and no weight route call is in flight,
  ``WeightTransferConfig.update_timeout_s`` after the last one answered the
  guard aborts the update itself (``{"abort": reason}``, then
  ``finish_weight_update``), sets the served version to
  ``fenced:<publication id>: <reason>`` (weights had been accepted, so the
  engine is fenced) and releases. A trainer that dies mid-update therefore
  holds generation for at most the deadline, and ``GET /weight_info`` names
  the cause at once.

A LoRA adapter push (a message with an ``adapter`` header) lands nothing in
the served model until its finish, so its messages hold nothing: generation
goes on while the adapter's bytes travel and are staged. The guard still
watches the open push: its finish runs inside a pause the guard takes (unless
a client paused), with the cache reset and resume after it, like a staged
commit; and past the same deadline the guard aborts and closes it, the
served version label unchanged, because nothing of the served model was
touched. An update that sends base weights after an adapter is held from
its first base weights on, as above.

Whatever the guard closes at a deadline, it also tells the route observer
(``sync_metrics.RouteSyncObserver``), so ``/weight_update_status`` no longer
shows the update as open and the metrics count it as aborted.

A staged engine serves the old weights until its commit, so only the commit
is held: ``finish_weight_update`` runs inside a pause the guard takes (unless
a client paused), and the release above follows it within the same request.
The switch, the version label (the route sets it right after the finish) and
the cache reset fall between the same two engine steps, and a trainer that
dies mid-commit cannot leave generation paused.

The answer to ``start_weight_update`` carries ``x-vllm-weight-commit-hold:
server``: the fork's HTTP client then commits with the finish alone, without
its own pause, reset and resume (``full_resync.commit_update``).

The guard is off for other backends and when the server runs several
API-server processes (``--api-server-count`` above 1): its state lives in one
process, and the finish that ends an update may reach another. Offline
``LLM`` and Ray callers own their process: the fork's trainers hold the
commit through the client where it can, and an in-place update needs the
caller to pause (or staging).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from vllm.distributed.weight_transfer.common.asgi import (
    Receive,
    Send,
    json_object,
    json_response,
    post_route,
    read_body,
    with_header,
)
from vllm.distributed.weight_transfer.common.messages import (
    ABORT_FIELD,
    WEIGHT_TRANSFER_METHODS,
    MessageKind,
    UnclassifiableUpdate,
    classify_update,
    expected_messages,
)
from vllm.distributed.weight_transfer.serving.generation_hold import (
    Hold,
    Reply,
    cancel_deadline,
    end_pause,
)
from vllm.distributed.weight_transfer.serving.metrics import (
    RouteSyncObserver,
    route_sync_observer,
)

# Submodules, not the package: this module is imported by the API server.
from vllm.distributed.weight_transfer.serving.update_ledger import (
    UpdateLedger,
    abort_text,
    publication_id,
    update_info_of,
)
from vllm.distributed.weight_transfer.verification.fence import fenced_version
from vllm.logger import init_logger

logger = init_logger(__name__)

# Backends whose updates land through the fork's worker lifecycle (and
# understand ``{"abort": ...}``).
GUARDED_BACKENDS = ("ipc", "sharded_rdt")
# On the answer to ``start_weight_update``: the server holds generation for
# the commit and drops the old KV cache itself (``commit_update`` reads it
# through the HTTP client's ``server_holds_commit``).
COMMIT_HOLD_HEADER = "x-vllm-weight-commit-hold"
COMMIT_HOLD_VALUE = "server"


class WeightUpdateGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: Any, observer: RouteSyncObserver | None = None) -> None:
        self.app = app
        # Told what the guard closes itself (the process's observer if None).
        self.observer = observer
        self._hold: Hold | None = None
        # The open update and how the last ones ended.
        self._ledger = UpdateLedger()
        # Serializes hold, release and expiry; never held across a route call.
        self._lock = asyncio.Lock()
        self._warned_multi_server = False

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        route = _route(scope)
        mode = self._mode(scope) if route is not None else None
        if route is None or mode is None:
            await self.app(scope, receive, send)
            return
        engine = scope["app"].state.engine_client
        if route == "/collective_rpc":
            await self._collective_rpc(scope, receive, send)
        elif route in _START_ROUTES:
            # Tells the fork's HTTP client that the server holds generation
            # for the commit, so it sends no pause, reset or resume itself.
            send = with_header(send, COMMIT_HOLD_HEADER, COMMIT_HOLD_VALUE)
            await self._start(route, scope, receive, send)
        elif route == "/resume":
            await self._resume(scope, receive, send)
        elif route == "/update_weights":
            await self._update_weights(engine, mode, scope, receive, send)
        elif route == "/finish_weight_update" and self._aborted_open():
            await self._finish_aborted(engine, scope, receive, send)
        elif route == "/finish_weight_update" and (
            mode == "staged" or self._adapter_push_open()
        ):
            await self._commit(engine, scope, receive, send)
        else:
            await self._weight_call(engine, route, scope, receive, send)

    # -- routes ----------------------------------------------------------------

    async def _collective_rpc(self, scope: dict, receive: Receive, send: Send) -> None:
        body, replay = await read_body(receive)
        method = json_object(body).get("method")
        if method not in WEIGHT_TRANSFER_METHODS:
            await self.app(scope, replay, send)
            return
        await json_response(
            send,
            403,
            f"/collective_rpc may not call {method!r} on this server: the "
            "weight update guard holds generation, classifies every message "
            "and fences the version label only on the RL routes. Use POST "
            "/start_weight_update, /update_weights and /finish_weight_update "
            "(and /init_weight_transfer_engine, /shutdown_weight_transfer_engine)",
        )

    async def _start(
        self, route: str, scope: dict, receive: Receive, send: Send
    ) -> None:
        message = self._ledger.start_refusal(route)
        if message is not None:
            logger.info("Refused %s: %s", route, message)
            await json_response(send, 409, message)
            return

        async def then(reply: Reply) -> None:
            if reply.ok:
                self._ledger.opened()

        await self._call(scope, receive, send, then)

    async def _update_weights(
        self, engine: Any, mode: str, scope: dict, receive: Receive, send: Send
    ) -> None:
        body, replay = await read_body(receive)
        try:
            update_info = update_info_of(body)
            kind = classify_update(update_info, expected_messages(engine.vllm_config))
        except UnclassifiableUpdate as e:
            await json_response(
                send, 422, f"update_weights refused before reaching the workers: {e}"
            )
            return
        refusal = self._ledger.refusal(kind, update_info)
        if refusal is not None:
            await json_response(send, 409, refusal)
            return
        lands = mode == "in_place" and kind in _LANDING_KINDS
        if lands and kind is MessageKind.ADAPTER:
            # Staged apart from the model until the finish: watched, not held.
            await self._take_hold(engine, update_info, pause=False)
        elif lands and not await self._hold_or_503(
            engine,
            update_info,
            send,
            "a weight update",
            "could not pause generation before landing weights",
            "nothing was landed. Abort the update ({'abort': ...} then "
            "finish_weight_update) and retry, or pause generation yourself "
            "first",
        ):
            return

        async def then(reply: Reply) -> None:
            hold = self._hold
            if reply.ok and lands and hold is not None:
                if kind is MessageKind.ADAPTER:
                    hold.adapter = True
                else:
                    hold.accepted = True
            if reply.ok:
                self._ledger.note(kind, update_info)
            if kind is MessageKind.ABORT and reply.ok:
                await self._fence_label(engine, f"aborted: {abort_text(update_info)}")
            if not reply.ok:
                # vLLM's worker closes the update whenever update_weights raises.
                await self._ended_on_workers(
                    engine, f"closed when update_weights failed ({reply.error()})"
                )
                return
            await self._after_call(engine, ended=False, ok=True)

        await self._call(scope, replay, send, then)

    async def _weight_call(
        self, engine: Any, route: str, scope: dict, receive: Receive, send: Send
    ) -> None:
        async def then(reply: Reply) -> None:
            if route == "/pause" and reply.ok and self._hold is not None:
                # The client owns this pause now; it resumes when it wants to.
                self._hold.owns_pause = False
            finished = route == "/finish_weight_update"
            if finished and reply.ok:
                self._ledger.end("finished")
            await self._after_call(engine, ended=finished, ok=reply.ok)

        await self._call(scope, receive, send, then)

    async def _finish_aborted(
        self, engine: Any, scope: dict, receive: Receive, send: Send
    ) -> None:
        """The finish that closes an aborted update commits nothing, so it
        may not set a version label: one would name weights that never
        served (or, in place, label a fenced model as new)."""
        body, replay = await read_body(receive)
        if json_object(body).get("weight_version") is not None:
            reason = (
                self._ledger.open.aborted if self._ledger.open is not None else None
            )
            await json_response(
                send,
                409,
                f"this update was aborted ({reason}): its finish "
                "commits nothing and sets no weight_version. Send "
                "finish_weight_update without weight_version, then a new sync",
            )
            return
        await self._weight_call(engine, "/finish_weight_update", scope, replay, send)

    async def _after_call(self, engine: Any, *, ended: bool, ok: bool) -> None:
        """Release after a finish that succeeded, or once the update closed
        on the workers otherwise (the label fenced first, when base weights
        had landed); else (re-)arm the deadline. A failed finish leaves the
        update open on the workers, so generation stays held until a finish
        succeeds (the fork's trainers abort and finish at once) or the
        deadline fences the served version."""
        hold = self._hold
        if hold is None or hold.calls_in_flight:
            return  # the call still in flight decides when it answers
        if ended and ok:
            await self._release(engine, "the update ended")
        elif self._ledger.open is None:
            await self._fence_label(
                engine, self._ledger.last_end or "the update closed"
            )
            await self._release(engine, "the update closed on the workers")
        else:
            self._arm_deadline(engine)

    async def _hold_or_503(
        self,
        engine: Any,
        update_info: Any,
        send: Send,
        for_what: str,
        failed: str,
        consequence: str,
    ) -> bool:
        """Hold generation for ``for_what``; if that raises, log it, answer 503
        "<failed> (<error>); <consequence>" and return False."""
        try:
            await self._take_hold(engine, update_info)
        except Exception as e:
            logger.exception("Could not hold generation for %s", for_what)
            await json_response(
                send, 503, f"{failed} ({type(e).__name__}: {e}); {consequence}"
            )
            return False
        return True

    async def _commit(
        self, engine: Any, scope: dict, receive: Receive, send: Send
    ) -> None:
        """A staged engine's ``finish_weight_update``, or the finish of a LoRA
        adapter push: generation is held for just this call, and the KV the
        old weights computed is dropped before it resumes."""
        if not await self._hold_or_503(
            engine,
            None,
            send,
            "a commit",
            "could not pause generation for the commit",
            "nothing was committed and the staged update is still open: retry "
            "finish_weight_update, or abort it",
        ):
            return

        async def then(reply: Reply) -> None:
            if reply.ok:
                self._ledger.end("finished")
            await self._release(engine, "the staged update's commit answered")

        await self._call(scope, receive, send, then)

    async def _resume(self, scope: dict, receive: Receive, send: Send) -> None:
        if self._hold is None or not self._hold.paused:
            # Nothing lands in place (none open, or an adapter being staged).
            await self.app(scope, receive, send)
            return
        await json_response(
            send,
            409,
            "an in-place weight update is landing: resuming generation now "
            "would run the model on partly written weights. Finish the update "
            "(finish_weight_update) or abort it (update_weights {'abort': "
            "'<reason>'} then finish_weight_update); generation resumes then",
        )

    # -- the open update -------------------------------------------------------

    async def _ended_on_workers(self, engine: Any, cause: str) -> None:
        """The workers closed the update without a commit: fence the label if
        base weights had landed, and release (once no call is in flight)."""
        self._ledger.end(cause)
        await self._after_call(engine, ended=False, ok=False)

    async def _fence_label(self, engine: Any, cause: str) -> None:
        """Name ``cause`` in the served version when base weights of the open
        update were accepted (the model may be mixed, and is fenced)."""
        hold = self._hold
        if hold is None or not hold.accepted:
            return
        logger.error(
            "An in-place weight update ended without its commit: %s; the served "
            "version is fenced",
            cause,
        )
        await engine.update_weight_version(
            fenced_version(hold.publication_id, f"{cause}; send a full update")
        )

    # -- hold and release ----------------------------------------------------

    async def _call(
        self,
        scope: dict,
        receive: Receive,
        send: Send,
        then: Callable[[Reply], Awaitable[None]],
    ) -> None:
        """Run the route with the deadline suspended, then ``then(reply)``
        (release, or re-arm the deadline) before the client hears the end of
        the answer: a finish returns once generation serves again, and the
        middlewares around see the same order. ``then`` runs once, also when
        the route raises."""
        reply = Reply()
        hold = self._hold
        pending = True

        async def follow_up() -> None:
            nonlocal pending
            if not pending:
                return
            pending = False
            if hold is not None:
                hold.calls_in_flight -= 1
            try:
                await then(reply)
            except Exception:
                # The route's answer still goes out; the log says what the
                # guard could not do (a resume that failed twice).
                logger.exception("The weight update guard's follow-up failed")

        async def forward(message: dict) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                reply.status = int(message.get("status", 500))
            elif kind == "http.response.body":
                if len(reply.body) < 4096:
                    reply.body += message.get("body", b"")[:4096]
                if not message.get("more_body"):
                    await follow_up()
            await send(message)

        if hold is not None:
            hold.calls_in_flight += 1
            cancel_deadline(hold)
        try:
            await self.app(scope, receive, forward)
        finally:
            await follow_up()

    async def _take_hold(
        self, engine: Any, update_info: Any, *, pause: bool = True
    ) -> None:
        """Watch the open update (from its first message that may land
        anything) and, with ``pause``, hold generation from now until the
        release."""
        async with self._lock:
            if self._hold is None:
                self._hold = Hold()
            hold = self._hold
            if pause and not hold.paused:
                owns = not await engine.is_paused()
                if owns:
                    await engine.pause_generation(mode="keep")
                hold.paused, hold.owns_pause = True, owns
                logger.info(
                    "Holding generation for a weight update%s",
                    "" if owns else " (already paused by a client)",
                )
            publication = publication_id(update_info)
            if publication is not None:
                self._hold.publication_id = publication

    async def _release(self, engine: Any, why: str) -> None:
        async with self._lock:
            hold, self._hold = self._hold, None
            if hold is None:
                return
            cancel_deadline(hold)
            if not hold.owns_pause:
                return
            logger.info("Resuming generation: %s", why)
            await end_pause(engine)

    def _arm_deadline(self, engine: Any) -> None:
        hold = self._hold
        if hold is None or hold.calls_in_flight:
            return
        cancel_deadline(hold)
        timeout_s = float(_config(engine).update_timeout_s)
        loop = asyncio.get_running_loop()

        def expire() -> None:
            hold.deadline = None
            hold.expiry = asyncio.ensure_future(self._expire(engine, hold, timeout_s))

        hold.deadline = loop.call_later(timeout_s, expire)

    async def _expire(self, engine: Any, hold: Hold, timeout_s: float) -> None:
        """The update went ``timeout_s`` without a call: abort it, fence the
        label if base weights had been accepted, and release."""
        if self._hold is not hold or hold.calls_in_flight:
            return
        silence = (
            f"no weight update call for {timeout_s:g} s "
            "(WeightTransferConfig.update_timeout_s): the server aborted the "
            "update"
        )
        if hold.accepted:
            reason = f"{silence}; send a full update to recover"
            logger.error("Aborting an in-place weight update: %s", reason)
        else:
            reason = f"{silence}; the served weights and adapters are unchanged"
            logger.warning("Aborting a LoRA adapter push: %s", reason)
        abort = {ABORT_FIELD: reason}
        closed = False
        try:
            await engine.collective_rpc("update_weights", kwargs={"update_info": abort})
            await engine.collective_rpc("finish_weight_update")
            closed = True
        except Exception:
            # The update may have closed meanwhile; the label below still
            # tells what happened to the weights that had landed.
            logger.exception("Closing the expired weight update failed")
        self._ledger.end(f"expired ({silence})")
        try:
            if hold.accepted:
                await engine.update_weight_version(
                    fenced_version(hold.publication_id, reason)
                )
        finally:
            try:
                self._tell_observer(engine, abort, closed)
            except Exception:
                logger.exception("Recording the expired update's abort failed")
            await self._release(engine, "the update's deadline passed")

    def _tell_observer(self, engine: Any, abort: dict, closed: bool) -> None:
        """Report the abort and finish the guard sent itself, as the routes
        would have (the update is no longer open, and counts as aborted)."""
        observer = self.observer or route_sync_observer()
        backend = str(getattr(_config(engine), "backend", "unknown"))
        now = time.monotonic()
        observer.observe_route(
            "update", started=now, ok=True, backend=backend, update_info=abort
        )
        observer.observe_route("finish", started=now, ok=closed, backend=backend)

    def _aborted_open(self) -> bool:
        """Whether the open update took an abort and awaits its finish."""
        return self._ledger.aborted_open()

    def _adapter_push_open(self) -> bool:
        """Whether the open update carried a LoRA adapter and holds nothing
        yet (its finish is then held like a staged commit)."""
        hold = self._hold
        return hold is not None and hold.adapter and not hold.paused

    # -- what applies ----------------------------------------------------------

    def _mode(self, scope: dict) -> str | None:
        """``"in_place"`` or ``"staged"`` for a guarded engine, else None."""
        try:
            state = scope["app"].state
            config = _config(state.engine_client)
        except (AttributeError, KeyError):
            return None
        if getattr(config, "backend", None) not in GUARDED_BACKENDS:
            return None
        servers = getattr(getattr(state, "args", None), "api_server_count", 1)
        if (servers or 1) > 1:
            if not self._warned_multi_server:
                self._warned_multi_server = True
                logger.warning(
                    "%d API-server processes: the weight update guard is off; "
                    "pause generation around every in-place weight update "
                    "yourself (or use staging)",
                    servers,
                )
            return None
        return "in_place" if getattr(config, "staging", "off") == "off" else "staged"


# Message kinds the guard watches in place (base weights are also held).
_LANDING_KINDS = (MessageKind.WEIGHTS, MessageKind.ADAPTER)
_START_ROUTES = ("/start_weight_update", "/start_draft_weight_update")
_ROUTES = (
    "/update_weights",
    "/finish_weight_update",
    *_START_ROUTES,
    "/pause",
    "/resume",
    "/collective_rpc",
)


def _route(scope: dict) -> str | None:
    """The guarded route this request is for, or None."""
    path = post_route(scope)
    return path if path in _ROUTES else None


def _config(engine: Any) -> Any:
    return engine.vllm_config.weight_transfer_config
