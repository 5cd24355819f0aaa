# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A new trainer recovers from one that died mid-sync without manual steps."""

import os
import subprocess
import sys

import pytest

from vllm.distributed.weight_transfer.stale_updates import reap_segments, start_update


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


def test_segments_of_exited_processes_are_reaped(tmp_path):
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(exited.stdout)
    dead = tmp_path / f"vllm-wt-{dead_pid}-0123abcd"
    mine = tmp_path / f"vllm-wt-{os.getpid()}-0123abcd"
    other = tmp_path / "unrelated-file"
    target = tmp_path / "target"
    link = tmp_path / f"vllm-wt-{dead_pid}-feedbeef"
    for f in (dead, mine, other, target):
        f.write_bytes(b"x")
    link.symlink_to(target)
    assert reap_segments(str(tmp_path)) == [dead.name]
    assert not dead.exists()
    assert mine.exists() and other.exists() and link.is_symlink() and target.exists()


def test_old_receipt_directories_are_reaped(tmp_path):
    from vllm.distributed.weight_transfer.stale_updates import reap_receipt_dirs

    old = tmp_path / "vllm-wt-receipts-deadbeef01"
    new = tmp_path / "vllm-wt-receipts-cafebabe02"
    for d in (old, new):
        d.mkdir()
        (d / "worker-0-0123456789abcdef.json").write_text("{}")
    os.utime(old, (0, 0))
    assert reap_receipt_dirs(str(tmp_path), max_age_s=3600) == [old.name]
    assert not old.exists() and new.exists()
