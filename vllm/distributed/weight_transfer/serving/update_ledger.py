# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The weight update guard's ledger (``serving.update_guard``): which update
the workers hold open, as the routes saw it, how recent ones ended, and
whether a message may reach the workers at all (no update open, a
publication that already ended, a prepare naming another publication). It
reads update bodies by the message vocabulary of ``common.messages``; it
knows no engine and no ASGI."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.common.asgi import json_object
from vllm.distributed.weight_transfer.common.messages import (
    ABORT_FIELD,
    PREPARE_FIELD,
    MessageKind,
    UnclassifiableUpdate,
    first_message,
)
from vllm.distributed.weight_transfer.verification.wire import (
    PUBLICATION_FIELD,
    PublicationHeader,
)

# In the 409 answer to a start while an update is open; what
# ``stale_updates.start_update`` recognizes (vLLM's worker says the same).
STILL_OPEN_TEXT = "already active"
# How many closed publications the guard remembers, to name why their late
# messages are refused.
_CLOSED_KEPT = 64


@dataclass
class OpenUpdate:
    """The update the workers hold open, as the routes saw it."""

    opened: float
    publication_id: str | None = None
    adapter: str | None = None
    # The reason of an abort message the workers took (finish closes it).
    aborted: str | None = None

    def describe(self) -> str:
        what = (
            f"publication {self.publication_id}"
            if self.publication_id
            else "no publication named yet"
        )
        if self.adapter:
            what += f", LoRA adapter {self.adapter!r}"
        if self.aborted:
            what += f", aborted ({self.aborted}) but not finished"
        return f"{what}, open {time.monotonic() - self.opened:.1f} s"


class UpdateLedger:
    """The open update and how the last ones ended; see the module
    docstring."""

    def __init__(self) -> None:
        # The update the workers hold open (None when none is).
        self.open: OpenUpdate | None = None
        # How the last update ended, and how each recent publication did.
        self.last_end: str | None = None
        self.ended: OrderedDict[str, str] = OrderedDict()

    def start_refusal(self, route: str) -> str | None:
        """Why a start is refused (an update is open), or None."""
        if self.open is None:
            return None
        return (
            f"a weight update is {STILL_OPEN_TEXT} on this server "
            f"({self.open.describe()}); {route.lstrip('/')} refused. Close "
            "it first (update_weights {'abort': '<reason>'}, then "
            "finish_weight_update; stale_updates.start_update does this "
            "for a trainer taking over from a dead one), or wait for it"
        )

    def opened(self) -> None:
        """A start succeeded: the workers hold an update open from now."""
        self.open = OpenUpdate(time.monotonic())

    def aborted_open(self) -> bool:
        """Whether the open update took an abort and awaits its finish."""
        return self.open is not None and self.open.aborted is not None

    def refusal(self, kind: MessageKind, update_info: Any) -> str | None:
        """Why a message that may land or prepare anything is refused: no
        update is open, it names a publication that already ended, or it is
        a prepare naming another publication than the open update's."""
        if kind is MessageKind.ABORT:
            return None  # closing what may be open is always allowed
        publication = publication_id(update_info)
        if publication is not None and publication in self.ended:
            return (
                f"publication {publication} already ended on this server "
                f"({self.ended[publication]}); none of its messages are "
                "taken any more. Start a new sync: start_weight_update, every "
                "tensor, finish_weight_update"
            )
        if self.open is None:
            last = f"; the last one {self.last_end}" if self.last_end else ""
            return (
                f"no weight update is open on this server{last}. Call "
                "start_weight_update first"
            )
        known = self.open.publication_id
        if kind is MessageKind.PREPARE and known is not None:
            named = first_message(update_info)[PREPARE_FIELD]
            if named != known:
                # Answered here, so the open update goes on: a refusal from
                # the workers would close it (vLLM's Worker closes an update
                # whose update_weights raised).
                return (
                    f"update_info.{PREPARE_FIELD} names publication {named!r} "
                    f"but the open update is publication {known}; refused "
                    "before reaching the workers, and the open update goes on"
                )
        return None

    def note(self, kind: MessageKind, update_info: Any) -> None:
        """Remember what an accepted message says about the open update."""
        opened = self.open
        if opened is None:
            return
        publication = publication_id(update_info)
        if publication is not None and opened.publication_id is None:
            opened.publication_id = publication
        if kind is MessageKind.ADAPTER:
            adapter = first_message(update_info).get("adapter")
            if isinstance(adapter, dict) and opened.adapter is None:
                opened.adapter = str(adapter.get("name"))
        if kind is MessageKind.ABORT:
            opened.aborted = abort_text(update_info)

    def end(self, how: str) -> None:
        """The workers closed the open update; remember ``how`` (a phrase
        that follows "the last one": "finished", "expired (...)")."""
        opened, self.open = self.open, None
        if how == "finished" and opened is not None and opened.aborted is not None:
            how = f"was aborted ({opened.aborted})"
        self.last_end = how
        if opened is not None and opened.publication_id is not None:
            self.ended[opened.publication_id] = how
            while len(self.ended) > _CLOSED_KEPT:
                self.ended.popitem(last=False)


def update_info_of(body: bytes) -> Any:
    """The body's ``update_info``; ``UnclassifiableUpdate`` without one."""
    value = json_object(body)
    if "update_info" not in value:
        raise UnclassifiableUpdate(
            "the body must be a JSON object with an update_info field, got "
            f"{body[:80]!r}"
        )
    return value["update_info"]


def abort_text(update_info: Any) -> str:
    """The reason an abort message gives (any of its messages)."""
    reason = first_message(update_info).get(ABORT_FIELD)
    return reason if isinstance(reason, str) else f"malformed abort {reason!r}"


def publication_id(update_info: Any) -> str | None:
    """The id a valid publication header in the message names, if any."""
    items = update_info if isinstance(update_info, list) else [update_info]
    for item in items:
        if isinstance(item, dict) and PUBLICATION_FIELD in item:
            try:
                header = PublicationHeader.from_dict(item[PUBLICATION_FIELD])
            except (TypeError, ValueError):
                continue  # the worker refuses it; the label says "unknown"
            return header.publication_id
    return None
