# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Who serves whom in a remote pull, and the settings both sides share.

* Routing: `RdtRouter` decides, as a pure function of the ownership table, which
  producer (trainer rank) serves each consumer (inference worker) each name.
* The Ray version gate `check_ray_rdt_version`, which vLLM's Ray executor calls
  before it creates worker actors with ``enable_tensor_transport``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm.distributed.weight_transfer.plan.ops import VIEW_OPS

# Methods of torch.Tensor a plan may replay -> their op names. The allowlist
# itself lives in `sharded_rdt_ops.VIEW_OPS`; these two names mirror it.
SUPPORTED_OPS: Mapping[Any, str] = {getattr(torch.Tensor, n): n for n in VIEW_OPS}
ALLOWED_OPS = frozenset(VIEW_OPS)

# Ray version this backend's Ray Direct Transport path is tested against.
RDT_MIN_RAY_VERSION = "2.56.0"

PRODUCE_METHOD_NAME = "rdt_produce_weights_batched"
DEFAULT_GATHER_LOOKAHEAD = 1
DEFAULT_STALL_TIMEOUT_S = 300.0
DEFAULT_NUM_RDT_BUFFERS = 2

# "auto": the worker picks "rdt" under vLLM's Ray executor when the trainer
# spawned Ray producer actors, else "nixl". "inprocess" serves producers that
# live in the worker's own process (tests).
TRANSPORTS = ("auto", "rdt", "nixl", "inprocess")

_ALIGN_256MIB = 256 << 20


def check_ray_rdt_version() -> None:
    """Raise ValueError when the installed Ray is older than RDT_MIN_RAY_VERSION
    (or missing); vLLM itself does not depend on Ray."""
    import importlib.metadata

    from packaging import version

    try:
        found = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            "the 'sharded_rdt' Ray Direct Transport needs Ray >= "
            f"{RDT_MIN_RAY_VERSION}, and Ray is not installed; "
            f"`pip install 'ray>={RDT_MIN_RAY_VERSION}'`, or use "
            "transport='nixl', which needs no Ray on the inference side"
        ) from e
    if version.parse(found) < version.parse(RDT_MIN_RAY_VERSION):
        raise ValueError(
            f"the 'sharded_rdt' Ray Direct Transport needs Ray >= "
            f"{RDT_MIN_RAY_VERSION}; found Ray {found}. Upgrade with "
            f"`pip install -U 'ray>={RDT_MIN_RAY_VERSION}'`"
        )


def register_nixl_memory(tensor: torch.Tensor) -> None:
    """Register ``tensor`` with Ray Direct Transport's NIXL agent in this
    process once, so transfers out of it do not register it each time."""
    from ray.experimental import register_nixl_memory as ray_register

    ray_register(tensor)


def assign_producer_indices(
    num_producers: int, num_consumers: int, consumer_idx: int
) -> list[int]:
    """Indices (into a list of ``num_producers`` candidates) that consumer
    ``consumer_idx`` of ``num_consumers`` draws from: a contiguous, even share
    when producers outnumber consumers, otherwise one producer per consumer
    with consumers spread evenly."""
    p = max(1, num_producers)
    c = max(1, num_consumers)
    if p >= c:
        return list(range(consumer_idx * p // c, (consumer_idx + 1) * p // c))
    return [consumer_idx * p // c]


def buffer_alloc_bytes(nbytes: int, presize: int = 0) -> int:
    """Bytes to allocate for a registered buffer that must hold ``nbytes``: at
    least ``presize``, rounded up to 256 MiB, so a buffer is registered once and
    never regrows."""
    return max(nbytes, presize, -(-nbytes // _ALIGN_256MIB) * _ALIGN_256MIB)


def serve_share_key(consumer_id: int, workers_per_replica: int) -> int:
    """Consumers with the same key (the same worker position in different
    replicas) pull identical chunks and share one set of serve slots."""
    if workers_per_replica <= 0:
        return consumer_id
    return consumer_id % workers_per_replica


class RdtRouter:
    """Which producer serves which consumer each name; pure and deterministic.

    ``owner_sets`` lists distinct sets of producer indices; ``name_owner_class``
    gives, per name (parallel to ``names``), the index of its set. Both empty
    means every producer holds every name. Within a replica of
    ``workers_per_replica`` consumers, the consumers of each name are spread over
    its owners, and the choice rotates from group to group so that one producer
    is not the first stop of every consumer.
    """

    def __init__(
        self,
        num_producers: int,
        num_consumers: int,
        owner_sets: Sequence[Sequence[int]] | None = None,
        name_owner_class: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        group_lens: Sequence[int] | None = None,
        workers_per_replica: int = 0,
    ) -> None:
        if num_producers < 1:
            raise ValueError(f"num_producers is {num_producers}; need at least 1")
        if num_consumers < 1:
            raise ValueError(f"num_consumers is {num_consumers}; need at least 1")
        self.num_producers = num_producers
        self.num_consumers = num_consumers
        names = list(names or [])
        sets = [tuple(s) for s in (owner_sets or [])]
        classes = list(name_owner_class or [])
        if bool(sets) != bool(classes):
            raise ValueError(
                "owner_sets and name_owner_class must both be given or both empty"
            )
        if classes and len(classes) != len(names):
            raise ValueError(
                f"name_owner_class has {len(classes)} entries but names has "
                f"{len(names)}"
            )
        for i, owners in enumerate(sets):
            if not owners or any(not 0 <= o < num_producers for o in owners):
                raise ValueError(
                    f"owner_sets[{i}] = {list(owners)} must be a non-empty list of "
                    f"producer indices below {num_producers}"
                )
        for i, cls in enumerate(classes):
            if not 0 <= cls < len(sets):
                raise ValueError(
                    f"name_owner_class[{i}] = {cls} ({names[i]!r}) is not an index "
                    f"into owner_sets ({len(sets)} sets)"
                )
        if group_lens and sum(group_lens) != len(names):
            raise ValueError(
                f"group_lens sum to {sum(group_lens)} but there are {len(names)} names"
            )
        self._group_of: dict[str, int] = {}
        self._group_names: list[list[str]] = []
        start = 0
        for gi, n in enumerate(group_lens or []):
            self._group_names.append(names[start : start + n])
            self._group_of.update((name, gi) for name in names[start : start + n])
            start += n
        self._everyone = tuple(range(num_producers))
        self._owners = {
            name: tuple(sorted(sets[c]))
            for name, c in zip(names, classes, strict=False)
        }
        block = workers_per_replica or num_consumers
        if num_consumers % min(block, num_consumers):
            raise ValueError(
                f"workers_per_replica={workers_per_replica} does not divide "
                f"num_consumers={num_consumers}"
            )
        self.block_consumers = min(block, num_consumers)

    def owners(self, name: str) -> tuple[int, ...]:
        return self._owners.get(name, self._everyone)

    def group_owners(self, group: int) -> tuple[int, ...]:
        """Every producer that holds part of gather group ``group``."""
        if not self._group_names:
            return self._everyone
        return tuple(
            sorted({o for n in self._group_names[group] for o in self.owners(n)})
        )

    def producer_for(
        self, consumer_id: int, name: str, group: int | None = None
    ) -> int:
        """The producer that serves ``name`` (of gather group ``group``, looked
        up from ``group_lens`` when not given) to ``consumer_id``."""
        if group is None:
            if name not in self._group_of:
                raise KeyError(
                    f"{name!r} is not among the router's names; pass its group"
                )
            group = self._group_of[name]
        owners = self.owners(name)
        local = consumer_id % self.block_consumers
        picks = assign_producer_indices(len(owners), self.block_consumers, local)
        return owners[picks[group % len(picks)]]
