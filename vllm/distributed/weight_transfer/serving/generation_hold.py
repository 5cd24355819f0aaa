# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the weight update guard (``serving.update_guard``) holds: the state of
one watched update's hold on generation (`Hold`), the engine steps that end
a hold, and what a route answered (`Reply`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class Hold:
    """An open in-place update the guard watches: base weights landing (with
    generation held), or a LoRA adapter push being staged (nothing held until
    its finish)."""

    # Whether generation is held: the guard paused it, or found it paused.
    paused: bool = False
    # Whether the guard paused generation (and so resumes it at the release).
    owns_pause: bool = False
    # Whether an ``update_weights`` carrying base weights succeeded.
    accepted: bool = False
    # Whether an ``update_weights`` carrying a LoRA adapter succeeded.
    adapter: bool = False
    # The publication the update's messages named, for the fence label.
    publication_id: str = "unknown"
    # Weight route calls now being answered (the deadline waits for them).
    calls_in_flight: int = 0
    deadline: asyncio.TimerHandle | None = None
    # The expiry task, once the deadline fired (kept so it is not collected).
    expiry: asyncio.Future | None = None


def cancel_deadline(hold: Hold) -> None:
    if hold.deadline is not None:
        hold.deadline.cancel()
        hold.deadline = None


async def end_pause(engine: Any) -> None:
    """Drop the KV the previous weights computed (frozen requests included)
    and resume generation."""
    try:
        # Frozen requests hold KV computed by the previous weights.
        await engine.reset_prefix_cache(reset_running_requests=True)
    finally:
        await resume_once_more(engine)


async def resume_once_more(engine: Any) -> None:
    try:
        await engine.resume_generation()
    except Exception:
        logger.exception("resume_generation failed; trying once more")
        await engine.resume_generation()


@dataclass
class Reply:
    """What a route answered: its status and the start of its body."""

    status: int = 500
    body: bytes = b""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error(self) -> str:
        """The error message of a failed answer, on one line."""
        text = self.body.decode("utf-8", "replace")
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict):
            inner = value.get("error", value.get("detail", value))
            if isinstance(inner, dict):
                inner = inner.get("message", inner)
            text = str(inner)
        return " ".join(f"HTTP {self.status}: {text}".split())[:300]
