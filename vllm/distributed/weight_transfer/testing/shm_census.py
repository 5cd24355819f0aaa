# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's entries in ``/dev/shm`` (segments and receipt directories) that
belong to this test process, when other test processes (the parallel test
run's other worker) create and remove theirs in the same directory.

An entry is another process tree's when it is held by a process outside this
one's tree (its owner's ``flock``, listed in ``/proc/locks``), or when it is a
segment whose name carries the pid of a process that is neither this one nor
a live descendant of it (``vllm-wt-<pid>-...``). Everything else counts as
this process's: its own and its live children's entries, and the unheld
entries no name ties to anyone (a leak, or a dead trainer's receipt
directory).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm.distributed.weight_transfer.buffers.handles import SHM_NAME_PREFIX

SHM_ROOT = Path("/dev/shm")
# Segments are named <prefix><creator pid>-<random hex> (buffers/shm.py).
_SEGMENT_PID = re.compile(re.escape(SHM_NAME_PREFIX) + r"([0-9]+)-")


def _process_tree(root_pid: int) -> set[int]:
    """``root_pid`` and every live process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def _flock_holders() -> dict[tuple[int, int, int], int]:
    """(device major, device minor, inode) of each flock'ed file -> holder pid."""
    holders = {}
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF"
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        major, minor, inode = fields[5].split(":")
        holders[(int(major, 16), int(minor, 16), int(inode))] = int(fields[4])
    return holders


def own_fork_entries(
    root: Path = SHM_ROOT, prefix: str = SHM_NAME_PREFIX, tree_root: int | None = None
) -> set[str]:
    """Names of ``root``'s entries starting with ``prefix`` that are not
    another process tree's (see the module docstring); the tree is
    ``tree_root``'s (default: this process's)."""
    tree = _process_tree(os.getpid() if tree_root is None else tree_root)
    holders = _flock_holders()
    own = set()
    for entry in os.scandir(root):
        if not entry.name.startswith(prefix):
            continue
        named = _SEGMENT_PID.match(entry.name)
        if named is not None and int(named.group(1)) not in tree:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed by its owner while we looked
            continue
        holder = holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        if holder is not None and holder not in tree:
            continue
        own.add(entry.name)
    return own
