# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A new trainer recovers from one that died mid-sync without manual steps."""

import pytest

from vllm.distributed.weight_transfer.trainer.start_update import (
    UpdateStillOpen,
    start_update,
)


class Server:
    """Records calls; start refuses like vLLM's Worker while an update is open."""

    def __init__(self, open_update: bool) -> None:
        self.open = open_update
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start")
        if self.open:
            raise RuntimeError(
                "start_weight_update called while a weight update is already "
                "active. Call finish_weight_update first."
            )
        self.open = True

    def update_weights(self, info) -> None:
        self.calls.append(f"update {sorted(info)}")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")
        self.open = False


def test_a_clean_server_gets_one_start():
    server = Server(open_update=False)
    start_update(server, "test")
    assert server.calls == ["start"]


def test_an_update_left_open_is_abandoned_then_started_again():
    server = Server(open_update=True)
    start_update(server, "test")
    assert server.calls == ["start", "update ['abort']", "finish", "start"]


def test_other_refusals_are_raised():
    class Refuses(Server):
        def start_weight_update(self) -> None:
            raise RuntimeError("no weight transfer engine configured")

    with pytest.raises(RuntimeError, match="no weight transfer engine"):
        start_update(Refuses(open_update=False), "test")


class ClosesLater(Server):
    """An update that its owner finishes after ``closes_after`` refusals."""

    def __init__(self, closes_after: int) -> None:
        super().__init__(open_update=True)
        self.closes_after = closes_after

    def start_weight_update(self) -> None:
        if self.open and self.calls.count("start") >= self.closes_after:
            self.open = False  # its owner finished meanwhile
        super().start_weight_update()


def test_without_take_over_the_open_update_is_waited_for_never_abandoned(
    monkeypatch,
):
    monkeypatch.setattr("time.sleep", lambda s: None)
    server = ClosesLater(closes_after=3)
    start_update(server, "a LoRA pusher", take_over=False, wait_s=60)
    assert server.calls == ["start", "start", "start", "start"]


def test_without_take_over_a_lasting_update_raises_naming_it():
    class Refuses409(Server):
        def start_weight_update(self) -> None:
            self.calls.append("start")
            raise RuntimeError(
                "POST /start_weight_update failed with HTTP 409: a weight "
                "update is already active on this server (publication "
                "pub-0123456789, open 3.0 s)"
            )

    server = Refuses409(open_update=True)
    with pytest.raises(UpdateStillOpen, match="publication pub-0123456789") as e:
        start_update(server, "a LoRA pusher", take_over=False, wait_s=0.2)
    assert "wait_s=0.2" in str(e.value)
    assert all(call == "start" for call in server.calls)  # nothing abandoned


def test_a_take_over_names_the_abandoned_publication_in_the_abort(caplog):
    class Open409(Server):
        def start_weight_update(self) -> None:
            if self.open:
                self.calls.append("start")
                raise RuntimeError(
                    "HTTP 409: a weight update is already active on this server "
                    "(publication pub-0123456789, open 3.0 s)"
                )
            super().start_weight_update()

        def update_weights(self, info) -> None:
            self.calls.append(f"abort {info['abort']}")

    server = Open409(open_update=True)
    start_update(server, "trainer B")
    assert server.calls[1] == (
        "abort abandoned: trainer B started a new sync while this update was "
        "open (publication pub-0123456789)"
    )
    assert server.calls[2:] == ["finish", "start"]
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and "pub-0123456789" in lines[0]


def test_wait_s_must_be_finite():
    with pytest.raises(ValueError, match="wait_s"):
        start_update(Server(open_update=False), "x", wait_s=float("inf"))
