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

Handles (the exported byte buffers) and the device keys saying which worker
may read each are described in ``buffers/handles``.

``{"abort": "<reason>"}`` is the one other update message: the trainer sends
it when it fails after ``start_weight_update``; the worker then puts every layer
that has not completed back on its previous weights.

Upstream vLLM 0.32's form is also read, so an upstream trainer can drive a
fork worker (see ``upstream_wire``): ``ipc_handles`` whose values are
``torch.multiprocessing.reductions.reduce_tensor`` argument tuples (CUDA only),
with no ``offsets`` (tensors back to back, unaligned). Such tuples are Python
objects, so they reach a worker only through a transport that already carries
objects (Ray, an in-process ``LLM``), or pickled in ``ipc_handles_pickled``
(upstream's HTTP client). The worker unpickles ``ipc_handles_pickled`` only
when ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, upstream's own opt-in, and
refuses it otherwise; a ``None`` value is the same as no field.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.buffers.handles import (
    BufferHandle,
    ShmHandle,
    handle_from_dict,
)
from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.ipc.upstream_wire import (
    _is_upstream_form,
    _raw_map,
    _unpickle_handles,
    upstream_handle,
)

# ---------------------------------------------------------------------------
# dtypes


def tensor_nbytes(dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


# ---------------------------------------------------------------------------
# handle maps


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


_UPDATE_REQUIRED = {"names", "dtype_names", "shapes"}
_MAX_LAYOUT_ID = 128


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
        # ``layout_memo.layout_fact``'s values; messages parsed from one
        # layout share it.
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
