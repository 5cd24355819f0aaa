# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What both update sessions (``LayerwiseReloadSession``, ``StagedUpdate``)
track about the trainer's calls of one weight update (`UpdateCalls`): the
longest gap allowed between two calls, when the last one came, the tensor
names received so far, and why the update was aborted (for the message a
later call gets); and what the worker engine reads of either session through
them (`CalledSession`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import ClassVar


class UpdateCalls:
    """The calls of one weight update, as seen by its session."""

    def __init__(
        self,
        timeout_s: float | None,
        *,
        noun: str = "weight update",
        aborted_note: str | None = None,
    ) -> None:
        # Longest gap between two calls of one update (None: no limit).
        self.timeout_s = timeout_s
        self.last_call = time.monotonic()
        self.received: set[str] = set()
        self.aborted_reason: str | None = None
        # How ``closed_message`` names the update, and what it adds after the
        # reason of an abort.
        self._noun = noun
        self._aborted_note = aborted_note

    def restart(self) -> None:
        """A new update opens: no abort reason, the clock starts now."""
        self.aborted_reason = None
        self.last_call = time.monotonic()

    def note_call(self) -> None:
        """Count the update as active now (the deadline restarts)."""
        self.last_call = time.monotonic()

    def overdue(self, is_open: bool) -> str | None:
        """Note this call; if the open update went more than ``timeout_s``
        without one, the reason to abort it, else None."""
        now = time.monotonic()
        idle = now - self.last_call
        self.last_call = now
        if not is_open or self.timeout_s is None or idle <= self.timeout_s:
            return None
        return (
            f"the update went {idle:.0f} s without a call from the trainer "
            f"(update_timeout_s={self.timeout_s:g})"
        )

    def new_names(self, names: Iterable[str]) -> set[str]:
        """``names`` as a set, after checking that none came twice in this
        update (``ValueError`` otherwise); they are not recorded yet."""
        names = list(names)
        fresh = set(names)
        repeated = fresh & self.received
        if len(fresh) != len(names) or repeated:
            dup = sorted(repeated) or _first_repeat(names)
            raise ValueError(
                f"this update carries {dup[0]!r} more than once; each tensor "
                "may travel once per update"
            )
        return fresh

    def closed_message(self, what: str) -> str:
        """Why ``what`` cannot run on the closed update, and what to do."""
        if self.aborted_reason is None:
            return f"{what} needs an open update; call start_weight_update first"
        aborted = f"{what}: the {self._noun} was aborted ({self.aborted_reason})"
        close = (
            "{'abort': ...} or call finish_weight_update to close it, then "
            "start a new full update"
        )
        if self._aborted_note is not None:
            return f"{aborted}; {self._aborted_note}. Send {close}"
        return f"{aborted}; send {close}"


class CalledSession:
    """The part of an update's session the worker engine reads the same way
    for both kinds: whether it is open, why it was aborted, the deadline
    between the trainer's calls, and the message a call on the closed
    session gets. A session names itself in errors (``session_noun``) and
    says what an overdue update aborts (``_abort_overdue``)."""

    session_noun: ClassVar[str]
    _calls: UpdateCalls
    _open: bool

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def aborted_reason(self) -> str | None:
        """Why the last update was aborted (None unless it was)."""
        return self._calls.aborted_reason

    def start(self) -> None:
        if self._open:
            raise RuntimeError(f"this {self.session_noun} is already open")
        self._open = True
        self._calls.restart()

    def check_deadline(self, what: str) -> None:
        """Abort the update and raise ``TimeoutError`` when more than
        ``timeout_s`` passed since its last call; otherwise note this call."""
        reason = self._calls.overdue(self._open)
        if reason is None or self._busy():
            return
        self._abort_overdue(reason)
        raise TimeoutError(self.closed_message(what))

    def closed_message(self, what: str) -> str:
        """Why ``what`` cannot run on this closed session, and what to do."""
        return self._calls.closed_message(what)

    def abort(self, reason: str = "the update was aborted") -> None:
        raise NotImplementedError

    def _busy(self) -> bool:
        """Whether the session is doing the update's own work now, so that no
        call from the trainer is overdue."""
        return False

    def _abort_overdue(self, reason: str) -> None:
        """The update went past its deadline: abort it."""
        self.abort(reason)


def _first_repeat(names: list[str]) -> list[str]:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return [name]
        seen.add(name)
    return []
