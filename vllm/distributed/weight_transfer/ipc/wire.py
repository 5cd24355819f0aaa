# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Wire messages of the ``ipc`` weight-transfer backend.

Everything here is plain JSON: the trainer builds these objects, sends
``to_dict()`` over HTTP, Ray or ``LLM.update_weights``, and the worker rebuilds
them with ``from_dict``. The fork never pickles them. Every check runs in
``__post_init__``, so a message that reaches the worker engine is either fully
valid or rejected with a ``ValueError`` naming the field, before any weight is
touched.

Init message (``/init_weight_transfer_engine``)::

    {"packed": bool}

Update message (``/update_weights``), one per chunk::

    {
      "names":       [str, ...],            # checkpoint names, unique
      "dtype_names": ["bfloat16", ...],     # torch dtype names
      "shapes":      [[int, ...], ...],
      "tensor_sizes": [int, ...] | null,    # bytes per tensor; required if packed
      "offsets":     [int, ...] | null,     # byte offset per tensor in the packed
                                            # buffer; null = back to back
      "ipc_handles": {device_key: handle}          # packed: one buffer
                   | {device_key: [handle, ...]}   # packed: several buffers
                   | [{device_key: handle}, ...]   # unpacked: one per tensor
      "buffer_indexes": [int, ...] | null,  # packed, several buffers only: the
                                            # buffer each tensor lies in
      "layout":      str | null,            # packed only: names this layout
    }

A packed message over several buffers (a trainer's ``SharedParameters``
placed in several segments) lists, per device key, the same number of
handles; ``buffer_indexes[i]`` is the position, in those lists, of the
buffer holding tensor ``i``, and ``offsets[i]`` is the tensor's offset in
that buffer. Tensors in one buffer come in increasing, non-overlapping
order, as in a single buffer.

A packed message that carries ``layout`` (an id the trainer chose) lets a
later message send only
``{"layout": id, "layout_digest": digest, "ipc_handles": {...}}`` (the
short form, fork-only): the worker reads the names, dtypes, shapes, sizes
and offsets from the full message it committed under that id
(``LayoutMemo``), and checks the new handles against them. ``digest`` is
``layout_digest`` of that full message (its layout and buffers, in order),
which the trainer computed when it sent it; the worker refuses a short
message whose digest is not the one of the layout it holds under the id.
A layout over several buffers may leave ``ipc_handles`` out too
(``{"layout": id, "layout_digest": digest}``): the buffers are then those
the full message named, and the worker must still hold every one of them
mapped, or it refuses the message (it never maps an old export again). A
worker remembers a layout only once the full message landed and its update
committed; it refuses, before anything lands, a short message naming an id
it does not hold. The trainer sends the short form only for a whole sync out
of its own ``SharedParameters`` whose layout every worker committed, and
kept mapped, at the sync before; a refused short form fails that sync, and
the next one sends the full message again.

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

``{"abort": "<reason>"}`` is the one other update message: the trainer sends
it when it fails after ``start_weight_update``; the worker then puts every layer
that has not completed back on its previous weights.

Upstream vLLM 0.32's form is also read, so an upstream trainer can drive a
fork worker (see ``upstream_handle``): ``ipc_handles`` whose values are
``torch.multiprocessing.reductions.reduce_tensor`` argument tuples (CUDA only),
with no ``offsets`` (tensors back to back, unaligned). Such tuples are Python
objects, so they reach a worker only through a transport that already carries
objects (Ray, an in-process ``LLM``), or pickled in ``ipc_handles_pickled``
(upstream's HTTP client). The worker unpickles ``ipc_handles_pickled`` only
when ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, upstream's own opt-in, and
refuses it otherwise; a ``None`` value is the same as no field.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import itertools
import json
import math
import pickle
import re
import socket
from collections.abc import Callable, Hashable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
    dtype_from_name,
    dtype_name,
    remember_newest,
)

# Prefix of every shared-memory segment this backend creates (under /dev/shm).
SHM_NAME_PREFIX = "vllm-wt-"
_SHM_NAME_RE = re.compile(r"vllm-wt-[A-Za-z0-9_.-]{1,200}")
# The trainer rank at the end of a CPU device key.
_RANK_RE = re.compile(r"[0-9]{1,6}")

CPU_KEY_PREFIX = "cpu:"


# ---------------------------------------------------------------------------
# dtypes


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


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


def _packed_handles(d: object, where: str, n_buffers: int | None) -> dict[str, Any]:
    """A packed message's handles: ``{key: handle}`` (one buffer) or
    ``{key: [handle, ...]}`` (several; every key lists as many). With
    ``n_buffers`` (a layout parsed before) the form must match it."""
    if not isinstance(d, dict) or not any(isinstance(v, list) for v in d.values()):
        if n_buffers is not None and n_buffers != 1:
            raise ValueError(
                f"{where} must list {n_buffers} buffers per device key, as the "
                "message that set this layout did"
            )
        return _handle_map(d, where)
    if not d:
        raise ValueError(f"{where} must be a non-empty object")
    out: dict[str, Any] = {}
    for key, handles in d.items():
        if not isinstance(key, str):
            raise ValueError(f"{where} has a non-string device key {key!r}")
        if not isinstance(handles, list) or not handles:
            raise ValueError(
                f"{where}[{key!r}] must be a non-empty list of handles, as the "
                "other device keys' are"
            )
        out[key] = [
            handle_from_dict(h, f"{where}[{key!r}][{i}]") for i, h in enumerate(handles)
        ]
        _check_buffers_apart(out[key], f"{where}[{key!r}]")
    counts = {len(v) for v in out.values()}
    if len(counts) > 1:
        raise ValueError(
            f"{where} lists {sorted(counts)} buffers under different device "
            "keys; every key must list the same buffers"
        )
    if n_buffers is not None and counts != {n_buffers}:
        raise ValueError(
            f"{where} lists {counts.pop()} buffers per device key, but the "
            f"message that set this layout listed {n_buffers}"
        )
    return out


def _check_buffers_apart(handles: list[Any], where: str) -> None:
    """The buffers one message lists share no byte: the per-buffer order rule
    keeps its tensors apart only if the buffers are apart too."""
    spans: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for i, h in enumerate(handles):
        if isinstance(h, ShmHandle):
            memory, start = ("shm", h.name), 0
        else:
            memory = ("cuda", h.storage_handle)
            start = h.storage_offset_bytes + h.tensor_offset
        spans.setdefault(memory, []).append((start, start + h.nbytes, i))
    for same in spans.values():
        same.sort()
        for (_, end, i), (start, _, j) in itertools.pairwise(same):
            if start < end:
                raise ValueError(
                    f"{where}: buffers {min(i, j)} and {max(i, j)} share bytes of "
                    "one allocation; a message lists each buffer once"
                )


def _lists_buffers(handles: object) -> bool:
    """Whether a packed message's handles come as lists (several buffers)."""
    assert isinstance(handles, dict)
    return isinstance(next(iter(handles.values())), list)


def _count_buffers(handles: object) -> int:
    """How many buffers a packed message's handles name."""
    assert isinstance(handles, dict)
    first = next(iter(handles.values()))
    return len(first) if isinstance(first, list) else 1


def _buffer_maps(handles: dict[str, Any]) -> list[dict[str, BufferHandle]]:
    """A packed message's handles as one ``{device key: handle}`` per buffer."""
    first = next(iter(handles.values()))
    if not isinstance(first, list):
        return [handles]
    return [{k: v[i] for k, v in handles.items()} for i in range(len(first))]


def _handle_map(d: object, where: str) -> dict[str, BufferHandle]:
    if not isinstance(d, dict) or not d:
        raise ValueError(
            f"{where} must be a non-empty object mapping device keys to handles, "
            f"got {d!r:.80}"
        )
    out: dict[str, BufferHandle] = {}
    for key, handle in d.items():
        if not isinstance(key, str):
            raise ValueError(f"{where} has a non-string device key {key!r}")
        out[key] = handle_from_dict(handle, f"{where}[{key!r}]")
    return out


# ---------------------------------------------------------------------------
# upstream 0.32's handles: reduce_tensor argument tuples

# Length of the argument tuple ``reduce_tensor`` returns for a CUDA tensor.
_REDUCE_ARGS_LEN = 15

INSECURE_SERIALIZATION_FLAG = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def insecure_serialization_allowed() -> bool:
    """Upstream's opt-in to unpickling (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    from vllm import envs

    return bool(envs.VLLM_ALLOW_INSECURE_SERIALIZATION)


def is_upstream_handle(value: object) -> bool:
    """Whether ``value`` is a raw upstream handle (a tuple), not a JSON handle."""
    return isinstance(value, tuple)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def upstream_handle(value: object, where: str) -> CudaIpcHandle:
    """The ``CudaIpcHandle`` of the bytes an upstream handle describes.

    Upstream 0.32 sends ``reduce_tensor(t)[1]``, the 15 rebuild arguments of a
    CUDA tensor (or the whole ``(rebuild_fn, args)`` pair); ``t`` is a
    contiguous parameter (unpacked) or the flat uint8 buffer (packed). The
    handle covers ``t``'s bytes, starting at its storage offset.
    """
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and callable(value[0])
        and isinstance(value[1], tuple)
    ):
        value = value[1]
    if not isinstance(value, tuple) or len(value) != _REDUCE_ARGS_LEN:
        got = len(value) if isinstance(value, tuple) else type(value).__name__
        raise ValueError(
            f"{where} must be the {_REDUCE_ARGS_LEN} arguments reduce_tensor "
            f"returns for a CUDA tensor, got {got!r}"
        )
    (
        _tensor_cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = value
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: argument 5 (dtype) is {dtype!r}, not a dtype")
    try:
        size = tuple(int(d) for d in size)
        stride = tuple(int(s) for s in stride)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: size and stride must be integers: {e}") from e
    want = _contiguous_strides(size)
    if any(d > 1 and s != w for d, s, w in zip(size, stride, want, strict=False)):
        raise ValueError(
            f"{where} describes a non-contiguous tensor (size {list(size)}, "
            f"stride {list(stride)}); only contiguous tensors can be read"
        )
    for name, blob in (
        ("storage handle", storage_handle),
        ("ref counter handle", ref_counter_handle),
    ):
        if not isinstance(blob, bytes):
            raise ValueError(f"{where}: the {name} must be bytes, got {blob!r:.40}")
    if event_handle is not None and not isinstance(event_handle, bytes):
        raise ValueError(f"{where}: the event handle must be bytes or None")
    itemsize = dtype.itemsize
    try:
        return CudaIpcHandle(
            nbytes=math.prod(size) * itemsize,
            device=check_int(device, f"{where} device"),
            storage_handle=_b64(storage_handle),
            storage_size_bytes=check_int(storage_size_bytes, f"{where} storage size"),
            storage_offset_bytes=check_int(
                storage_offset_bytes, f"{where} storage offset"
            ),
            tensor_offset=check_int(tensor_offset, f"{where} tensor offset") * itemsize,
            ref_counter_handle=_b64(ref_counter_handle),
            ref_counter_offset=check_int(
                ref_counter_offset, f"{where} ref counter offset"
            ),
            event_handle=_b64(event_handle) if event_handle is not None else None,
            event_sync_required=bool(event_sync_required),
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def upstream_args(
    handle: CudaIpcHandle,
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] | None = None,
) -> tuple:
    """``handle`` as upstream's handle: the ``reduce_tensor`` arguments of a
    contiguous ``dtype`` tensor of ``shape`` over the handle's bytes (default:
    flat uint8, the packed buffer). Upstream's unpacked worker loads the
    tensor these arguments rebuild as is, so they carry its dtype and shape."""
    itemsize = dtype.itemsize
    if shape is None:
        if handle.nbytes % itemsize:
            raise ValueError(
                f"a {handle.nbytes}-byte handle is not a whole number of {dtype}"
            )
        shape = (handle.nbytes // itemsize,)
    if math.prod(shape) * itemsize != handle.nbytes:
        raise ValueError(
            f"shape {list(shape)} of {dtype} does not cover the handle's "
            f"{handle.nbytes} bytes"
        )
    if handle.tensor_offset % itemsize:
        raise ValueError(
            f"the handle starts {handle.tensor_offset} bytes into its storage, "
            f"not at a {dtype} element"
        )
    return (
        torch.Tensor,
        torch.Size(shape),
        _contiguous_strides(tuple(shape)),
        handle.tensor_offset // itemsize,
        torch.storage.TypedStorage,
        dtype,
        handle.device,
        base64.b64decode(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        base64.b64decode(handle.ref_counter_handle),
        handle.ref_counter_offset,
        base64.b64decode(handle.event_handle) if handle.event_handle else None,
        handle.event_sync_required,
    )


def _unpickle_handles(pickled: object) -> Any:
    if not insecure_serialization_allowed():
        raise ValueError(
            "update_info.ipc_handles_pickled is not accepted: unpickling runs "
            "code chosen by the sender, so this worker refuses it unless the "
            f"server runs with {INSECURE_SERIALIZATION_FLAG}=1 (upstream 0.32's "
            "opt-in). Send `ipc_handles` as JSON handle objects, as "
            "IPCTrainerWeightTransferEngine does, or set the flag to accept "
            "upstream 0.32's HTTP client."
        )
    if not isinstance(pickled, str):
        raise ValueError(
            "update_info.ipc_handles_pickled must be a base64 string, got "
            f"{type(pickled).__name__}"
        )
    return pickle.loads(_unb64(pickled, "update_info.ipc_handles_pickled"))


def _raw_map(d: object, where: str) -> None:
    """Check the shape of one map of upstream handles (not their contents)."""
    if not isinstance(d, dict) or not d:
        raise ValueError(
            f"{where} must be a non-empty map of device keys to handles, got {d!r:.80}"
        )
    for key, handle in d.items():
        if not isinstance(key, str):
            raise ValueError(f"{where} has a non-string device key {key!r}")
        if not is_upstream_handle(handle):
            raise ValueError(
                f"{where}[{key!r}] is a {type(handle).__name__}; one update "
                "carries either JSON handle objects or upstream reduce_tensor "
                "tuples, not both"
            )


def _is_upstream_form(handles: object) -> bool:
    maps = handles if isinstance(handles, list) else [handles]
    return any(
        isinstance(m, dict) and any(is_upstream_handle(h) for h in m.values())
        for m in maps
    )


# ---------------------------------------------------------------------------
# messages


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init message. ``packed`` must agree with every update's form."""

    packed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bool):
            raise ValueError(f"init_info.packed must be a bool, got {self.packed!r}")

    @classmethod
    def from_dict(cls, d: object) -> IPCWeightTransferInitInfo:
        if not isinstance(d, dict):
            raise ValueError(f"init_info must be an object, got {type(d).__name__}")
        check_fields(d, {"packed"}, set(), "init_info")
        return cls(**d)


@dataclass(frozen=True)
class TensorView:
    """Where one tensor of an update lies: in which buffer, at which offset."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: int  # index into IPCWeightTransferUpdateInfo.buffers()
    offset: int
    nbytes: int


_Fact = TypeVar("_Fact")

_UPDATE_REQUIRED = {"names", "dtype_names", "shapes"}
# The short form of a packed message whose layout the worker committed before.
_COMPACT_FIELDS = {"layout", "layout_digest", "ipc_handles"}
_COMPACT_REQUIRED = {"layout", "layout_digest"}
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_MAX_LAYOUT_ID = 128


class LayoutMemo:
    """Parses update messages, reusing the checked views of an earlier
    message with the same layout (``IPCWeightTransferUpdateInfo.from_dict``'s
    ``like``): with the trainer's parameters in a buffer the worker keeps
    mapped, every chunk lists the same tensors at the same offsets at every
    sync, and checking thousands of names, shapes and offsets again is most
    of a worker's per-tensor cost. One earlier message is kept per chunk
    (first name, last name, count), at most ``max_entries``; and one per
    ``layout`` id a message carried, at most ``max_layouts``, with its
    ``layout_digest``, which a short message
    (``{"layout": id, "layout_digest": digest, "ipc_handles": ...}``) names.

    Only committed syncs teach the memo: ``parse`` reads it and records
    nothing; the worker calls ``landed`` for each message once its weights
    landed, ``commit`` when its update committed, and ``discard`` when the
    update failed, was aborted or another one started. A message refused,
    or landed in an update that never committed, leaves the memo exactly
    as it was, so it cannot change what a later short message lands."""

    def __init__(self, max_entries: int = 256, max_layouts: int = 16) -> None:
        self.max_entries = max_entries
        self.max_layouts = max_layouts
        self._by_chunk: dict[tuple, IPCWeightTransferUpdateInfo] = {}
        # Per layout id: the full message that set it, and its digest.
        self._by_layout: dict[str, tuple[IPCWeightTransferUpdateInfo, str]] = {}
        # Full packed messages of the open update that landed, in order.
        self._landed: list[IPCWeightTransferUpdateInfo] = []
        self.reused = 0  # messages parsed from an earlier one's views
        self.compact = 0  # of those, short messages naming a layout id

    def parse(self, d: object) -> IPCWeightTransferUpdateInfo:
        """``d`` checked and parsed, reusing what committed syncs taught."""
        if isinstance(d, dict) and "layout" in d and "names" not in d:
            return self._parse_compact(d)
        key = _chunk_key(d)
        like = self._by_chunk.get(key) if key is not None else None
        info = IPCWeightTransferUpdateInfo.from_dict(d, like=like)
        if like is not None and info._views is like._views:
            self.reused += 1
        return info

    def landed(self, info: IPCWeightTransferUpdateInfo) -> None:
        """``info``'s weights landed in the open update: its layout joins the
        memo if that update commits. Short messages teach nothing (their
        layout is in the memo already)."""
        if info.packed and not info.upstream_wire and not info.short_form:
            self._landed.append(info)

    def commit(self) -> None:
        """The open update committed: what landed in it is remembered."""
        landed, self._landed = self._landed, []
        for info in landed:
            key = _chunk_key({"names": info.names})
            if key is not None:
                remember_newest(self._by_chunk, key, info, self.max_entries)
            if info.layout is not None:
                entry = (info, info.layout_digest())
                remember_newest(self._by_layout, info.layout, entry, self.max_layouts)

    def discard(self) -> None:
        """The open update failed, was aborted or gave way to a new one:
        nothing it landed is remembered."""
        self._landed = []

    def _parse_compact(self, d: dict[str, Any]) -> IPCWeightTransferUpdateInfo:
        """A short message: the layout of the full message committed under
        its id, if ``layout_digest`` is that message's digest, with the new
        handles (checked to cover every tensor), or, over several buffers and
        without handles, that message's own (marked ``reuses_handles``: the
        worker must hold them all mapped)."""
        check_fields(d, _COMPACT_FIELDS, _COMPACT_REQUIRED, "update_info")
        layout = d["layout"]
        entry = self._by_layout.get(layout) if isinstance(layout, str) else None
        if entry is None:
            raise ValueError(
                f"update_info names layout {layout!r} without names, but this "
                "worker committed no full message with that layout (it keeps "
                f"the last {self.max_layouts}); send the full message, with "
                "names, dtype_names, shapes, tensor_sizes and offsets"
            )
        known, digest = entry
        _check_digest(d["layout_digest"], digest, layout)
        if "ipc_handles" not in d:
            if known._n_buffers == 1 and not _lists_buffers(known.ipc_handles):
                raise ValueError(
                    "update_info names a layout of one buffer without "
                    "ipc_handles; only a layout over several buffers may reuse "
                    "the handles of the message that set it"
                )
            short = known._reusing_handles()
        else:
            handles = d["ipc_handles"]
            if not isinstance(handles, dict) or _is_upstream_form(handles):
                raise ValueError(
                    "update_info.ipc_handles of a message naming a layout must "
                    "be one object of the fork's handles (a packed buffer)"
                )
            short = known._with_handles(handles)
        short.short_form = True
        self.reused += 1
        self.compact += 1
        return short


def _check_digest(got: object, want: str, layout: str) -> None:
    """A short message's ``layout_digest`` must be the digest of the full
    message committed under its layout id: it binds the short form to that
    exact layout, whatever else was sent under the id."""
    if not isinstance(got, str) or not _DIGEST_RE.fullmatch(got):
        raise ValueError(
            f"update_info.layout_digest must be 64 lowercase hex digits (the "
            f"sha256 layout_digest of the full message), got {got!r:.80}"
        )
    if got != want:
        raise ValueError(
            f"update_info.layout_digest is {got[:16]}... but the layout this "
            f"worker committed under id {layout!r} has digest {want[:16]}...: "
            "the short form names another layout than the one held; send the "
            "full message, with names, dtype_names, shapes, tensor_sizes and "
            "offsets"
        )


def layout_digest(message: Mapping[str, Any]) -> str:
    """The sha256 (hex) of a packed message's exact layout, in order: names,
    dtype names, shapes, tensor sizes, offsets, buffer indexes, and the
    buffers' handles (device key, kind, and what names the memory: segment
    name or CUDA storage handle, offsets, sizes). The trainer computes it
    from the full message it sends with a layout id and puts it in every
    short message naming that id; the worker computes it from the full
    message it committed and refuses a short message that disagrees."""
    handles = _packed_handles(message["ipc_handles"], "layout_digest handles", None)
    buffers = [
        [[key, *_handle_identity(hmap[key])] for key in sorted(hmap)]
        for hmap in _buffer_maps(handles)
    ]
    layout = [
        [str(n) for n in message["names"]],
        [str(d) for d in message["dtype_names"]],
        [[int(x) for x in shape] for shape in message["shapes"]],
        message.get("tensor_sizes"),
        message.get("offsets"),
        message.get("buffer_indexes"),
        buffers,
    ]
    text = json.dumps(layout, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _handle_identity(handle: BufferHandle) -> list[Any]:
    """What names a handle's memory (never its per-message reference
    counter or event)."""
    if isinstance(handle, ShmHandle):
        return ["shm", handle.name, handle.nbytes]
    return [
        "cuda",
        handle.device,
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.tensor_offset,
        handle.nbytes,
    ]


def _chunk_key(d: object) -> tuple | None:
    names = d.get("names") if isinstance(d, dict) else None
    if not isinstance(names, list) or not names:
        return None
    first, last = names[0], names[-1]
    if not isinstance(first, str) or not isinstance(last, str):
        return None
    return (first, last, len(names))


@dataclass
class IPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of an update. See the module docstring for the JSON form.

    After construction ``ipc_handles`` holds typed handles (``ShmHandle`` /
    ``CudaIpcHandle``) and every size and offset has been checked.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: dict[str, Any] | list[dict[str, Any]] | None = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None
    offsets: list[int] | None = None
    buffer_indexes: list[int] | None = None
    layout: str | None = None

    @classmethod
    def from_dict(
        cls, d: object, like: IPCWeightTransferUpdateInfo | None = None
    ) -> IPCWeightTransferUpdateInfo:
        """Parse and check ``d``. ``like``, an earlier message: when ``d``
        lists the same tensors at the same offsets of one packed buffer (a
        trainer's ``SharedParameters``, or a kept packed buffer, sync after
        sync), its checked views are reused and only the handles are parsed
        and checked."""
        if not isinstance(d, dict):
            raise ValueError(f"update_info must be an object, got {type(d).__name__}")
        allowed = {f.name for f in fields(cls) if f.init}
        check_fields(d, allowed, _UPDATE_REQUIRED, "update_info")
        if like is not None and like._same_layout(d):
            return like._with_handles(d["ipc_handles"])
        return cls(**d)

    def _same_layout(self, d: dict[str, Any]) -> bool:
        """Whether ``d`` is a fork-wire packed message with exactly this
        message's names, dtypes, shapes, sizes and offsets."""
        handles = d.get("ipc_handles")
        return (
            self.packed
            and not self.upstream_wire
            and isinstance(handles, dict)
            and d.get("ipc_handles_pickled") is None
            and not _is_upstream_form(handles)
            and d["names"] == self.names
            and d["dtype_names"] == self.dtype_names
            and d["shapes"] == self.shapes
            and d.get("tensor_sizes") == self.tensor_sizes
            and d.get("offsets") == self.offsets
            and d.get("buffer_indexes") == self.buffer_indexes
            and d.get("layout") == self.layout
        )

    def _reusing_handles(self) -> IPCWeightTransferUpdateInfo:
        """This message as a short message that names no handles of its own
        (``reuses_handles``): the same buffers, which the worker must still
        hold mapped."""
        other = copy.copy(self)
        other.reuses_handles = True
        return other

    def _with_handles(self, handles: dict[str, Any]) -> IPCWeightTransferUpdateInfo:
        """This message with other buffer handles, checked as ``__init__``
        checks them (each must cover the tensors' bytes)."""
        other = copy.copy(self)
        other.ipc_handles = _packed_handles(
            handles, "update_info.ipc_handles", self._n_buffers
        )
        other._buffers = None
        other.buffers()
        return other

    def __post_init__(self) -> None:
        if self.ipc_handles_pickled is not None:
            if self.ipc_handles is not None:
                raise ValueError(
                    "Cannot specify both `ipc_handles` and `ipc_handles_pickled` "
                    "in update_info; send one of them"
                )
            self.ipc_handles = _unpickle_handles(self.ipc_handles_pickled)
            self.ipc_handles_pickled = None
        # Upstream 0.32's raw reduce_tensor tuples stay as given in
        # ``ipc_handles``; ``buffers()`` turns them into CudaIpcHandles.
        self.upstream_wire = _is_upstream_form(self.ipc_handles)
        self._buffers: list[dict[str, BufferHandle]] | None = None
        self._n_buffers = 1  # buffers named per device key (packed)
        # A short message that named no handles: these are those of the
        # message that set its layout, which the worker must hold mapped.
        self.reuses_handles = False
        # Parsed from a short message (``LayoutMemo``), not a full one.
        self.short_form = False
        # Where each buffer's tensors end (``_check_cover``).
        self._ends: list[int] | None = None
        # ``layout_fact``'s values; messages parsed from one layout share it.
        self._layout_facts: dict[Hashable, Any] = {}
        if self.ipc_handles is None:
            raise ValueError("update_info.ipc_handles is missing: it must be provided")
        if self.layout is not None and not (
            isinstance(self.layout, str)
            and 0 < len(self.layout) <= _MAX_LAYOUT_ID
            and isinstance(self.ipc_handles, dict)
            and not self.upstream_wire
        ):
            raise ValueError(
                "update_info.layout must be a non-empty string of at most "
                f"{_MAX_LAYOUT_ID} characters, on a packed message of the "
                f"fork's handles; got {self.layout!r}"
            )
        names = self.names
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("update_info.names must be a list of strings")
        n = len(names)
        seen: set[str] = set()  # a set: clients choose how many names come
        for name in names:
            if name in seen:
                raise ValueError(f"update_info.names lists {name!r} more than once")
            seen.add(name)
        for attr in (
            "dtype_names",
            "shapes",
            "tensor_sizes",
            "offsets",
            "buffer_indexes",
        ):
            value = getattr(self, attr)
            if value is None:
                continue
            if not isinstance(value, list) or len(value) != n:
                got = len(value) if isinstance(value, list) else type(value).__name__
                raise ValueError(
                    f"update_info.{attr} has {got} entries but names has {n}"
                )
        dtypes = [
            dtype_from_name(d, f"update_info.dtype_names[{i}] ({names[i]!r})")
            for i, d in enumerate(self.dtype_names)
        ]
        shapes: list[tuple[int, ...]] = []
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, list | tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
            ):
                raise ValueError(
                    f"update_info.shapes[{i}] ({names[i]!r}) must be a list of "
                    f"non-negative integers, got {shape!r}"
                )
            shapes.append(tuple(shape))
        sizes = [tensor_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)]
        if self.tensor_sizes is not None:
            for i, (got, want) in enumerate(zip(self.tensor_sizes, sizes, strict=True)):
                if got != want:
                    raise ValueError(
                        f"update_info.tensor_sizes[{i}] ({names[i]!r}) is {got!r} "
                        f"bytes but a {self.dtype_names[i]} tensor of shape "
                        f"{list(shapes[i])} has {want}"
                    )

        if isinstance(self.ipc_handles, dict):
            self._init_packed(names, dtypes, shapes, sizes)
        elif isinstance(self.ipc_handles, list):
            self._init_unpacked(names, dtypes, shapes, sizes)
        else:
            raise ValueError(
                "update_info.ipc_handles must be an object (packed) or a list "
                f"(unpacked), got {type(self.ipc_handles).__name__}"
            )
        if not self.upstream_wire:
            self.buffers()  # checks that every handle covers its tensors

    def _init_packed(self, names, dtypes, shapes, sizes) -> None:
        if self.tensor_sizes is None:
            raise ValueError("update_info.tensor_sizes is required for a packed update")
        if self.upstream_wire:
            if self.offsets is not None:
                raise ValueError(
                    "update_info.offsets is not valid with upstream 0.32's "
                    "reduce_tensor handles (their tensors lie back to back)"
                )
            _raw_map(self.ipc_handles, "update_info.ipc_handles")
        else:
            self.ipc_handles = _packed_handles(
                self.ipc_handles, "update_info.ipc_handles", None
            )
        n_buffers = self._n_buffers = _count_buffers(self.ipc_handles)
        several = _lists_buffers(self.ipc_handles)
        indexes = self._buffer_indexes(names, n_buffers, several)
        if self.offsets is None:
            offsets, cursor = [], 0
            for size in sizes:
                offsets.append(cursor)
                cursor += size
        else:
            offsets = [
                check_int(o, f"update_info.offsets[{i}] ({names[i]!r})")
                for i, o in enumerate(self.offsets)
            ]
        # Where the last tensor seen in each buffer ends.
        ends = [0] * n_buffers
        for i, (off, size, dtype, b) in enumerate(
            zip(offsets, sizes, dtypes, indexes, strict=True)
        ):
            if off < ends[b]:
                raise ValueError(
                    f"update_info.offsets[{i}] ({names[i]!r}) is {off}, inside the "
                    f"previous tensor of its buffer (which ends at byte {ends[b]})"
                )
            if off % dtype.itemsize and not self.upstream_wire:
                raise ValueError(
                    f"update_info.offsets[{i}] ({names[i]!r}) is {off}, not a "
                    f"multiple of the {dtype_name(dtype)} item size {dtype.itemsize}"
                )
            ends[b] = off + size
        self._views = [
            TensorView(nm, dt, sh, b, off, size)
            for nm, dt, sh, b, off, size in zip(
                names, dtypes, shapes, indexes, offsets, sizes, strict=True
            )
        ]

    def _buffer_indexes(
        self, names: list[str], n_buffers: int, several: bool
    ) -> list[int]:
        """Each tensor's buffer: ``buffer_indexes``, checked, when the handles
        come as lists (``several``); all 0 for one buffer, where the field
        must be absent."""
        if self.buffer_indexes is None:
            if several:
                raise ValueError(
                    "update_info.buffer_indexes is required when ipc_handles "
                    "lists the buffers per device key"
                )
            return [0] * len(names)
        if not several:
            raise ValueError(
                "update_info.buffer_indexes is only valid when ipc_handles lists "
                "the buffers per device key ({device_key: [handle, ...]})"
            )
        indexes = []
        for i, b in enumerate(self.buffer_indexes):
            b = check_int(b, f"update_info.buffer_indexes[{i}] ({names[i]!r})")
            if b >= n_buffers:
                raise ValueError(
                    f"update_info.buffer_indexes[{i}] ({names[i]!r}) is {b}, but "
                    f"ipc_handles lists {n_buffers} buffer(s) per device key"
                )
            indexes.append(b)
        return indexes

    def _init_unpacked(self, names, dtypes, shapes, sizes) -> None:
        assert isinstance(self.ipc_handles, list)
        for attr in ("offsets", "buffer_indexes"):
            if getattr(self, attr) is not None:
                raise ValueError(
                    f"update_info.{attr} is only valid for a packed update "
                    "(ipc_handles as one object)"
                )
        if len(self.ipc_handles) != len(names):
            raise ValueError(
                f"update_info.ipc_handles has {len(self.ipc_handles)} entries but "
                f"names has {len(names)}"
            )
        if self.upstream_wire:
            for i, h in enumerate(self.ipc_handles):
                _raw_map(h, f"update_info.ipc_handles[{i}] ({names[i]!r})")
        else:
            self.ipc_handles = [
                _handle_map(h, f"update_info.ipc_handles[{i}] ({names[i]!r})")
                for i, h in enumerate(self.ipc_handles)
            ]
        self._views = [
            TensorView(nm, dt, sh, i, 0, size)
            for i, (nm, dt, sh, size) in enumerate(
                zip(names, dtypes, shapes, sizes, strict=True)
            )
        ]

    @property
    def packed(self) -> bool:
        return isinstance(self.ipc_handles, dict)

    def buffers(self) -> list[dict[str, BufferHandle]]:
        """Per buffer, its handles by device key (one buffer when packed).

        Every handle covers the bytes its tensors need; upstream handles are
        converted (and checked) here, on first use.
        """
        if self._buffers is None:
            if self.upstream_wire:
                raw = self.ipc_handles
                maps = [raw] if isinstance(raw, dict) else raw
                assert isinstance(maps, list)
                where = ["update_info.ipc_handles"]
                if not self.packed:
                    where = [
                        f"update_info.ipc_handles[{i}] ({n!r})"
                        for i, n in enumerate(self.names)
                    ]
                buffers: list[dict[str, BufferHandle]] = [
                    {k: upstream_handle(v, f"{w}[{k!r}]") for k, v in m.items()}
                    for w, m in zip(where, maps, strict=True)
                ]
            elif isinstance(self.ipc_handles, dict):
                buffers = _buffer_maps(self.ipc_handles)
            else:
                buffers = self.ipc_handles  # type: ignore[assignment]
            self._check_cover(buffers)
            self._buffers = buffers
        return self._buffers

    def _check_cover(self, buffers: list[dict[str, BufferHandle]]) -> None:
        ends = self._ends
        if ends is None or len(ends) != len(buffers):
            # (Kept: a message reusing these views has the same ends.)
            ends = self._ends = [0] * len(buffers)
            for view in self._views:
                ends[view.buffer] = max(ends[view.buffer], view.offset + view.nbytes)
        several = self.packed and self.buffer_indexes is not None
        for i, (hmap, end) in enumerate(zip(buffers, ends, strict=True)):
            for key, handle in hmap.items():
                if handle.nbytes < end:
                    if several:
                        where = f"[{key!r}][{i}]"
                    else:
                        where = f"[{key!r}]" if self.packed else f"[{i}][{key!r}]"
                    what = "the tensors need" if self.packed else "the tensor needs"
                    raise ValueError(
                        f"update_info.ipc_handles{where} covers "
                        f"{handle.nbytes} bytes but {what} {end}"
                    )

    def views(self) -> list[TensorView]:
        return list(self._views)

    @property
    def layout_views(self) -> object:
        """An object that is the same (``is``) for every message parsed from
        one layout (``LayoutMemo`` reuses it): what a worker compares to skip
        checks the layout passed before. Read only."""
        return self._views

    def layout_digest(self) -> str:
        """``layout_digest`` of this message as sent (fork wire, packed)."""
        return layout_digest(
            {
                "names": self.names,
                "dtype_names": self.dtype_names,
                "shapes": self.shapes,
                "tensor_sizes": self.tensor_sizes,
                "offsets": self.offsets,
                "buffer_indexes": self.buffer_indexes,
                "ipc_handles": self.ipc_handles,
            }
        )

    def layout_fact(
        self,
        key: Hashable,
        compute: Callable[[list[TensorView]], _Fact],
        still: Callable[[_Fact], bool] | None = None,
    ) -> _Fact:
        """``compute(views)``, computed once for every message that shares
        this message's layout (``layout_views``) and kept with it under
        ``key``; computed again when ``still(kept)`` says the kept value no
        longer applies. ``compute`` must read the views alone (names, dtypes,
        shapes, offsets), never the handles. A ``compute`` that raises keeps
        nothing. So a value is the same whichever message of the layout
        computed it: one computed for a message that is then refused (its
        views shared with a committed message's, ``LayoutMemo``) is the
        value any later message would compute, and cannot change what that
        message lands."""
        facts = self._layout_facts
        if key in facts:
            kept = facts[key]
            if still is None or still(kept):
                return kept
        value = facts[key] = compute(self._views)
        return value

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what clients send); upstream handles stay tuples."""
        handles: Any
        if self.upstream_wire:
            handles = self.ipc_handles
        elif isinstance(self.ipc_handles, dict):
            handles = {
                k: [h.to_dict() for h in v] if isinstance(v, list) else v.to_dict()
                for k, v in self.ipc_handles.items()
            }
        else:
            assert isinstance(self.ipc_handles, list)
            handles = [
                {k: h.to_dict() for k, h in hmap.items()} for hmap in self.ipc_handles
            ]
        out: dict[str, Any] = {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
            "ipc_handles": handles,
        }
        if self.tensor_sizes is not None:
            out["tensor_sizes"] = list(self.tensor_sizes)
        if self.offsets is not None:
            out["offsets"] = list(self.offsets)
        if self.buffer_indexes is not None:
            out["buffer_indexes"] = list(self.buffer_indexes)
        if self.layout is not None:
            out["layout"] = self.layout
        return out
