# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU data plane of the ``ipc`` backend: byte buffers in POSIX shared memory.

The trainer creates a segment ``/dev/shm/vllm-wt-<pid>-<random>`` (mode 0600),
maps it once and fills it through a uint8 tensor view
(``torch.frombuffer`` over the mapping, so no copy). A worker on the same host
maps the same file once per update and builds typed views into it; it never
copies the whole buffer.

A worker trusts a segment only if it is what the trainer created: it opens the
name with ``O_NOFOLLOW`` (a symbolic link is refused, never followed), requires
a regular file owned by its own uid, and maps it read-only. Before every use of
a mapping it keeps across messages, ``MappedSegment.check`` re-reads the file's
size and identity: a segment truncated under a mapping would make any read
past the new end raise SIGBUS and kill the worker, so a short or replaced
segment is refused with a ``ValueError`` instead.

Lifetime: the trainer owns the file. ``SharedMemoryBuffer.close()`` drops the
mapping and unlinks the file (also on error, via ``with``, when the buffer is
garbage collected, and at interpreter exit); a worker's mapping stays valid
after the unlink until the worker closes it, so nothing is freed under a
reader. Neither side calls ``mmap.close``: a tensor from ``torch.frombuffer``
references the mapping without pinning it, so closing it under a live view
would leave that view pointing at unmapped memory. Each mapping is unmapped
when its last view goes. Only a trainer killed with SIGKILL leaves a file
behind; its name starts with ``vllm-wt-`` and carries the trainer's pid.

Ownership: the trainer holds an exclusive ``flock`` on its segment from
creation until ``close()`` (``owner_lock``). ``reap_segments``, which
trainers call before they create segments, removes this user's segments that
nobody holds that lock on: those of trainers killed before they closed them.
A live trainer's segment is never removed, even when it runs in another PID
namespace and its pid means nothing (or another process) here. A worker opens
the segment without locking it, so its mapping never keeps a dead trainer's
segment, and a worker never removes one.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import warnings
import weakref
from typing import Any

import torch

from vllm.distributed.weight_transfer.buffers.handles import SHM_NAME_PREFIX, ShmHandle
from vllm.distributed.weight_transfer.common.owner_lock import (
    create_owned,
    reap_unowned,
)

SHM_DIR = "/dev/shm"
# The names SharedMemoryBuffer gives its segments.
_SEGMENT_RE = re.compile(re.escape(SHM_NAME_PREFIX) + r"[0-9]+-[0-9a-f]+")


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _uint8_view(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # A shared writable mapping is writable; torch warns about any buffer
        # it cannot prove is.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def _unlink(path: str, owner_fd: int) -> None:
    # The name goes before the owner's lock, so no reaper sees it unowned.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(owner_fd)


def _release(mapping: mmap.mmap, path: str, owner_fd: int) -> None:
    # The mapping is never closed here: tensors made by ``torch.frombuffer``
    # hold a reference to it but no buffer export, so ``mmap.close`` would
    # succeed and leave any view still alive pointing at unmapped memory.
    # Dropping this reference unmaps it once the last view is gone;
    # unlinking frees the file's name now.
    del mapping
    _unlink(path, owner_fd)


def _create_segment() -> tuple[str, int]:
    name = f"{SHM_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
    return _path(name), os.open(_path(name), flags, 0o600)


def reap_segments(root: str | None = None) -> list[str]:
    """Remove this user's ``vllm-wt-<pid>-*`` segments under ``root`` (default
    ``SHM_DIR``) whose owner's lock nobody holds (their trainer is gone);
    return their names."""
    return reap_unowned(
        root or SHM_DIR,
        _SEGMENT_RE,
        is_dir=False,
        remove=os.unlink,
        what="shared-memory segment(s)",
    )


class SharedMemoryBuffer:
    """Trainer side: a new shared-memory segment of ``nbytes`` bytes."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"shared-memory buffer size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        # fd stays open, holding the owner's lock, until the name is unlinked.
        path, fd = create_owned(_create_segment)
        self.name = os.path.basename(path)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mapping = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            _unlink(path, fd)
            raise
        self._owner_fd = fd
        # Any: outlive_views swaps in a finalizer of another signature.
        self._finalizer: Any = weakref.finalize(self, _release, mapping, path, fd)
        self.tensor: torch.Tensor | None = _uint8_view(mapping, nbytes)

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(name=self.name, nbytes=self.nbytes)

    def close(self) -> None:
        """Unlink the name and let go of the mapping, which is unmapped once
        no view of ``tensor`` is left (a view kept by mistake stays valid
        memory, never a dangling pointer). Idempotent."""
        self.tensor = None
        self._finalizer()

    def outlive_views(self) -> None:
        """Say that views of ``tensor`` are meant to outlive this object (the
        parameters placed in the segment): ``close()`` (or garbage collection
        of this object) only unlinks the name, and the mapping goes with the
        last view, as it does in every case."""
        if self._finalizer.detach() is not None:
            self._finalizer = weakref.finalize(
                self, _unlink, _path(self.name), self._owner_fd
            )

    def __enter__(self) -> SharedMemoryBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappedSegment:
    """Worker side: a segment named by ``handle``, mapped shared.

    ``writable=False`` (the worker engine's case) maps it read-only; a
    writable mapping is for tools that edit the trainer's bytes in place.
    The file stays open until ``close()`` so that ``check`` can ``fstat`` it.
    """

    def __init__(self, handle: ShmHandle, *, writable: bool = False) -> None:
        self.handle = handle
        self._mapping: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        path = _path(handle.name)
        # O_NONBLOCK: opening a FIFO planted under the name must not block.
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise ValueError(
                f"shared-memory segment {handle.name!r} does not exist on this "
                "host; the trainer must run on the same host as this worker and "
                "keep the segment open until update_weights returns"
            ) from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(
                    f"shared-memory segment {handle.name!r} is a symbolic link; "
                    "segments must be regular files the trainer created in "
                    f"{SHM_DIR}, so it is refused"
                ) from e
            raise
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(
                    f"shared-memory segment {handle.name!r} is not a regular file "
                    f"(mode {stat.filemode(st.st_mode)}); refusing to map it"
                )
            if st.st_uid != os.geteuid():
                raise ValueError(
                    f"shared-memory segment {handle.name!r} is owned by uid "
                    f"{st.st_uid}, not by this worker's uid {os.geteuid()}; the "
                    "trainer must run as the same user as the vLLM server"
                )
            self._identity = (st.st_dev, st.st_ino)
            self._check_size(st.st_size)
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._mapping = mmap.mmap(fd, max(handle.nbytes, 1), access=access)
        except BaseException:
            self.close()
            raise
        self.tensor = _uint8_view(self._mapping, handle.nbytes)

    def _check_size(self, size: int) -> None:
        if size < self.handle.nbytes:
            raise ValueError(
                f"shared-memory segment {self.handle.name!r} has {size} bytes but "
                f"the handle claims {self.handle.nbytes}; the trainer truncated or "
                "replaced it while it was in use"
            )

    def check(self, handle: object = None) -> None:
        """Raise ``ValueError`` unless the mapped file still has every byte the
        handle claims and its name still refers to it; call before reading a
        mapping kept from an earlier message (``handle``, that message's
        handle, names the same segment and is not needed here)."""
        name = self.handle.name
        if self._fd is None or self._mapping is None:
            raise ValueError(f"shared-memory segment {name!r} is closed")
        self._check_size(os.fstat(self._fd).st_size)
        try:
            st = os.lstat(_path(name))
        except FileNotFoundError:
            raise ValueError(
                f"shared-memory segment {name!r} no longer exists; the trainer "
                "released it before the update that names it was done"
            ) from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise ValueError(
                f"shared-memory segment {name!r} now names a different file than "
                "the one mapped for this update; the trainer must keep a "
                "segment until update_weights returns"
            )

    def close(self) -> None:
        # The mapping is dropped, not closed: it is unmapped with the last
        # view of ``tensor`` (a view that outlives this, say in a traceback,
        # must never read unmapped memory or, worse, a segment mapped later
        # at the same address).
        self.tensor = None
        self._mapping = None
        if self._fd is not None:
            self._fd = None
            self._finalizer()
