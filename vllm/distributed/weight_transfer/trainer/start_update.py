# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Recovering from a trainer that died in the middle of a sync.

Such a trainer leaves two things behind:

* an update that vLLM's worker still holds open: its ``start_weight_update``
  refuses with "already active" until a call closes it. ``start_update``
  starts an update and, when the server refuses for that reason, abandons the
  open one (an ``{"abort": reason}`` update, then ``finish_weight_update``:
  the workers put back every layer that did not complete and fence the engine
  if any weight had landed) and starts again, once. A new trainer therefore
  needs no manual step; the abandoned update's cause stays in the fence
  reason and the logs. ``start_update(..., take_over=False)`` (a LoRA
  adapter push, which must not end a live base update) never abandons
  anything: it waits a bounded time for the open update to close.
* shared-memory segments ``/dev/shm/vllm-wt-<pid>-<random>`` and receipt
  directories ``vllm-wt-receipts-<publication id>`` whose owner's lock died
  with it: the next trainer removes them before it creates its own
  (``shm_buffer.reap_segments``, ``verification.receipts.reap_receipt_dirs``;
  see ``owner_lock``).
"""

from __future__ import annotations

import re
import time
from typing import Any

from vllm.distributed.weight_transfer.verification import (
    ABORT_FIELD,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Refused starts while an update is open say this: vLLM's Worker and the
# weight update guard's 409 (``update_ledger.STILL_OPEN_TEXT``).
_STILL_OPEN_TEXT = "already active"
# How long ``start_update(..., take_over=False)`` waits for an open update to
# close by default, and how often it asks again meanwhile.
DEFAULT_WAIT_S = 30.0
_RETRY_S = 0.5
_OPEN_PUBLICATION_RE = re.compile(r"publication ([A-Za-z0-9_-]{8,64})")


class UpdateStillOpen(RuntimeError):
    """``start_update(..., take_over=False)`` found another update open on
    the server for longer than it was willing to wait; nothing was changed."""


def start_update(
    client: Any,
    who: str,
    *,
    take_over: bool = True,
    wait_s: float = DEFAULT_WAIT_S,
) -> None:
    """``client.start_weight_update()`` while another update may be open.

    With ``take_over`` (a base trainer after a dead one) the open update is
    abandoned at once (see the module docstring), with one log line naming
    it. Without, it is never abandoned: the start is retried every
    ``_RETRY_S`` for up to ``wait_s`` seconds, then ``UpdateStillOpen``
    names the open update. Any other refusal is raised."""
    if not 0.0 <= wait_s < float("inf"):
        raise ValueError(f"wait_s must be a finite number >= 0, got {wait_s!r}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.start_weight_update()
            return
        except Exception as e:
            if _STILL_OPEN_TEXT not in str(e):
                raise
            refusal = e
        left = deadline - time.monotonic()
        if take_over:
            break
        if left <= 0:
            raise UpdateStillOpen(
                f"{who} did not start a weight update: another update is open "
                f"on the server ({_open_update(refusal)}) and did not close "
                f"within wait_s={wait_s:g} s; it is left to its owner "
                "(take_over=False). Retry later, or raise wait_s"
            ) from refusal
        time.sleep(min(_RETRY_S, left))
    opened = _open_update(refusal)
    logger.warning(
        "%s abandons the open weight update (%s) and starts a new one", who, opened
    )
    reason = f"abandoned: {who} started a new sync while this update was open"
    publication = _OPEN_PUBLICATION_RE.search(str(refusal))
    if publication is not None:
        reason += f" (publication {publication.group(1)})"
    for method, args in (
        ("update_weights", ({ABORT_FIELD: reason},)),
        ("finish_weight_update", ()),
    ):
        try:
            getattr(client, method)(*args)
        except Exception as e:  # the server may already have closed it
            logger.debug("abandoning the open update: %s raised %s", method, e)
    client.start_weight_update()


def _open_update(refusal: BaseException) -> str:
    """What the server's refusal says of the open update, on one line."""
    text = " ".join(str(refusal).split())
    publication = _OPEN_PUBLICATION_RE.search(text)
    named = f"publication {publication.group(1)}" if publication else "unnamed"
    return f"{named}; the server said: {text[:300]}"
