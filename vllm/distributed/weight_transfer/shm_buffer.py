# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU data plane of the ``ipc`` backend: byte buffers in POSIX shared memory.

The trainer creates a segment ``/dev/shm/vllm-wt-<pid>-<random>`` (mode 0600),
maps it once and fills it through a uint8 tensor view
(``torch.frombuffer`` over the mapping, so no copy). A worker on the same host
maps the same file once per update and builds typed views into it; it never
copies the whole buffer.

Lifetime: the trainer owns the file. ``SharedMemoryBuffer.close()`` drops the
mapping and unlinks the file (also on error, via ``with``, when the buffer is
garbage collected, and at interpreter exit); a worker's mapping stays valid
after the unlink until the worker closes it, so nothing is freed under a
reader. Only a trainer killed with SIGKILL leaves a file behind; its name
starts with ``vllm-wt-`` and carries the trainer's pid.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import warnings
import weakref

import torch

from vllm.distributed.weight_transfer.ipc_wire import SHM_NAME_PREFIX, ShmHandle

SHM_DIR = "/dev/shm"


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


def _release(mapping: mmap.mmap, path: str) -> None:
    # A view that still exports the buffer keeps the mapping alive until it
    # goes; unlinking frees the file's name either way.
    with contextlib.suppress(BufferError):
        mapping.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedMemoryBuffer:
    """Trainer side: a new shared-memory segment of ``nbytes`` bytes."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"shared-memory buffer size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self.name = f"{SHM_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(_path(self.name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mapping = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            os.unlink(_path(self.name))
            raise
        finally:
            os.close(fd)
        self._finalizer = weakref.finalize(self, _release, mapping, _path(self.name))
        self.tensor: torch.Tensor | None = _uint8_view(mapping, nbytes)

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(name=self.name, nbytes=self.nbytes)

    def close(self) -> None:
        """Unmap and unlink. Idempotent. Views of ``tensor`` must be gone."""
        self.tensor = None
        self._finalizer()

    def __enter__(self) -> SharedMemoryBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappedSegment:
    """Worker side: a segment named by ``handle``, mapped read-write shared."""

    def __init__(self, handle: ShmHandle) -> None:
        self.handle = handle
        try:
            fd = os.open(_path(handle.name), os.O_RDWR)
        except FileNotFoundError as e:
            raise ValueError(
                f"shared-memory segment {handle.name!r} does not exist on this "
                "host; the trainer must run on the same host as this worker and "
                "keep the segment open until update_weights returns"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < handle.nbytes:
                raise ValueError(
                    f"shared-memory segment {handle.name!r} has {size} bytes but "
                    f"the handle claims {handle.nbytes}"
                )
            self._mapping: mmap.mmap | None = mmap.mmap(fd, max(handle.nbytes, 1))
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = _uint8_view(self._mapping, handle.nbytes)

    def close(self) -> None:
        self.tensor = None
        if self._mapping is not None:
            mapping, self._mapping = self._mapping, None
            with contextlib.suppress(BufferError):  # else released with its last view
                mapping.close()
