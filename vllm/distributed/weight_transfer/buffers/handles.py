# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Buffer handles of the ``ipc`` backend and the device keys they travel
under.

A *handle* names one exported byte buffer and is one of::

    {"kind": "shm", "name": "vllm-wt-...", "nbytes": int}
    {"kind": "cuda", "nbytes": int, "device": int, "storage_handle": b64, ...}

A *device key* says which worker may read a handle. CUDA buffers are keyed by
the physical GPU UUID (``str(torch.cuda.get_device_properties(i).uuid)``), so a
worker reads the buffer of the trainer rank on its own GPU. CPU buffers are
keyed ``"cpu:<hostname>:<trainer rank>"``: shared memory is visible to every
process on the host, and the worker with local rank ``l`` reads the buffer of
trainer rank ``l mod R``, where ``R`` is the number of CPU keys for its host
(colocated trainer rank ``r`` pairs with worker local rank ``r``; a single
trainer process serves every worker).
"""

from __future__ import annotations

import base64
import binascii
import re
import socket
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
)

# Prefix of every shared-memory segment this backend creates (under /dev/shm).
SHM_NAME_PREFIX = "vllm-wt-"
_SHM_NAME_RE = re.compile(r"vllm-wt-[A-Za-z0-9_.-]{1,200}")
# The trainer rank at the end of a CPU device key.
_RANK_RE = re.compile(r"[0-9]{1,6}")

CPU_KEY_PREFIX = "cpu:"


# ---------------------------------------------------------------------------
# device keys


def cpu_device_key(trainer_rank: int, hostname: str | None = None) -> str:
    """Key of trainer rank ``trainer_rank``'s shared-memory buffers."""
    return f"{CPU_KEY_PREFIX}{hostname or socket.gethostname()}:{trainer_rank}"


def select_cpu_key(
    keys: list[str], local_rank: int, hostname: str | None = None
) -> str | None:
    """The CPU key a worker with ``local_rank`` on ``hostname`` reads, or None.

    Keys of this host must be ranks ``0..R-1``; the worker reads ``local_rank mod R``.
    """
    prefix = f"{CPU_KEY_PREFIX}{hostname or socket.gethostname()}:"
    ranks = []
    for key in keys:
        if not key.startswith(prefix):
            continue
        rank = key[len(prefix) :]
        if not _RANK_RE.fullmatch(rank):
            raise ValueError(
                f"update_info.ipc_handles has CPU key {key!r}; after "
                f"{prefix!r} it must end in a trainer rank (ASCII digits)"
            )
        ranks.append(int(rank))
    ranks.sort()
    if not ranks:
        return None
    if ranks != list(range(len(ranks))):
        raise ValueError(
            f"update_info.ipc_handles has CPU keys for trainer ranks {ranks} on "
            f"this host; expected ranks 0..{len(ranks) - 1}"
        )
    return f"{prefix}{local_rank % len(ranks)}"


# ---------------------------------------------------------------------------
# buffer handles


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: object, where: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where} is not valid base64: {e}") from e


@dataclass(frozen=True)
class ShmHandle:
    """A shared-memory segment ``/dev/shm/<name>`` of ``nbytes`` bytes.

    ``persistent``: the segment outlives the sync (the trainer's own
    parameters, placed there by ``shared_params``), so a worker may keep it
    mapped for the next update instead of mapping it again."""

    kind: ClassVar[str] = "shm"
    name: str
    nbytes: int
    persistent: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SHM_NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"shm handle name {self.name!r} is not a segment of this backend "
                f"(expected {SHM_NAME_PREFIX}<letters, digits, _ . ->)"
            )
        check_int(self.nbytes, "shm handle nbytes")
        if not isinstance(self.persistent, bool):
            raise ValueError(
                f"shm handle persistent must be true or false, got {self.persistent!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "name": self.name}
        out["nbytes"] = self.nbytes
        if self.persistent:
            out["persistent"] = True
        return out


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA allocation exported with ``torch.multiprocessing.reductions``.

    The fields are ``reduce_tensor``'s rebuild arguments for a flat uint8 tensor
    of ``nbytes`` bytes, with the binary ones base64-encoded. ``device`` is the
    exporter's device index; the importer substitutes its own.

    ``persistent``: the allocation outlives the sync (a trainer's own
    parameters, placed in one allocation by ``shared_params``), so a worker
    may keep it mapped for the next update instead of mapping it again. Each
    message still carries a fresh ``ref_counter`` of its own, which a worker
    that kept the mapping releases at once.
    """

    kind: ClassVar[str] = "cuda"
    nbytes: int
    device: int
    storage_handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool
    persistent: bool = False

    def __post_init__(self) -> None:
        for name in (
            "nbytes",
            "device",
            "storage_size_bytes",
            "storage_offset_bytes",
            "tensor_offset",
            "ref_counter_offset",
        ):
            check_int(getattr(self, name), f"cuda handle {name}")
        _unb64(self.storage_handle, "cuda handle storage_handle")
        _unb64(self.ref_counter_handle, "cuda handle ref_counter_handle")
        if self.event_handle is not None:
            _unb64(self.event_handle, "cuda handle event_handle")
        if not isinstance(self.event_sync_required, bool):
            raise ValueError("cuda handle event_sync_required must be a bool")
        if not isinstance(self.persistent, bool):
            raise ValueError(
                f"cuda handle persistent must be true or false, got {self.persistent!r}"
            )
        if self.tensor_offset + self.nbytes > self.storage_size_bytes:
            raise ValueError(
                f"cuda handle covers bytes [{self.tensor_offset}, "
                f"{self.tensor_offset + self.nbytes}) of a "
                f"{self.storage_size_bytes}-byte storage"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        if not self.persistent:
            del out["persistent"]  # written only when set, as for shm handles
        return out


BufferHandle = ShmHandle | CudaIpcHandle
_HANDLE_TYPES: dict[str, type[ShmHandle] | type[CudaIpcHandle]] = {
    "shm": ShmHandle,
    "cuda": CudaIpcHandle,
}


def handle_from_dict(d: object, where: str) -> BufferHandle:
    """Parse one handle object; ``ValueError`` naming ``where`` if malformed."""
    if isinstance(d, ShmHandle | CudaIpcHandle):
        return d
    if not isinstance(d, dict):
        raise ValueError(
            f"{where} must be a handle object with a 'kind' field, got "
            f"{type(d).__name__} (pickled or raw torch handles are not accepted)"
        )
    kind = d.get("kind")
    cls = _HANDLE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(
            f"{where}.kind is {kind!r}; expected one of {sorted(_HANDLE_TYPES)}"
        )
    body = {k: v for k, v in d.items() if k != "kind"}
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING}
    check_fields(body, names, required, where)
    try:
        return cls(**body)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
