# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps the multiprocess executor's RPC replies in step after a worker fails.

vLLM 0.32's ``MultiprocExecutor.collective_rpc`` reads one reply per worker,
in rank order, and raises as soon as one reply is a failure. The replies of
the workers after that rank stay queued, and the queues carry no call id, so
every later RPC on the engine reads the previous call's reply from those
workers: at tensor parallel size 2, one refused ``update_weights`` makes each
later ``start``, ``update`` and ``finish`` report rank 1's answer to the call
before it, for the life of the engine. (Upstream tracks this as vLLM issue
#49972 and PR #57846, not in 0.32.)

A weight update is refused on purpose in many cases (a bad manifest, a
checksum, a deadline), so the fork installs a fix as a vLLM general plugin
(entry point ``vllm.general_plugins``, loaded in every engine process before
the executor starts):

- Each worker's response queue is wrapped once. A failure reply is handed to
  vLLM's reader as a successful ``WorkerFailure`` value, so the reader goes on
  and takes every worker's reply of that call off its queue.
- ``collective_rpc`` then raises ``RuntimeError`` for the first failure, with
  vLLM's message: at once for a blocking call, and from the future (before its
  aggregation) for a non-blocking one. Callers see the same exception as
  before; only the queues stay aligned.
- A ``WorkerFailure`` that reaches code expecting a real reply (an output
  aggregator) raises the same error on any attribute access.

Timeouts are left as vLLM handles them. Set ``VLLM_PLUGINS`` to a list without
``weight_transfer_rpc_replies`` to run without the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

_INSTALLED = "_weight_transfer_replies_aligned"


class WorkerFailure:
    """A worker's failure reply, read off its queue in step with the others."""

    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message

    def error(self) -> RuntimeError:
        # vLLM's own wording, so callers that match on it are unaffected.
        return RuntimeError(
            f"Worker failed with error '{self.message}', please check the stack "
            "trace above for the root cause"
        )

    def __getattr__(self, name: str) -> Any:
        raise self.error()


class _AlignedReplies:
    """A worker's response queue whose failure replies read as values."""

    def __init__(self, queue: Any, success: Any) -> None:
        self._queue = queue
        self._success = success

    def dequeue(self, *args: Any, **kwargs: Any) -> Any:
        status, result = self._queue.dequeue(*args, **kwargs)
        if status != self._success:
            return self._success, WorkerFailure(result)
        return status, result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def raise_worker_failure(replies: Any) -> Any:
    """``replies`` unchanged, or the first worker failure among them raised."""
    items = replies if isinstance(replies, list) else [replies]
    for item in items:
        if isinstance(item, WorkerFailure):
            raise item.error()
    return replies


def align_response_queues(executor: Any, success: Any) -> None:
    """Wrap each of ``executor``'s response queues once."""
    queues = getattr(executor, "response_mqs", None)
    if not queues or all(isinstance(q, _AlignedReplies) for q in queues):
        return
    executor.response_mqs = [
        q if isinstance(q, _AlignedReplies) else _AlignedReplies(q, success)
        for q in queues
    ]


def aligned_collective_rpc(original: Callable, success: Any) -> Callable:
    """``original`` (``MultiprocExecutor.collective_rpc``) with every worker's
    reply read before a failure is raised."""

    def collective_rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        align_response_queues(self, success)
        out = original(self, *args, **kwargs)
        non_block = kwargs.get("non_block", args[4] if len(args) > 4 else False)
        if non_block:
            # vLLM's future reads the replies when it is resolved, then
            # aggregates them: check them first, so the future fails as before.
            aggregate = out.aggregate
            out.aggregate = lambda replies: aggregate(raise_worker_failure(replies))
            return out
        return raise_worker_failure(out)

    setattr(collective_rpc, _INSTALLED, True)
    collective_rpc.__doc__ = original.__doc__
    collective_rpc.__wrapped__ = original  # type: ignore[attr-defined]
    return collective_rpc


def install() -> None:
    """The plugin: patch ``MultiprocExecutor.collective_rpc`` once."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

    current = MultiprocExecutor.collective_rpc
    if getattr(current, _INSTALLED, False):
        return
    MultiprocExecutor.collective_rpc = aligned_collective_rpc(  # type: ignore[method-assign]
        current, WorkerProc.ResponseStatus.SUCCESS
    )
    logger.debug("Multiprocess executor replies stay aligned after a failure")
