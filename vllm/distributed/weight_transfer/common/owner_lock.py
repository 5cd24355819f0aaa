# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ownership of the files and directories a trainer leaves in a shared
directory (``/dev/shm`` segments, receipt directories), told by a lock.

The process that creates an entry takes an exclusive ``flock(2)`` on it at
once (``lock_new``) and keeps that descriptor open for as long as the entry
lives. ``reap_unowned`` removes the entries of a directory on which it can take
the same lock without waiting: nobody holds it anywhere, so their creator is
gone.

The lock belongs to the open file description, not to a process id, so:

* it holds across PID namespaces: every process that sees the file (two
  containers sharing ``/dev/shm`` and the uid) sees the lock, whatever pid
  the owner has in its own namespace;
* it holds while the owner maps the file, and a child the owner forks
  shares the description and keeps the lock while it lives (an exec'd child
  does not: the descriptor is close-on-exec);
* the kernel drops it when the last descriptor of that description goes,
  which includes the owner being killed with SIGKILL;
* a process that opens the entry itself (a worker mapping a segment, a
  reaper) has a description of its own and never takes over the owner's lock.

A reaper may come between an owner's ``mkdir``/``open`` and its lock; it then
holds the lock or has removed the name, ``lock_new`` says so, and the owner
creates the entry again.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time
from collections.abc import Callable

from vllm.logger import init_logger

logger = init_logger(__name__)

# How often an owner creates its entry again after a reaper took the new one.
CREATE_ATTEMPTS = 3


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _names(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return _identity(st) == _identity(os.fstat(fd))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_new(fd: int, path: str) -> bool:
    """Take the owner's lock on ``fd``, the entry just created at ``path``.

    False when a reaper took the entry first (it holds the lock, or the name
    is gone or names another file): the caller closes ``fd`` and creates the
    entry again. On True, the entry is owned while ``fd`` stays open.
    """
    return _try_lock(fd) and _names(fd, path)


def create_owned(create: Callable[[], tuple[str, int | None]]) -> tuple[str, int]:
    """An entry created by ``create`` and owned: ``create()`` makes an entry
    and returns its path and an open descriptor of it (None when the entry was
    gone before it could be opened); a new entry that a reaper takes before
    ``lock_new`` is made again. Returns the path and the owner's descriptor."""
    for attempt in range(CREATE_ATTEMPTS):
        path, fd = create()
        if fd is not None:
            if lock_new(fd, path):
                return path, fd
            os.close(fd)
        # The reaper holding the lock finishes removing the entry first.
        time.sleep(0.01 * (attempt + 1))
    raise RuntimeError(
        f"{path} was removed by another process's reaper right after it was "
        f"created, {CREATE_ATTEMPTS} times in a row; something outside this "
        "trainer deletes entries there, stop it and retry"
    )


def _open_entry(path: str, is_dir: bool) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    return os.open(path, flags | (os.O_DIRECTORY if is_dir else 0))


def _reap_one(
    path: str, st: os.stat_result, is_dir: bool, remove: Callable[[str], None]
) -> bool:
    """Remove ``path`` (``st`` being its lstat) if nobody holds its lock."""
    fd = _open_entry(path, is_dir)
    try:
        # The name must still be the entry looked at, and its owner gone.
        if _identity(os.fstat(fd)) != _identity(st) or not _try_lock(fd):
            return False
        if not _names(fd, path):
            return False
        remove(path)
        return True
    finally:
        os.close(fd)  # releases the lock


def reap_unowned(
    root: str,
    pattern: re.Pattern[str],
    *,
    is_dir: bool,
    remove: Callable[[str], None],
    what: str,
) -> list[str]:
    """Remove the entries of ``root`` whose names fullmatch ``pattern``, that
    are this user's regular files (directories when ``is_dir``) and whose
    owner's lock nobody holds; return their names. ``what`` names them in
    the log. Symbolic links and other users' entries are left alone."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    uid = os.getuid()
    is_kind = stat.S_ISDIR if is_dir else stat.S_ISREG
    removed = []
    for entry in entries:
        if pattern.fullmatch(entry.name) is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != uid or not is_kind(st.st_mode):
                continue
            if _reap_one(entry.path, st, is_dir, remove):
                removed.append(entry.name)
        except OSError:
            continue  # gone meanwhile, or not ours to open
    if removed:
        logger.info(
            "Removed %d %s left by processes that exited: %s",
            len(removed),
            what,
            ", ".join(removed[:5]),
        )
    return removed
