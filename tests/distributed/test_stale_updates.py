# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A new trainer recovers from one that died mid-sync without manual steps."""

import pytest

from vllm.distributed.weight_transfer.stale_updates import start_update


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
