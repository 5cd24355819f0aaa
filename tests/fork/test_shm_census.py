# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The parallel test run's census of /dev/shm entries: another process tree's
held entries and pid-named segments are left out, everything else counts."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.distributed.weight_transfer.testing.shm_census import own_fork_entries


@pytest.fixture
def other_process() -> Iterator[int]:
    """A live process outside this process's tree as seen from its own root:
    a child, whose tree does not contain this process."""
    child = subprocess.Popen(["sleep", "60"])
    yield child.pid
    child.kill()
    child.wait()


def _held_dir(path: Path) -> int:
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_an_entry_held_by_this_process_counts_only_from_its_own_tree(
    tmp_path: Path, other_process: int
):
    fd = _held_dir(tmp_path / "vllm-wt-receipts-abcdefgh")
    try:
        assert own_fork_entries(tmp_path) == {"vllm-wt-receipts-abcdefgh"}
        assert own_fork_entries(tmp_path, tree_root=other_process) == set()
    finally:
        os.close(fd)
    # Once nobody holds it, it counts for everyone (a leak, a dead trainer's).
    assert own_fork_entries(tmp_path, tree_root=other_process) == {
        "vllm-wt-receipts-abcdefgh"
    }


def test_segments_named_after_another_tree_are_left_out(
    tmp_path: Path, other_process: int
):
    mine = f"vllm-wt-{os.getpid()}-0-seg"
    theirs = f"vllm-wt-{other_process}-0-seg"
    for name in (mine, theirs, "unrelated-file"):
        (tmp_path / name).write_bytes(b"x")
    assert own_fork_entries(tmp_path) == {mine, theirs}  # the child is ours
    assert own_fork_entries(tmp_path, tree_root=other_process) == {theirs}
    assert own_fork_entries(tmp_path, prefix="vllm-wt-receipts-") == set()
