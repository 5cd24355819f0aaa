# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer stand-in for reaper tests: a forked process that creates an
entry (a shared-memory segment, a receipt box) and holds it until it is
killed with SIGKILL, so that nothing of its own tidies up."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

START_TIMEOUT_S = 30.0


def _hold(create: Callable[[], tuple[str, Any]], send: Connection) -> None:
    name, held = create()
    send.send(name)
    while held is not None:  # keeps the entry referenced until killed
        time.sleep(3600)


class OwnerChild:
    """Forks a process that runs ``create()`` (returning a name and the object
    that owns the entry) and holds what it made; ``name`` is that name."""

    def __init__(self, create: Callable[[], tuple[str, Any]]) -> None:
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_hold, args=(create, send), daemon=True)
        self.process.start()
        send.close()
        try:
            if not recv.poll(START_TIMEOUT_S):
                raise TimeoutError(
                    f"the owner child did not create its entry in {START_TIMEOUT_S}s"
                )
            self.name: str = recv.recv()
        except BaseException:
            self.kill()
            raise
        finally:
            recv.close()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the child and wait (bounded) until it is gone."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(timeout=START_TIMEOUT_S)
        if self.process.is_alive():
            raise TimeoutError(f"owner child {self.pid} survived SIGKILL")

    def __enter__(self) -> OwnerChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def exited_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join(timeout=START_TIMEOUT_S)
    assert proc.pid is not None and proc.exitcode == 0
    return proc.pid
