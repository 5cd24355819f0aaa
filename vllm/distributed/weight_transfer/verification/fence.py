# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fencing: a worker engine refuses to build on top of a failed update.

Loading writes resident weight storage in place, so an update that fails after
its first byte landed cannot be rolled back: the model now mixes two versions.
``WeightFence`` is the worker engine's small state machine for that case::

    idle / committed --start--> updating --finish--> committed(version)
                                   |
                                 fail (weights touched)
                                   v
                                fenced(reason) --start--> updating (resync)

* ``start`` is always allowed: it is how a resync begins.
* While fenced, ``update_weights`` and ``finish_weight_update`` raise
  ``WeightsFencedError`` with the reason and what to do.
* A resync clears the fence only if it is a publication that finishes with a
  complete receipt; an update without a publication header (a hand-built
  payload) cannot prove it is complete.
* A failure before any weight was touched (a rejected header or manifest)
  leaves the weights intact: the update is closed and the state returns to what
  it was, with the failure remembered in ``status.last_failure``.
* Model versions never go backwards: a publication older than the committed one
  is rejected before it touches anything. Re-publishing the same version (a
  retry) is allowed. The order is the base weights' own: a LoRA adapter push
  (``lora_publication``) orders its versions per adapter name with the same
  rule (``check_model_version``) and never reaches this fence, so an update
  that carried only an adapter leaves the committed publication and version
  as they were.
* A version more than ``MAX_VERSION_AHEAD_US`` (five minutes) beyond this
  host's wall clock in microseconds (what default trainers publish) is
  rejected the same way. The committed version is therefore never more than
  that ahead of the clock, so no publication can make default trainers, whose
  versions are the clock, "older" for longer than that.

The worker cannot change the version the server reports (that lives in the
engine core), so the trainer makes the fence visible: on any failure it sets
the served weight version to ``fenced_version(...)`` (``"fenced:<publication
id>: <reason>"``) and sets the real version only after every receipt verified.
``set_served_version`` does that through the client's
``update_weight_version``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.common.messages import (
    ABORT_FIELD,
    PREPARE_FIELD,
)
from vllm.distributed.weight_transfer.verification.wire import (
    PublicationHeader,
    describe_error,
)

FENCED_VERSION_PREFIX = "fenced:"
# How far (microseconds) a publication's model version may lie beyond this
# host's wall clock in microseconds: five minutes. It absorbs the clock skew
# between a trainer's host and the server's, and it is the longest a single
# publication can keep default (wall-clock) trainers out.
MAX_VERSION_AHEAD_US = 5 * 60 * 1_000_000
_REASON_LIMIT = 300


class WeightsFencedError(RuntimeError):
    """The engine refuses an operation until a full resync completes."""


# An update message ``{"abort": reason}`` (``ABORT_FIELD``) closes the open
# update: layers that did not complete keep their weights, and the engine is
# fenced if any weight had landed. The message keys live in
# ``common.messages``, with the rule that classifies a body.


def _sole_string_field(d: object, name: str, meaning: str = "") -> str | None:
    """``d[name]`` when ``d`` is a message carrying field ``name``, or None
    for any other message; ``ValueError`` unless that field is the only one
    and a string (``meaning`` says what the string is, for the error)."""
    if not isinstance(d, dict) or name not in d:
        return None
    if set(d) != {name} or not isinstance(d[name], str):
        raise ValueError(
            f"update_info.{name} must be the only field and a string{meaning}, "
            f"got fields {sorted(d)}"
        )
    return d[name]


def abort_reason(d: object) -> str | None:
    """The reason of an abort message, or None for any other message."""
    return _sole_string_field(d, ABORT_FIELD)


def is_prepare_request(d: object) -> bool:
    """Whether ``d`` is the trainer's prepare message (``{"prepare":
    publication_id}``): every weight was sent; the worker checks what it holds
    and writes its receipt before the commit (``finish_weight_update``)."""
    return _sole_string_field(d, PREPARE_FIELD, " (the publication id)") is not None


class WeightState(enum.Enum):
    IDLE = "idle"
    UPDATING = "updating"
    FENCED = "fenced"
    COMMITTED = "committed"


@dataclass(frozen=True)
class FenceStatus:
    """A snapshot of a ``WeightFence``; JSON-safe via ``to_dict``."""

    state: WeightState
    reason: str | None
    publication_id: str | None
    model_version: int | None
    resync_required: bool
    last_failure: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "reason": self.reason,
            "publication_id": self.publication_id,
            "model_version": self.model_version,
            "resync_required": self.resync_required,
            "last_failure": self.last_failure,
        }


def fenced_message(reason: str) -> str:
    return (
        f"weights are fenced after a failed update ({reason}); a full resync is "
        "required: start_weight_update, send every tensor, finish_weight_update"
    )


class WeightFence:
    """Per-engine update state; see the module docstring.

    The engine calls ``start`` in ``start_weight_update``, ``bind`` with the
    header of each update message, ``touch`` right before the first write to a
    weight, ``fail`` when anything in the update raises, and ``finish`` once
    its receipt is written.
    """

    def __init__(self) -> None:
        self._state = WeightState.IDLE
        self._reason: str | None = None
        # The committed publication, or the one being received while updating.
        self._committed_id: str | None = None
        self._committed_version: int | None = None
        self._header: PublicationHeader | None = None
        self._touched = False
        self._resync_required = False
        self._before = WeightState.IDLE
        self._last_failure: str | None = None

    @property
    def state(self) -> WeightState:
        return self._state

    @property
    def status(self) -> FenceStatus:
        header = self._header if self._state == WeightState.UPDATING else None
        return FenceStatus(
            state=self._state,
            reason=self._reason,
            publication_id=header.publication_id if header else self._committed_id,
            model_version=header.model_version if header else self._committed_version,
            resync_required=self._resync_required,
            last_failure=self._last_failure,
        )

    # -- transitions -----------------------------------------------------------

    def start(self) -> None:
        """Open an update. An update already open is abandoned first."""
        if self._state == WeightState.UPDATING:
            self.fail(
                "a new start_weight_update abandoned the open update",
                weights_intact=not self._touched,
            )
        self._resync_required = self._state == WeightState.FENCED
        self._before = self._state
        self._state = WeightState.UPDATING
        self._header = None
        self._touched = False

    def bind(self, header: PublicationHeader | None) -> None:
        """Check an update message's header against the open update.

        Raises (without touching any state) if the message cannot belong to it;
        the engine then calls ``fail``.
        """
        self.check_open("update_weights")
        if header is None:
            return
        if self._header is not None:
            if header.publication_id != self._header.publication_id:
                raise ValueError(
                    f"update belongs to publication {header.publication_id} but "
                    f"the open update is publication {self._header.publication_id}"
                )
            return
        check_model_version(header, self._committed_version)
        self._header = header

    def touch(self) -> None:
        """Note that weights are about to change; a failure from now fences."""
        self.check_open("update_weights")
        self._touched = True

    def fail(self, reason: str, *, weights_intact: bool = False) -> None:
        """Close the open update as failed.

        Fences unless ``weights_intact`` (nothing was written: the engine knows
        it rejected the update before landing anything) and no weight was
        touched in this update and no resync was pending. Outside an open update
        (a misuse such as ``update_weights`` before ``start``) it only records
        the failure.
        """
        reason = _one_line(reason)
        self._last_failure = reason
        if self._state != WeightState.UPDATING:
            return
        if weights_intact and not self._touched and not self._resync_required:
            self._state = self._before
        else:
            self._state = WeightState.FENCED
            self._reason = reason
        self._header = None
        self._touched = False

    def finish(self) -> None:
        """Commit the open update (call after its receipt was produced)."""
        self.check_open("finish_weight_update")
        header = self._header
        if header is None and self._resync_required:
            reason = self._reason or "unknown"
            self.fail(reason)
            raise WeightsFencedError(
                fenced_message(reason)
                + "; the resync carried no publication header, so its "
                "completeness cannot be checked"
            )
        self._state = WeightState.COMMITTED
        self._reason = None
        self._resync_required = False
        if header is not None:
            self._committed_id = header.publication_id
        elif self._touched:
            # Weights changed without a publication to name them.
            self._committed_id = None
        self._committed_version = (
            header.model_version if header else self._committed_version
        )
        self._header = None
        self._touched = False

    # -- guards ----------------------------------------------------------------

    def check_open(self, operation: str) -> None:
        """Raise unless an update is open; fenced engines say why."""
        if self._state == WeightState.FENCED:
            raise WeightsFencedError(fenced_message(self._reason or "unknown"))
        if self._state != WeightState.UPDATING:
            raise RuntimeError(
                f"{operation} needs an open weight update; call "
                "start_weight_update first"
            )


def version_ceiling() -> int:
    """The largest model version a worker accepts now."""
    return time.time_ns() // 1000 + MAX_VERSION_AHEAD_US


def check_model_version(
    header: PublicationHeader, committed: int | None, domain: str = ""
) -> None:
    """Refuse ``header`` (``ValueError``) when its model version is older than
    ``committed``, the version its domain holds now, or beyond
    ``version_ceiling()``. A domain is one order of versions: the base
    weights (``WeightFence``, ``domain`` empty) or one LoRA adapter
    (``domain`` names it, for the error)."""
    ceiling = version_ceiling()
    if header.model_version > ceiling:
        raise ValueError(
            f"publication.model_version {header.model_version} of publication "
            f"{header.publication_id}{domain} is beyond {ceiling} (this host's "
            "wall clock in microseconds plus MAX_VERSION_AHEAD_US, five "
            "minutes); committing it would lock out every trainer that "
            "versions by the wall clock. Use a smaller model_version, or none "
            "(the wall clock), and keep the trainer's and server's clocks in "
            "sync"
        )
    if committed is not None and header.model_version < committed:
        raise ValueError(
            f"publication {header.publication_id}{domain} carries model version "
            f"{header.model_version}, older than the committed version "
            f"{committed}; versions never go backwards"
        )


# ---------------------------------------------------------------------------
# trainer side: making the outcome visible


def fenced_version(publication_id: str, reason: str) -> str:
    """The weight version a trainer sets when a publication fails."""
    return f"{FENCED_VERSION_PREFIX}{publication_id}: {_one_line(reason)}"


def is_fenced_version(version: str | None) -> bool:
    return version is not None and version.startswith(FENCED_VERSION_PREFIX)


def set_served_version(client: Any, version: str) -> None:
    """Set the weight version the server reports, through a sync client.

    The client needs ``update_weight_version(new_version)``; the fork's three
    clients (``clients.py``) have it.
    """
    method = getattr(client, "update_weight_version", None)
    if not callable(method):
        raise TypeError(
            f"{type(client).__name__} cannot set the served weight version; give "
            "it an update_weight_version(new_version) method"
        )
    method(version)


def _one_line(text: str) -> str:
    text = " ".join(describe_error(text).split())
    if len(text) > _REASON_LIMIT:
        text = text[: _REASON_LIMIT - 1] + "…"
    return text
