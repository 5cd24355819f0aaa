# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coordination among the ranks of a multi-process trainer during a send.

Every rank of the group runs the same sequence of calls (they iterate the
weight source in lockstep); the rank whose trainer ``rank`` is 0 is the sender.
One operation, bounded by a timeout:

``exchange(payload, error, what)`` is a barrier that returns
``{trainer_rank: payload}`` from every rank, whatever their ranks in the process
group, and carries each rank's failure: when any rank passes an error, every
rank raises ``TrainerGroupError`` naming it instead of waiting on that rank.

``on_sender(group, is_sender, what, step)`` runs one step of a sync on the
sender only (a call to the server, the receipt check) and then exchanges its
outcome, so every rank raises when it failed; a trainer of one process raises
the step's own exception.

The group is the one the caller passes (used as is, with its own timeout), or,
when torch.distributed is initialized with more than one process, a new gloo
group over all ranks with ``timeout_s``. A single process uses ``LocalGroup``,
where both operations are trivial.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from vllm.distributed.weight_transfer.verification import (
    describe_error,
)

T = TypeVar("T")


class TrainerGroupError(RuntimeError):
    """Raised on every rank when some rank of the trainer group failed."""


class LocalGroup:
    """A trainer of one process."""

    world_size = 1

    def __init__(self, trainer_rank: int) -> None:
        self.trainer_rank = trainer_rank

    def exchange(self, payload: Any, error: str | None, what: str) -> dict[int, Any]:
        if error is not None:
            raise TrainerGroupError(f"{what} failed on trainer rank 0: {error}")
        return {self.trainer_rank: payload}


class DistributedGroup:
    """A trainer of several processes, coordinated over a torch process group."""

    def __init__(self, trainer_rank: int, group: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        self.trainer_rank = trainer_rank
        self.group = group
        self.timeout_s = timeout_s
        self.world_size = dist.get_world_size(group)

    def exchange(self, payload: Any, error: str | None, what: str) -> dict[int, Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(
                gathered, (self.trainer_rank, payload, error), group=self.group
            )
        except RuntimeError as e:
            raise TrainerGroupError(
                f"{what}: trainer ranks did not all arrive within the process "
                f"group's timeout ({self.timeout_s:.0f}s unless the caller's group "
                f"sets another): {e}"
            ) from e
        failed = sorted((r, err) for r, _, err in gathered if err is not None)
        if failed:
            detail = "; ".join(f"trainer rank {r}: {err}" for r, err in failed)
            raise TrainerGroupError(f"{what} failed on {detail}")
        ranks = sorted(r for r, _, _ in gathered)
        if ranks != list(range(self.world_size)):
            raise TrainerGroupError(
                f"trainer ranks in the group are {ranks}; each process must pass "
                f"a distinct IPCTrainerInitInfo.rank in 0..{self.world_size - 1}"
            )
        return {r: p for r, p, _ in gathered}


TrainerGroup = LocalGroup | DistributedGroup


def make_trainer_group(
    trainer_rank: int, group: Any = None, timeout_s: float = 300.0
) -> TrainerGroup:
    """The group for a trainer rank; see the module docstring."""
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return LocalGroup(trainer_rank)
        if dist.get_world_size() == 1:
            return LocalGroup(trainer_rank)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    elif dist.get_world_size(group) == 1:
        return LocalGroup(trainer_rank)
    return DistributedGroup(trainer_rank, group, timeout_s)


def on_sender(
    group: TrainerGroup, is_sender: bool, what: str, step: Callable[[], T]
) -> T | None:
    """Run ``step()`` on the sender, then tell every rank how it went: a
    failure raises ``TrainerGroupError`` on every rank (in a trainer of one
    process, the step's own exception). Returns the step's result on the
    sender, None on the other ranks."""
    result: T | None = None
    error: str | None = None
    if is_sender:
        if group.world_size == 1:
            return step()
        try:
            result = step()
        except Exception as e:
            error = f"{what}: {describe_error(e)}"
    group.exchange(None, error, what)
    return result
