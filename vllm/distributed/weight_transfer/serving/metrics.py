# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sync metrics on the server: Prometheus samples from the RL routes. (The
per-sync log line of each side is ``verification.record.SyncRecord``.)

Prometheus metrics live in the process that serves ``/metrics``: the API
server. Worker engines run in worker processes whose registries ``vllm serve``
does not export (``PROMETHEUS_MULTIPROC_DIR`` is only set with
``--api-server-count > 1``; upstream ships worker statistics to the front end
inside engine outputs instead, which weight operations do not travel through).
So ``RouteSyncObserver`` records in the API server from what the RL routes
see: ``start_weight_update`` opens a sync, the publication header in
``update_weights`` names its backend and bytes, a successful
``finish_weight_update`` commits it, and a failing route, an ``abort`` message
or a ``fenced:`` weight version counts a failure. It sits next to upstream's
``vllm:rl_weight_update_operation_*`` metrics and uses the same registry
(prometheus_client's default, multiprocess-safe):

* ``vllm:weight_transfer_syncs_total{backend}``: committed syncs;
* ``vllm:weight_transfer_bytes_total{backend}``: tensor bytes published by
  committed syncs (``publication.payload_bytes``; 0 without a header);
* ``vllm:weight_transfer_sync_seconds{backend}``: start to end of finish;
* ``vllm:weight_transfer_failures_total{backend,phase}``: phase is ``start``,
  ``update``, ``finish``, ``abort`` (the trainer aborted before its prepare
  message) or ``verify`` (the trainer aborted after the workers prepared: it
  rejected the receipts, of this engine or another; or, from a trainer that
  verifies after finish, a ``fenced:`` version set after a commit).

``WeightSyncMetricsMiddleware`` feeds the observer from the RL routes. The
fork's ``register_rl_api_routers`` installs it next to upstream's RL router, so
every ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` records these metrics
without flags. Naming it again with ``--middleware`` is harmless: a request is
observed once however many copies wrap it.
With several API servers, start and finish may reach different processes;
the observer is per process, so sync durations are only recorded when one
process saw the whole sync.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from threading import Lock
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from vllm.distributed.weight_transfer.common.asgi import json_object, post_route
from vllm.distributed.weight_transfer.common.messages import (
    ADAPTER_KEY,
    MessageKind,
    first_message,
    update_kind,
)
from vllm.distributed.weight_transfer.verification.fence import (
    is_fenced_version,
    is_prepare_request,
)
from vllm.distributed.weight_transfer.verification.wire import (
    PUBLICATION_FIELD,
    PublicationHeader,
)

# ---------------------------------------------------------------------------
# Prometheus (API server process)


class WeightTransferMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.syncs = Counter(
            "vllm:weight_transfer_syncs",
            "Committed weight syncs.",
            ["backend"],
            registry=registry,
        )
        self.bytes = Counter(
            "vllm:weight_transfer_bytes",
            "Tensor bytes published by committed weight syncs.",
            ["backend"],
            registry=registry,
        )
        self.sync_seconds = Histogram(
            "vllm:weight_transfer_sync_seconds",
            "Duration of a committed weight sync, start to end of finish.",
            ["backend"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=registry,
        )
        self.failures = Counter(
            "vllm:weight_transfer_failures",
            "Failed weight syncs, by the phase that failed.",
            ["backend", "phase"],
            registry=registry,
        )


T = TypeVar("T")


class _OnFirstUse(Generic[T]):
    """This process's one ``make()``, made at the first ``get`` (once, however
    many threads ask)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = Lock()
        self.value: T | None = None

    def get(self) -> T:
        if self.value is None:
            with self._lock:
                if self.value is None:
                    self.value = self._make()
        return self.value


# Made on first use, after vLLM configured multiprocess Prometheus.
_metrics = _OnFirstUse(WeightTransferMetrics)


def weight_transfer_metrics() -> WeightTransferMetrics:
    return _metrics.get()


@dataclass
class _OpenSync:
    started: float
    backend: str
    header: PublicationHeader | None = None
    failed: bool = False
    # The trainer's prepare message went through: receipts are out.
    prepared: bool = False
    # A LoRA adapter push: the adapter's name, int id and version label.
    adapter: dict[str, Any] | None = None


class RouteSyncObserver:
    """Turns the RL routes' outcomes into sync metrics; see the module docstring.

    ``observe_route`` is called once per route, after it answered.
    """

    def __init__(
        self,
        metrics: Callable[[], WeightTransferMetrics] = weight_transfer_metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._lock = Lock()
        self._open: _OpenSync | None = None
        self._last_committed: str | None = None  # backend of the last commit
        # The publication the last committed sync carried (None without one).
        self._committed_header: PublicationHeader | None = None
        # The last committed push of each LoRA adapter, by name.
        self._adapters: dict[str, dict[str, Any]] = {}

    def observe_route(
        self,
        operation: str,
        *,
        started: float,
        ok: bool,
        backend: str,
        update_info: Any = None,
        new_version: str | None = None,
    ) -> None:
        with self._lock:
            self._observe(operation, started, ok, backend, update_info, new_version)

    def update_status(self) -> dict[str, Any]:
        """What this process's routes saw of the weight updates, JSON-safe:
        ``open`` is the update started and not yet finished (``None`` when
        there is none), with the publication its messages named, how long it
        has been open, whether the trainer's prepare message went through
        (every worker attested what it received or staged) and whether a call
        of it failed, and ``adapter`` for a LoRA adapter push; ``committed``
        is the publication of the last base-weight update that finished;
        ``adapters`` the last push of each LoRA adapter that finished (its
        name, int id and version label). ``GET /weight_update_status``
        serves it."""
        with self._lock:
            sync = self._open
            opened = None
            if sync is not None:
                opened = {
                    **_publication_fields(sync.header),
                    "backend": _backend(sync),
                    "seconds_open": round(self._clock() - sync.started, 3),
                    "prepared": sync.prepared,
                    "failed": sync.failed,
                    "adapter": sync.adapter,
                }
            committed = (
                _publication_fields(self._committed_header)
                if self._committed_header is not None
                else None
            )
            adapters = {name: dict(a) for name, a in self._adapters.items()}
        return {"open": opened, "committed": committed, "adapters": adapters}

    def _observe(
        self,
        operation: str,
        started: float,
        ok: bool,
        backend: str,
        update_info: Any,
        new_version: str | None,
    ) -> None:
        m = self._metrics()
        sync = self._open
        if operation == "start":
            if not ok:
                # A refused start opens nothing and closes nothing: the update
                # open before (if any) is still open on the workers.
                m.failures.labels(backend, "start").inc()
                return
            if sync is not None and not sync.failed:
                # The previous sync never finished; a new start abandons it.
                m.failures.labels(_backend(sync), "finish").inc()
            self._open = _OpenSync(started, backend)
            return
        if operation == "update":
            header, aborted = _inspect_update(update_info)
            if sync is None:
                return
            if header is not None and sync.header is None:
                sync.header = header
            adapter = _adapter_of(update_info)
            if adapter is not None and sync.adapter is None:
                sync.adapter = adapter
            if ok and is_prepare_message(update_info):
                sync.prepared = True
            if not sync.failed and (not ok or aborted):
                sync.failed = True
                phase = (
                    "update" if not aborted else "verify" if sync.prepared else "abort"
                )
                m.failures.labels(_backend(sync), phase).inc()
            return
        if operation == "finish":
            self._open = None
            if sync is None:
                return
            if not ok and not sync.failed:
                m.failures.labels(_backend(sync), "finish").inc()
            if ok and not sync.failed:
                label = _backend(sync)
                m.syncs.labels(label).inc()
                m.bytes.labels(label).inc(
                    sync.header.payload_bytes if sync.header else 0
                )
                m.sync_seconds.labels(label).observe(self._clock() - sync.started)
                self._last_committed = label
                if sync.adapter is not None:
                    # An adapter push leaves the base weights as they were.
                    self._adapters[sync.adapter["name"]] = sync.adapter
                else:
                    self._committed_header = sync.header
            else:
                self._last_committed = None
            return
        if (
            operation == "update_weight_version"
            and ok
            and is_fenced_version(new_version)
            and self._last_committed
        ):
            # The server committed but the trainer rejected the receipts.
            m.failures.labels(self._last_committed, "verify").inc()
            self._last_committed = None


def _backend(sync: _OpenSync) -> str:
    return sync.header.backend if sync.header is not None else sync.backend


def _publication_fields(header: PublicationHeader | None) -> dict[str, Any]:
    """The publication id, model version and payload bytes of ``header``
    (``None`` each for an update without a publication header)."""
    return {
        "publication_id": header.publication_id if header else None,
        "model_version": header.model_version if header else None,
        "payload_bytes": header.payload_bytes if header else None,
    }


def is_prepare_message(update_info: Any) -> bool:
    """Whether an update payload is the trainer's prepare message to every
    worker (a malformed one is the worker's to refuse; the route then fails)."""
    if update_kind(update_info) is not MessageKind.PREPARE:
        return False
    with contextlib.suppress(ValueError):
        return is_prepare_request(first_message(update_info))
    return False


def _adapter_of(update_info: Any) -> dict[str, Any] | None:
    """Name, int id and version label of a LoRA adapter push's message
    (``lora_adapters.AdapterHeader``), or None for any other kind."""
    if update_kind(update_info) is not MessageKind.ADAPTER:
        return None
    adapter = first_message(update_info).get(ADAPTER_KEY)
    if isinstance(adapter, dict) and isinstance(adapter.get("name"), str):
        return {
            "name": adapter["name"],
            "lora_id": adapter.get("lora_id"),
            "version": adapter.get("version"),
        }
    return None


def _inspect_update(update_info: Any) -> tuple[PublicationHeader | None, bool]:
    """The publication header of an update payload, and whether it aborts,
    by the kind ``common.messages`` gives the body. Only base weights name a
    publication here: a LoRA adapter push's publication orders that
    adapter's versions, not the base weights'."""
    kind = update_kind(update_info)
    header = None
    if kind is MessageKind.WEIGHTS:
        message = first_message(update_info)
        if PUBLICATION_FIELD in message:
            # An invalid header is the worker's to reject; the route then fails.
            with contextlib.suppress(ValueError):
                header = PublicationHeader.from_dict(message[PUBLICATION_FIELD])
    return header, kind is MessageKind.ABORT


_observer = _OnFirstUse(RouteSyncObserver)


def route_sync_observer() -> RouteSyncObserver:
    return _observer.get()


# ---------------------------------------------------------------------------
# ASGI middleware around the RL routes

# The RL routes the observer needs, as upstream's router mounts them.
ROUTE_OPERATIONS = {
    "/start_weight_update": "start",
    "/update_weights": "update",
    "/finish_weight_update": "finish",
    "/update_weight_version": "update_weight_version",
}
_PARSED = {"update", "update_weight_version"}
# Set on the ASGI scope by the outermost copy, so nested copies pass through.
_OBSERVED = "vllm.weight_sync_observed"


class WeightSyncMetricsMiddleware:
    """Observes the RL weight routes of an ASGI app for ``RouteSyncObserver``.

    Installed by ``register_rl_api_routers``; see the module docstring.
    """

    def __init__(self, app: Any, observer: RouteSyncObserver | None = None) -> None:
        self.app = app
        self.observer = observer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        operation = ROUTE_OPERATIONS.get(post_route(scope) or "")
        if operation is None or scope.get(_OBSERVED):
            await self.app(scope, receive, send)
            return
        scope[_OBSERVED] = True
        body = bytearray()
        status = 500

        async def receive_and_keep() -> dict:
            message = await receive()
            if operation in _PARSED and message.get("type") == "http.request":
                body.extend(message.get("body", b""))
            return message

        started = time.monotonic()
        observed = False

        def observe() -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            parsed = json_object(bytes(body))
            observer = self.observer or route_sync_observer()
            observer.observe_route(
                operation,
                started=started,
                ok=200 <= status < 300,
                backend=_configured_backend(scope),
                update_info=parsed.get("update_info"),
                new_version=parsed.get("new_version"),
            )

        async def send_and_note(message: dict) -> None:
            nonlocal status
            kind = message.get("type")
            if kind == "http.response.start":
                status = int(message.get("status", 500))
            elif kind == "http.response.body" and not message.get("more_body"):
                # Counted before the client hears the end of the answer, so a
                # scrape right after the call already sees it.
                observe()
            await send(message)

        try:
            await self.app(scope, receive_and_keep, send_and_note)
        finally:
            observe()


def _configured_backend(scope: dict) -> str:
    try:
        config = scope["app"].state.engine_client.vllm_config
        return str(config.weight_transfer_config.backend)
    except (AttributeError, KeyError):
        return "unknown"
