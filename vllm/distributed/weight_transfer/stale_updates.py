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
* shared-memory segments ``/dev/shm/vllm-wt-<pid>-<random>``: ``reap_segments``
  removes those whose creating process no longer exists and that belong to
  this user. Trainers call it before they create segments.
* receipt directories ``vllm-wt-receipts-<publication id>`` (one per verified
  sync, removed when the sync ends): ``reap_receipt_dirs`` removes this user's
  that are older than ``RECEIPT_DIR_MAX_AGE_S``, far longer than any sync.
  Trainers call it before they create one.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from typing import Any

from vllm.distributed.weight_transfer.verification import (
    ABORT_FIELD,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# vLLM's Worker.start_weight_update refuses with this while an update is open.
_STILL_OPEN_TEXT = "already active"
_SEGMENT_RE = re.compile(r"vllm-wt-(?P<pid>\d+)-[0-9a-f]+")
SHM_ROOT = "/dev/shm"
_RECEIPT_DIR_RE = re.compile(r"vllm-wt-receipts-[A-Za-z0-9_-]{8,64}")
RECEIPT_DIR_MAX_AGE_S = 24 * 3600.0


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_segments(root: str = SHM_ROOT) -> list[str]:
    """Remove this user's ``vllm-wt-<pid>-*`` segments whose process is gone;
    return their names."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    uid = os.getuid()
    removed = []
    for entry in entries:
        match = _SEGMENT_RE.fullmatch(entry.name)
        if match is None or _alive(int(match["pid"])):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != uid or not entry.is_file(follow_symlinks=False):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
    if removed:
        logger.info(
            "Removed %d shared-memory segment(s) left by exited trainers: %s",
            len(removed),
            ", ".join(removed[:5]),
        )
    return removed


def reap_receipt_dirs(root: str, max_age_s: float = RECEIPT_DIR_MAX_AGE_S) -> list[str]:
    """Remove this user's receipt directories under ``root`` last modified more
    than ``max_age_s`` ago (left by trainers that died); return their names."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    uid, now = os.getuid(), time.time()
    removed = []
    for entry in entries:
        if _RECEIPT_DIR_RE.fullmatch(entry.name) is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if (
                st.st_uid != uid
                or not entry.is_dir(follow_symlinks=False)
                or now - st.st_mtime <= max_age_s
            ):
                continue
            shutil.rmtree(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
    if removed:
        logger.info("Removed %d stale receipt directories", len(removed))
    return removed
