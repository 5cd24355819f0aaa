# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer sync skeleton (``trainer.sync.run_sync``): the order of the
server calls, and what each failure leaves behind (an abort, never a commit,
a fenced or recorded publication)."""

from types import SimpleNamespace
from typing import Any

import pytest

from vllm.distributed.weight_transfer.trainer.group import TrainerGroupError
from vllm.distributed.weight_transfer.trainer.start_update import UpdateStillOpen
from vllm.distributed.weight_transfer.trainer.sync import run_sync


class Client:
    """A server that records every call in ``log``; ``fail`` names calls
    that raise (``"start"``, ``"finish"``: a finish with a version)."""

    def __init__(self, log: list[str], fail: tuple[str, ...] = ()) -> None:
        self.log = log
        self.fail = fail

    def start_weight_update(self) -> None:
        self.log.append("start")
        if "start" in self.fail:
            raise RuntimeError("server refused the start")
        if "open" in self.fail:
            raise RuntimeError("a weight update is already active")

    def update_weights(self, info: dict[str, Any]) -> None:
        self.log.append(f"update {sorted(info.items())}")

    def finish_weight_update(self, *version: str) -> None:
        self.log.append(f"finish {list(version)}")
        if version and "finish" in self.fail:
            raise RuntimeError("finish failed")


class Publication:
    """The parts of a ``TrainerPublication`` the skeleton uses, recording
    into the client's log; ``verify`` raises when ``refuse`` is set."""

    def __init__(self, log: list[str], refuse: bool = False) -> None:
        self.log = log
        self.refuse = refuse
        self.header = SimpleNamespace(publication_id="pub-1")
        self.record = SimpleNamespace(finish=self._record, log=lambda _: None)

    def verify(self, expected: Any, *, timeout_s: float, **options: Any) -> None:
        self.log.append(f"verify {expected} {timeout_s} {options}")
        if self.refuse:
            raise ValueError("receipt of worker 1 is missing")

    def fail(self, client: Any, error: BaseException, workers: Any) -> None:
        self.log.append(f"fence {workers} {error}")

    def _record(self, *, ok: bool, error: BaseException) -> None:
        self.log.append(f"record ok={ok} {error}")

    def close(self) -> None:
        self.log.append("close")


def sync(
    log: list[str],
    client: Client,
    pub: Publication | None,
    send: Any = None,
    **choices: Any,
) -> None:
    run_sync(
        client,  # type: ignore[arg-type]
        send or (lambda: client.update_weights({"chunk": 0})),
        who="test trainer",
        pub=pub,  # type: ignore[arg-type]
        expected=lambda: [0, 1],
        receipt_timeout_s=5.0,
        weight_version=choices.pop("weight_version", "v1"),
        **choices,
    )


ABORT = "update [('abort', 'test trainer: {}')]"


def test_a_verified_sync_prepares_verifies_then_commits():
    log: list[str] = []
    verified: list[Any] = []
    pub = Publication(log)
    sync(
        log,
        Client(log),
        pub,
        on_verified=verified.append,
        verify_options={"delivery": "sliced"},
    )
    assert log == [
        "start",
        "update [('chunk', 0)]",
        "update [('prepare', 'pub-1')]",
        "verify [0, 1] 5.0 {'delivery': 'sliced'}",
        "finish ['v1']",
        "close",
    ]
    assert verified == [pub]


def test_an_unverified_sync_sends_then_commits():
    log: list[str] = []
    sync(log, Client(log), None, weight_version=None)
    assert log == ["start", "update [('chunk', 0)]", "finish []"]


def test_a_failing_send_aborts_and_fences():
    log: list[str] = []

    def send() -> None:
        raise RuntimeError("chunk 3 did not land")

    aborted: list[str] = []
    with pytest.raises(RuntimeError, match="chunk 3 did not land"):
        sync(
            log,
            Client(log),
            Publication(log),
            send=send,
            on_abort=lambda: aborted.append("cleanup"),
        )
    assert log == [
        "start",
        ABORT.format("chunk 3 did not land"),
        "finish []",
        "fence [0, 1] chunk 3 did not land",
        "close",
    ]
    assert aborted == ["cleanup"]


def test_failed_verification_never_commits():
    log: list[str] = []
    with pytest.raises(ValueError, match="worker 1 is missing"):
        sync(log, Client(log), Publication(log, refuse=True))
    assert "finish ['v1']" not in log
    assert log[-4:] == [
        ABORT.format("receipt of worker 1 is missing"),
        "finish []",
        "fence [0, 1] receipt of worker 1 is missing",
        "close",
    ]


def test_a_failing_commit_is_aborted():
    log: list[str] = []
    with pytest.raises(RuntimeError, match="finish failed"):
        sync(log, Client(log, fail=("finish",)), Publication(log))
    assert log[-5:] == [
        "finish ['v1']",
        ABORT.format("finish failed"),
        "finish []",
        "fence [0, 1] finish failed",
        "close",
    ]


def test_a_refused_start_is_not_aborted():
    log: list[str] = []
    with pytest.raises(RuntimeError, match="refused the start"):
        sync(log, Client(log, fail=("start",)), Publication(log))
    assert log == ["start", "fence [0, 1] server refused the start", "close"]


def test_a_push_waits_for_an_open_update_and_only_records_its_failure():
    log: list[str] = []
    with pytest.raises(UpdateStillOpen, match="left to its owner"):
        sync(
            log,
            Client(log, fail=("open",)),
            Publication(log),
            take_over=False,
            wait_s=0.0,
            fence=False,
        )
    assert log[0] == "start" and log[-1] == "close"
    assert not any(e.startswith(("update", "finish", "fence")) for e in log)
    assert log[-2].startswith("record ok=False test trainer did not start")


def test_the_version_function_is_read_right_before_the_commit():
    log: list[str] = []

    def version() -> str:
        log.append("label read")
        return "base+a@v2"

    sync(log, Client(log), None, weight_version=version)
    assert log[-2:] == ["label read", "finish ['base+a@v2']"]


class OtherRank:
    """The group of a trainer rank that is not the sender: each step's
    outcome comes from the sender through ``exchange``."""

    world_size = 2

    def __init__(self, log: list[str], failing: str | None = None) -> None:
        self.log = log
        self.failing = failing

    def exchange(self, payload: Any, error: str | None, what: str) -> dict:
        self.log.append(f"exchange {what}")
        if what == self.failing:
            raise TrainerGroupError(f"{what} failed on trainer rank 0")
        return {1: payload}


def test_another_rank_sends_and_joins_every_step_without_calling_the_server():
    log: list[str] = []
    sent: list[str] = []
    sync(
        log,
        Client(log),
        None,
        send=lambda: sent.append("rank 1 gathered"),
        group=OtherRank(log),
        is_sender=False,
        verify=True,
    )
    assert sent == ["rank 1 gathered"]
    assert log == [
        "exchange start_weight_update",
        "exchange verify receipts",
        "exchange finish_weight_update",
    ]


def test_another_rank_raises_the_senders_failure_without_aborting():
    log: list[str] = []
    with pytest.raises(TrainerGroupError, match="verify receipts failed"):
        sync(
            log,
            Client(log),
            None,
            group=OtherRank(log, failing="verify receipts"),
            is_sender=False,
            verify=True,
        )
    assert not any(e.startswith(("update [('abort'", "finish")) for e in log)
