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

- **Hold.** Before the first ``update_weights`` message that carries weights
  (anything but ``{"abort": ...}`` or ``{"prepare": ...}``) reaches the
  engine, generation is paused with ``mode="keep"`` unless someone else has
  already paused it. Requests in flight are frozen and new ones wait; a
  ``start_weight_update`` alone holds nothing, because the model is untouched
  until weights arrive.
- **Release.** The hold ends when ``finish_weight_update`` succeeds, or when
  a call fails before any weights were accepted (the engine refused them;
  vLLM's worker closes the update). After weights were accepted, a failed
  call keeps the hold: the model may be mixed or fenced, and generation waits
  for the trainer's recovery (the fork's trainers abort and finish at once)
  or the deadline. If the guard took the pause, the release resets the
  prefix cache with running requests (frozen requests are recomputed on the
  weights now served) and resumes generation.
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
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.lora_adapters import ADAPTER_KEY
from vllm.distributed.weight_transfer.sync_metrics import (
    RouteSyncObserver,
    route_sync_observer,
)

# Submodules, not the package: this module is imported by the API server.
from vllm.distributed.weight_transfer.verification.fence import (
    ABORT_FIELD,
    PREPARE_FIELD,
    fenced_version,
)
from vllm.distributed.weight_transfer.verification.wire import (
    PUBLICATION_FIELD,
    PublicationHeader,
)
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

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass
class _Hold:
    """An open in-place update the guard watches: base weights landing (with
    generation held), or a LoRA adapter push being staged (nothing held until
    its finish)."""

    # Whether generation is held: the guard paused it, or found it paused.
    paused: bool = False
    # Whether the guard paused generation (and so resumes it at the release).
    owns_pause: bool = False
    # Whether an ``update_weights`` carrying base weights succeeded.
    accepted: bool = False
    # Whether an ``update_weights`` carrying a LoRA adapter succeeded.
    adapter: bool = False
    # The publication the update's messages named, for the fence label.
    publication_id: str = "unknown"
    # Weight route calls now being answered (the deadline waits for them).
    calls_in_flight: int = 0
    deadline: asyncio.TimerHandle | None = None
    # The expiry task, once the deadline fired (kept so it is not collected).
    expiry: asyncio.Future | None = None


class WeightUpdateGuard:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: Any, observer: RouteSyncObserver | None = None) -> None:
        self.app = app
        # Told what the guard closes itself (the process's observer if None).
        self.observer = observer
        self._hold: _Hold | None = None
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
        if route in _START_ROUTES:
            # Tells the fork's HTTP client that the server holds generation
            # for the commit, so it sends no pause, reset or resume itself.
            send = _with_header(send, COMMIT_HOLD_HEADER, COMMIT_HOLD_VALUE)
        if route == "/resume":
            await self._resume(engine, scope, receive, send)
        elif mode == "staged":
            if route == "/finish_weight_update":
                await self._commit(engine, scope, receive, send)
            else:
                await self.app(scope, receive, send)
        elif route == "/update_weights":
            await self._update_weights(engine, scope, receive, send)
        elif route == "/finish_weight_update" and self._adapter_push_open():
            await self._commit(engine, scope, receive, send)
        else:
            await self._weight_call(engine, route, scope, receive, send)

    # -- routes ----------------------------------------------------------------

    async def _update_weights(
        self, engine: Any, scope: dict, receive: Receive, send: Send
    ) -> None:
        body, replay = await _read_body(receive)
        update_info = _update_info(body)
        carries = _carries_weights(update_info)
        adapter = carries and _carries_adapter(update_info)
        if adapter:
            # Staged apart from the model until the finish: watched, not held.
            await self._take_hold(engine, update_info, pause=False)
        elif carries:
            try:
                await self._take_hold(engine, update_info)
            except Exception as e:
                logger.exception("Could not hold generation for a weight update")
                await _json_response(
                    send,
                    503,
                    "could not pause generation before landing weights "
                    f"({type(e).__name__}: {e}); nothing was landed. Abort the "
                    "update ({'abort': ...} then finish_weight_update) and "
                    "retry, or pause generation yourself first",
                )
                return

        async def then(ok: bool) -> None:
            if ok and carries and self._hold is not None:
                if adapter:
                    self._hold.adapter = True
                else:
                    self._hold.accepted = True
            await self._after_call(engine, ended=False, ok=ok)

        await self._call(scope, replay, send, then)

    async def _weight_call(
        self, engine: Any, route: str, scope: dict, receive: Receive, send: Send
    ) -> None:
        async def then(ok: bool) -> None:
            if route == "/pause" and ok and self._hold is not None:
                # The client owns this pause now; it resumes when it wants to.
                self._hold.owns_pause = False
            await self._after_call(
                engine, ended=route == "/finish_weight_update", ok=ok
            )

        await self._call(scope, receive, send, then)

    async def _after_call(self, engine: Any, *, ended: bool, ok: bool) -> None:
        """Release, or re-arm the deadline, after a weight route answered.

        A finish that succeeded ends the update. A failed call ends the hold
        only while no weights were accepted (the engine refused them before
        landing, or the failure left it fenced and the caller has the
        error). Once weights were accepted, a failure may have left a mixed
        or fenced model: generation stays held until a finish succeeds (the
        fork's trainers abort and finish at once) or the deadline fences the
        served version."""
        hold = self._hold
        if hold is None or hold.calls_in_flight:
            return  # the call still in flight decides when it answers
        if (ended and ok) or (not ok and not hold.accepted):
            await self._release(engine, "the update ended")
        else:
            self._arm_deadline(engine)

    async def _commit(
        self, engine: Any, scope: dict, receive: Receive, send: Send
    ) -> None:
        """A staged engine's ``finish_weight_update``, or the finish of a LoRA
        adapter push: generation is held for just this call, and the KV the
        old weights computed is dropped before it resumes."""
        try:
            await self._take_hold(engine, None)
        except Exception as e:
            logger.exception("Could not hold generation for a commit")
            await _json_response(
                send,
                503,
                "could not pause generation for the commit "
                f"({type(e).__name__}: {e}); nothing was committed and the "
                "staged update is still open: retry finish_weight_update, or "
                "abort it",
            )
            return

        async def then(ok: bool) -> None:
            await self._release(engine, "the staged update's commit answered")

        await self._call(scope, receive, send, then)

    async def _resume(
        self, engine: Any, scope: dict, receive: Receive, send: Send
    ) -> None:
        if self._hold is None or not self._hold.paused:
            # Nothing lands in place (none open, or an adapter being staged).
            await self.app(scope, receive, send)
            return
        await _json_response(
            send,
            409,
            "an in-place weight update is landing: resuming generation now "
            "would run the model on partly written weights. Finish the update "
            "(finish_weight_update) or abort it (update_weights {'abort': "
            "'<reason>'} then finish_weight_update); generation resumes then",
        )

    # -- hold and release ----------------------------------------------------

    async def _call(
        self,
        scope: dict,
        receive: Receive,
        send: Send,
        then: Callable[[bool], Awaitable[None]],
    ) -> None:
        """Run the route with the deadline suspended, then ``then(ok)``
        (release, or re-arm the deadline) before the client hears the end of
        the answer: a finish returns once generation serves again, and the
        middlewares around see the same order. ``then`` runs once, also when
        the route raises."""
        status = 500
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
                await then(200 <= status < 300)
            except Exception:
                # The route's answer still goes out; the log says what the
                # guard could not do (a resume that failed twice).
                logger.exception("The weight update guard's follow-up failed")

        async def forward(message: dict) -> None:
            nonlocal status
            kind = message.get("type")
            if kind == "http.response.start":
                status = int(message.get("status", 500))
            elif kind == "http.response.body" and not message.get("more_body"):
                await follow_up()
            await send(message)

        if hold is not None:
            hold.calls_in_flight += 1
            _cancel(hold)
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
                self._hold = _Hold()
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
            publication = _publication_id(update_info)
            if publication is not None:
                self._hold.publication_id = publication

    async def _release(self, engine: Any, why: str) -> None:
        async with self._lock:
            hold, self._hold = self._hold, None
            if hold is None:
                return
            _cancel(hold)
            if not hold.owns_pause:
                return
            logger.info("Resuming generation: %s", why)
            try:
                # Frozen requests hold KV computed by the previous weights.
                await engine.reset_prefix_cache(reset_running_requests=True)
            finally:
                await _resume_once_more(engine)

    def _arm_deadline(self, engine: Any) -> None:
        hold = self._hold
        if hold is None or hold.calls_in_flight:
            return
        _cancel(hold)
        timeout_s = float(_config(engine).update_timeout_s)
        loop = asyncio.get_running_loop()

        def expire() -> None:
            hold.deadline = None
            hold.expiry = asyncio.ensure_future(self._expire(engine, hold, timeout_s))

        hold.deadline = loop.call_later(timeout_s, expire)

    async def _expire(self, engine: Any, hold: _Hold, timeout_s: float) -> None:
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


_START_ROUTES = ("/start_weight_update", "/start_draft_weight_update")
_ROUTES = (
    "/update_weights",
    "/finish_weight_update",
    *_START_ROUTES,
    "/pause",
    "/resume",
)


def _route(scope: dict) -> str | None:
    """The guarded route this request is for, or None."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "")).rstrip("/")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    return path if path in _ROUTES else None


def _config(engine: Any) -> Any:
    return engine.vllm_config.weight_transfer_config


def _cancel(hold: _Hold) -> None:
    if hold.deadline is not None:
        hold.deadline.cancel()
        hold.deadline = None


async def _resume_once_more(engine: Any) -> None:
    try:
        await engine.resume_generation()
    except Exception:
        logger.exception("resume_generation failed; trying once more")
        await engine.resume_generation()


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a ``receive`` that hands it to the route."""
    chunks = []
    while True:
        message = await receive()
        if message.get("type") != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _update_info(body: bytes) -> Any:
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return None
    return value.get("update_info") if isinstance(value, dict) else None


def _items(update_info: Any) -> list[Any]:
    # A list holds one message per worker rank (data parallel).
    return update_info if isinstance(update_info, list) else [update_info]


def _carries_weights(update_info: Any) -> bool:
    """Anything but an abort or prepare message may land weights (a malformed
    body too: the engine refuses it, and the release follows)."""
    return not any(
        isinstance(item, dict) and (ABORT_FIELD in item or PREPARE_FIELD in item)
        for item in _items(update_info)
    )


def _carries_adapter(update_info: Any) -> bool:
    """Whether a message carries a LoRA adapter (``lora_adapters``)."""
    return any(
        isinstance(item, dict) and ADAPTER_KEY in item for item in _items(update_info)
    )


def _publication_id(update_info: Any) -> str | None:
    """The id a valid publication header in the message names, if any."""
    for item in _items(update_info):
        if isinstance(item, dict) and PUBLICATION_FIELD in item:
            try:
                header = PublicationHeader.from_dict(item[PUBLICATION_FIELD])
            except (TypeError, ValueError):
                continue  # the worker refuses it; the label says "unknown"
            return header.publication_id
    return None


def _with_header(send: Send, name: str, value: str) -> Send:
    """``send`` that adds one header to the response."""

    async def send_with_header(message: dict) -> None:
        if message.get("type") == "http.response.start":
            headers = list(message.get("headers", []))
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_header


async def _json_response(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
