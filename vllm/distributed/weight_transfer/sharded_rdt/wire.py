# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sharded_rdt wire: `ShardedRDTWeightTransferInitInfo` (trainer -> every
worker, once) and `ShardedRDTWeightTransferUpdateInfo` (nearly empty: a sync
replays the plan the worker baked at init). Both are JSON-safe dataclasses
checked where they enter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
    dtype_from_name,
)
from vllm.distributed.weight_transfer.pull.routing import (
    DEFAULT_NUM_RDT_BUFFERS,
    DEFAULT_STALL_TIMEOUT_S,
    PRODUCE_METHOD_NAME,
    TRANSPORTS,
)


@dataclass
class ShardedRDTWeightTransferInitInfo(WeightTransferInitInfo):
    """Everything a worker needs to bake its plan and reach the producers.

    Filled by the trainer (`get_worker_init_payload`) except ``replica_rank`` and
    ``num_replicas``, which a driver running several inference engines patches
    per engine. ``transport``, ``producer_endpoints`` and ``stall_timeout_s`` are
    fork fields; their defaults keep an upstream payload valid.
    """

    trainer_actor_names: list[str] = field(default_factory=list)
    trainer_actor_namespace: str | None = None
    produce_method_name: str = PRODUCE_METHOD_NAME
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_lens: list[int] = field(default_factory=list)
    owner_sets: list[list[int]] = field(default_factory=list)
    name_owner_class: list[int] = field(default_factory=list)
    num_consumers: int = 0
    num_rdt_buffers: int = DEFAULT_NUM_RDT_BUFFERS
    buffer_presize_gb: float = 0.0
    replica_rank: int = 0
    num_replicas: int = 1
    transport: str = "auto"
    producer_endpoints: list[dict[str, Any]] = field(default_factory=list)
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    # Host memory (GiB) each worker keeps of the chunk bytes it last landed,
    # for delta syncs (0: every chunk travels whole).
    delta_bases_gb: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        for attr in ("dtype_names", "shapes"):
            if len(getattr(self, attr)) != n:
                raise ValueError(
                    f"init_info.{attr} has {len(getattr(self, attr))} entries but "
                    f"names has {n}"
                )
        for name in self.dtype_names:
            dtype_from_name(name)
        self.shapes = [[int(s) for s in shape] for shape in self.shapes]
        if self.group_lens and sum(self.group_lens) != n:
            raise ValueError(
                f"init_info.group_lens sum to {sum(self.group_lens)} but names has {n}"
            )
        if self.name_owner_class and len(self.name_owner_class) != n:
            raise ValueError(
                f"init_info.name_owner_class has {len(self.name_owner_class)} "
                f"entries but names has {n}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"init_info.transport is {self.transport!r}; expected one of "
                f"{list(TRANSPORTS)}"
            )
        if self.num_rdt_buffers < 1:
            raise ValueError(
                f"init_info.num_rdt_buffers is {self.num_rdt_buffers}; need >= 1"
            )
        if self.stall_timeout_s <= 0:
            raise ValueError(
                f"init_info.stall_timeout_s is {self.stall_timeout_s}; need > 0"
            )
        if (
            isinstance(self.delta_bases_gb, bool)
            or not isinstance(self.delta_bases_gb, (int, float))
            or not 0 <= self.delta_bases_gb < float("inf")
        ):
            raise ValueError(
                f"init_info.delta_bases_gb is {self.delta_bases_gb!r}; need a "
                "finite number >= 0 (0: no deltas)"
            )
        if not 0 <= self.replica_rank < max(1, self.num_replicas):
            raise ValueError(
                f"init_info.replica_rank is {self.replica_rank} but num_replicas "
                f"is {self.num_replicas}"
            )

    @property
    def num_producers(self) -> int:
        return max(len(self.trainer_actor_names), len(self.producer_endpoints))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardedRDTWeightTransferInitInfo:
        check_fields(data, (f.name for f in fields(cls)), (), "sharded_rdt init_info")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ShardedRDTWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Each sync replays the plan baked at init, so nothing is required.
    ``sync_id`` (fork field) names the trainer's sync, letting a worker whose
    producers already failed that sync learn it at its first pull."""

    sync_id: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardedRDTWeightTransferUpdateInfo:
        check_fields(data, (f.name for f in fields(cls)), (), "sharded_rdt update_info")
        sync_id = data.get("sync_id")
        if sync_id is not None:
            # Sync ids count from 1; anything else would make every pull of
            # this update wait for a sync no producer will ever begin.
            check_int(sync_id, "sharded_rdt update_info sync_id", minimum=1)
        return cls(**data)
