# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layout memory of a worker: ``LayoutMemo``, the layouts of committed
update messages (so a message with a known layout is checked by its handles
alone, and a short message names a layout by id), and ``layout_fact``,
values computed once per layout and kept with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    remember_newest,
)
from vllm.distributed.weight_transfer.ipc.upstream_wire import _is_upstream_form
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferUpdateInfo,
    TensorView,
    _lists_buffers,
)

_Fact = TypeVar("_Fact")

# The short form of a packed message whose layout the worker committed before.
_COMPACT_FIELDS = {"layout", "layout_digest", "ipc_handles"}
_COMPACT_REQUIRED = {"layout", "layout_digest"}
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


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


def _chunk_key(d: object) -> tuple | None:
    names = d.get("names") if isinstance(d, dict) else None
    if not isinstance(names, list) or not names:
        return None
    first, last = names[0], names[-1]
    if not isinstance(first, str) or not isinstance(last, str):
        return None
    return (first, last, len(names))


def layout_fact(
    info: IPCWeightTransferUpdateInfo,
    key: Hashable,
    compute: Callable[[list[TensorView]], _Fact],
    still: Callable[[_Fact], bool] | None = None,
) -> _Fact:
    """``compute(views)``, computed once for every message that shares
    ``info``'s layout (``layout_views``) and kept with it under ``key``;
    computed again when ``still(kept)`` says the kept value no longer
    applies. ``compute`` must read the views alone (names, dtypes, shapes,
    offsets), never the handles. A ``compute`` that raises keeps nothing. So
    a value is the same whichever message of the layout computed it: one
    computed for a message that is then refused (its views shared with a
    committed message's, ``LayoutMemo``) is the value any later message
    would compute, and cannot change what that message lands."""
    facts = info._layout_facts
    if key in facts:
        kept = facts[key]
        if still is None or still(kept):
            return kept
    value = facts[key] = compute(info._views)
    return value
