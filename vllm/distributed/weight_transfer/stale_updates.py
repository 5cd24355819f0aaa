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
  reason and the logs.
* shared-memory segments ``/dev/shm/vllm-wt-<pid>-<random>`` and receipt
  directories ``vllm-wt-receipts-<publication id>`` whose owner's lock died
  with it: the next trainer removes them before it creates its own
  (``shm_buffer.reap_segments``, ``verification.receipts.reap_receipt_dirs``;
  see ``owner_lock``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.verification import (
    ABORT_FIELD,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# vLLM's Worker.start_weight_update refuses with this while an update is open.
_STILL_OPEN_TEXT = "already active"


def start_update(client: Any, who: str) -> None:
    """``client.start_weight_update()``, abandoning an update a dead trainer
    left open; see the module docstring. Any other refusal is raised."""
    try:
        client.start_weight_update()
        return
    except Exception as e:
        if _STILL_OPEN_TEXT not in str(e):
            raise
        logger.warning(
            "The server still holds an open weight update (%s); %s abandons it "
            "and starts a new one",
            e,
            who,
        )
    reason = f"abandoned: {who} started a new sync while this update was open"
    for method, args in (
        ("update_weights", ({ABORT_FIELD: reason},)),
        ("finish_weight_update", ()),
    ):
        try:
            getattr(client, method)(*args)
        except Exception as e:  # the server may already have closed it
            logger.debug("abandoning the open update: %s raised %s", method, e)
    client.start_weight_update()
