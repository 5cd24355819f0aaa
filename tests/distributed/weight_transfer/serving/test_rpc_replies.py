# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``rpc_replies``: after a worker fails an RPC, the next RPC reads that call's
replies, not the failed call's leftovers (vLLM 0.32's multiprocess executor,
driven through scripted response queues; the fork's TP=2 tests run it in real
engines)."""

from __future__ import annotations

from collections import deque
from importlib.metadata import entry_points
from typing import Any

import pytest

from vllm.distributed.weight_transfer.serving import rpc_replies
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

OK = WorkerProc.ResponseStatus.SUCCESS
FAILED = WorkerProc.ResponseStatus.FAILURE


class Broadcast:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def enqueue(self, item: Any) -> None:
        self.sent.append(item)


class Replies:
    """One worker's reply queue: each call appends what that worker answers."""

    def __init__(self) -> None:
        self.queued: deque[tuple[Any, Any]] = deque()

    def dequeue(self, timeout: float | None = None) -> tuple[Any, Any]:
        return self.queued.popleft()


def executor(world_size: int = 2) -> Any:
    ex: Any = MultiprocExecutor.__new__(MultiprocExecutor)
    ex.rpc_broadcast_mq = Broadcast()
    ex.response_mqs = [Replies() for _ in range(world_size)]
    ex.futures_queue = deque()
    ex.is_failed = False
    return ex


def answer(ex: Any, *replies: tuple[Any, Any]) -> None:
    """Queue one call's reply from every worker (by rank)."""
    for mq, reply in zip(ex.response_mqs, replies, strict=False):
        (mq._queue if hasattr(mq, "_queue") else mq).queued.append(reply)


# vLLM's own method: an engine started earlier in this process may have
# loaded the plugin already.
VLLM_COLLECTIVE_RPC = getattr(
    MultiprocExecutor.collective_rpc, "__wrapped__", MultiprocExecutor.collective_rpc
)


@pytest.fixture
def unpatched(monkeypatch):
    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", VLLM_COLLECTIVE_RPC)


@pytest.fixture
def aligned(monkeypatch):
    monkeypatch.setattr(
        MultiprocExecutor,
        "collective_rpc",
        rpc_replies.aligned_collective_rpc(VLLM_COLLECTIVE_RPC, OK),
    )


def test_unpatched_vllm_reads_the_failed_calls_leftover(unpatched):
    """What the plugin fixes, shown on vLLM's own method."""
    ex = executor()
    answer(ex, (FAILED, "rank 0 refused"), (OK, "rank 1 first call"))
    answer(ex, (OK, "rank 0 second call"), (OK, "rank 1 second call"))
    with pytest.raises(RuntimeError, match="rank 0 refused"):
        ex.collective_rpc("update_weights")
    assert ex.collective_rpc("finish_weight_update") == [
        "rank 0 second call",
        "rank 1 first call",
    ]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_the_next_call_reads_its_own_replies(aligned, failing_rank):
    ex = executor()
    first = [(OK, "rank 0 first call"), (OK, "rank 1 first call")]
    first[failing_rank] = (FAILED, f"rank {failing_rank} refused")
    answer(ex, *first)
    answer(ex, (OK, "rank 0 second call"), (OK, "rank 1 second call"))
    with pytest.raises(RuntimeError) as raised:
        ex.collective_rpc("update_weights")
    # vLLM's wording, so callers matching on it are unaffected.
    assert str(raised.value) == (
        f"Worker failed with error 'rank {failing_rank} refused', please check "
        "the stack trace above for the root cause"
    )
    assert ex.collective_rpc("finish_weight_update") == [
        "rank 0 second call",
        "rank 1 second call",
    ]


def test_a_non_blocking_call_fails_from_its_future_and_the_next_is_aligned(aligned):
    ex = executor()
    answer(ex, (FAILED, "boom"), (OK, "stale"))
    answer(ex, (OK, "a"), (OK, "b"))
    future = ex.collective_rpc("execute_model", non_block=True)
    with pytest.raises(RuntimeError, match="boom"):
        future.result()
    assert ex.collective_rpc("sample_tokens") == ["a", "b"]


def test_a_single_reply_call_is_unchanged(aligned):
    ex = executor()
    answer(ex, (OK, "only rank 0 answers"))
    assert ex.collective_rpc("check", unique_reply_rank=0) == "only rank 0 answers"
    answer(ex, (FAILED, "rank 0 refused"))
    with pytest.raises(RuntimeError, match="rank 0 refused"):
        ex.collective_rpc("check", unique_reply_rank=0)


def test_a_failure_reaching_an_aggregator_raises_the_workers_error():
    failure = rpc_replies.WorkerFailure("boom")
    with pytest.raises(RuntimeError, match="Worker failed with error 'boom'"):
        _ = failure.kv_connector_output


def test_install_patches_once_and_is_a_registered_plugin(unpatched):
    rpc_replies.install()
    patched = MultiprocExecutor.collective_rpc
    assert patched.__wrapped__ is VLLM_COLLECTIVE_RPC  # type: ignore[attr-defined]
    rpc_replies.install()
    assert MultiprocExecutor.collective_rpc is patched
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["weight_transfer_rpc_replies"] == (
        "vllm.distributed.weight_transfer.serving.rpc_replies:install"
    )
