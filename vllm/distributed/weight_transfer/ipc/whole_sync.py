# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` trainer's whole sync by layout id: when a sync went whole as
one message out of a source that says when nothing moved
(``SharedParametersSource``), the next sync resends only that message's
layout id (``_WholeMessage``), and may check meanwhile, on a helper thread,
that nothing moved (``check_meanwhile``, ``resend_whole``). Also which
``SharedParameters`` segments a sync names and which the workers kept
mapped (``_SharedInSync``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc.packing import TransferPlan
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SegmentPart,
    SharedParameters,
    SharedParametersSource,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


# Per ``SharedParameters`` buffer, the indexes of its segments.
_SegmentsByOwner = weakref.WeakKeyDictionary[SharedParameters, frozenset[int]]


class _SharedInSync:
    """The ``SharedParameters`` segments one sync's messages name, per
    buffer. A segment the workers did not keep mapped from the previous sync
    (``kept``: the segments that sync named, none after a failed one) is
    exported anew before its first message, so the worker that maps it again
    gets a CUDA reference counter of its own (``SharedParameters.export_anew``).
    Workers keep mappings per segment, so this is tracked per segment: a
    segment left out of one sync (its chunks packed) is exported anew when a
    later sync names it again, even if other segments of its buffer stayed."""

    def __init__(self, kept: _SegmentsByOwner) -> None:
        self._kept = kept
        self.used: _SegmentsByOwner = weakref.WeakKeyDictionary()

    def kept(self, part: SegmentPart) -> bool:
        """Whether the workers ended the last sync holding every segment
        ``part`` names mapped."""
        kept = self._kept.get(part.owner)
        segments = part.segment_set
        return kept is not None and (kept is segments or segments <= kept)

    def use(self, part: SegmentPart) -> None:
        # (Sets, compared by identity first: a whole sync resent by id names
        # the same part, and so the same set, sync after sync.)
        owner, segments = part.owner, part.segment_set
        used = self.used.get(owner)
        if used is not None and (used is segments or segments <= used):
            return
        kept = self._kept.get(owner)
        if kept is not segments:
            new = segments if used is None else segments - used
            for i in new if kept is None else new - kept:
                owner.export_anew(i)
        self.used[owner] = segments if used is None else used | segments


@dataclass(frozen=True)
class _WholeMessage:
    """A sync that went whole as one message out of one ``SharedParameters``
    buffer: the plan and the source it was for, the buffer, the layout id the
    message carried and the message's ``layout_digest``, and what the message
    named of the buffer's segments."""

    plan: TransferPlan
    source: WeightSource | None
    owner: SharedParameters
    layout: str
    digest: str
    part: SegmentPart


def _pinned(
    source: WeightSource | None, yielding: bool = False
) -> tuple[SharedParameters, list[ParamMeta]] | None:
    """The buffer and metadata of a source that says nothing moved since it
    last looked (``SharedParametersSource.pinned``); None for any other."""
    if isinstance(source, SharedParametersSource):
        return source.pinned(yielding)
    return None


class _MovedWhileLanding(RuntimeError):
    """The check made while a whole message landed found a parameter moved
    (``check_while_landing``)."""


def check_meanwhile(
    pool: ThreadPoolExecutor,
    source: WeightSource | None,
    metas: list[ParamMeta] | None,
    whole: _WholeMessage,
) -> Future[bool]:
    """Check on ``pool``'s thread whether ``source`` still says nothing
    moved: the same buffer and the very metadata list ``metas`` of the
    plan."""

    def check() -> bool:
        found = _pinned(source, yielding=True)
        return found is not None and found[0] is whole.owner and found[1] is metas

    return pool.submit(check)


def resend_whole(
    whole: _WholeMessage,
    send: Callable[[_WholeMessage], None],
    check: Future[bool] | None = None,
) -> bool:
    """Send the last sync's one message again in its short form (``send``):
    the layout's id and the buffer's handle, or the id alone over several
    segments (the workers parsed the layout then and keep the segments
    mapped). Nothing is walked: the source said every tensor is where it
    was (``_pinned``), or ``check`` is saying it meanwhile; when it says
    something moved, this raises ``_MovedWhileLanding`` after the message
    landed, so the update is aborted before its commit. True when ``check``
    found nothing moved."""
    if check is None:
        send(whole)
        return False
    sent: BaseException | None = None
    try:
        send(whole)
    except BaseException as e:
        # A segment that moved can fail the message itself (one resized
        # in place is refused before its handle is read): the check says
        # which of the two happened.
        sent = e
    if not check.result():
        raise _MovedWhileLanding(
            "a parameter moved since the last sync (the check made while "
            "the workers landed its layout found it), so that update is "
            "aborted before its commit and the sync goes again in full"
        ) from sent
    if sent is not None:
        raise sent
    return True
