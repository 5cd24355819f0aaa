# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sharded_rdt worker's consumer plan: which transport it pulls over, what
it pulls (the plan baked from its loaders, routed and cut into chunks), and
how many bytes of each tensor that is. Pure: nothing here connects or
allocates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.landing.checkpoint_structure import (
    check_manifest_dtypes,
    checkpoint_dtype_kinds,
    module_dtype_kinds,
)
from vllm.distributed.weight_transfer.landing.codes import CodesLanding
from vllm.distributed.weight_transfer.plan.bake import bake_worker_plan
from vllm.distributed.weight_transfer.plan.ops import dtype_from_name, dtype_name
from vllm.distributed.weight_transfer.plan.worker_plan import (
    WorkerPlan,
    with_direct_copies,
)
from vllm.distributed.weight_transfer.pull.chunks import PullPlan, build_pull_plan
from vllm.distributed.weight_transfer.pull.registry import (
    ConsumerSettings,
    make_consumer,
    resolve_consumer_transport,
)
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.pull.transport import ConsumerTransport
from vllm.distributed.weight_transfer.sharded_rdt.lander import deferred_modules
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.verification import Manifest


def choose_transport(info: ShardedRDTWeightTransferInitInfo, executor: Any) -> str:
    """The transport a worker uses: the init info's, or for "auto" RDT under
    vLLM's Ray executor when the trainer spawned Ray producers, else NIXL
    (`pull.registry.resolve_consumer_transport` states the whole rule)."""
    return resolve_consumer_transport(
        info.transport,
        executor=executor,
        actor_names=info.trainer_actor_names,
        endpoints=info.producer_endpoints,
    )


def make_consumer_transport(
    name: str, info: ShardedRDTWeightTransferInitInfo, consumer_id: int
) -> ConsumerTransport:
    """The consumer side of the transport registered as ``name``."""
    return make_consumer(
        name,
        ConsumerSettings(
            consumer_id,
            info.stall_timeout_s,
            namespace=info.trainer_actor_namespace,
            produce_method_name=info.produce_method_name,
        ),
    )


def planned_bytes(pulls: PullPlan) -> dict[str, int]:
    """Bytes this worker receives of each checkpoint tensor per sync (slices
    of zero bytes are never sent, so they do not count)."""
    out: dict[str, int] = {}
    for chunk in pulls.chunks:
        for packed in chunk.slices:
            if packed.spec.nbytes:
                source = packed.spec.source
                out[source] = out.get(source, 0) + packed.spec.nbytes
    return out


@dataclass
class ConsumerPlan:
    """This worker's consumer id, the trainer's tensors, the plan baked from
    the loaders, that plan with the codes' direct copies (what is pulled),
    the pull plan and the landing of trainer-side FP8 codes (None without
    codes)."""

    consumer_id: int
    metas: list[ParamMeta]
    baked: WorkerPlan
    pulled: WorkerPlan
    pulls: PullPlan
    codes: CodesLanding | None


def plan_consumer(
    init_info: ShardedRDTWeightTransferInitInfo,
    *,
    model: torch.nn.Module,
    model_config: Any,
    parallel: Any,
    vllm_config: VllmConfig,
    device: torch.device,
) -> ConsumerPlan:
    """Plan what this worker pulls into ``model`` as one of ``parallel``'s
    ranks; touches nothing but the plan's own recording."""
    num_consumers = init_info.num_consumers or parallel.world_size_across_dp
    num_replicas = max(1, init_info.num_replicas)
    workers_per_replica = max(1, num_consumers // num_replicas)
    local_index = (
        getattr(parallel, "data_parallel_index", 0) * parallel.world_size
        + parallel.rank
    )
    consumer_id = init_info.replica_rank * workers_per_replica + local_index
    metas = [
        ParamMeta(name, dtype_from_name(d), tuple(shape))
        for name, d, shape in zip(
            init_info.names, init_info.dtype_names, init_info.shapes, strict=True
        )
    ]
    worker = f"consumer {consumer_id}"
    # Trainer-side FP8 codes land straight in the served codes; refused
    # here, naming each layer, when this engine cannot take them.
    codes = CodesLanding.plan(
        model,
        [(m.name, dtype_name(m.dtype), tuple(m.shape)) for m in metas],
        worker=worker,
        vllm_config=vllm_config,
    )
    loaded = [m for m in metas if codes is None or m.name not in codes.names]
    # A dtype of another kind than the served tensor's (float bytes
    # declared int32) would be planned as a cast: refuse it here.
    kinds = checkpoint_dtype_kinds(model_config)
    if kinds is None:
        kinds = module_dtype_kinds(model)
    check_manifest_dtypes(
        Manifest.from_params(loaded), kinds, "(init_weight_transfer_engine)"
    )
    plan = bake_worker_plan(
        model,
        loaded,
        worker=worker,
        vllm_config=vllm_config,
        device=device,
    )
    deferred = deferred_modules(model, plan)
    if deferred:
        raise NotImplementedError(
            f"sharded_rdt cannot land weights of attention layers whose "
            f"processing is deferred to the end of a reload: {deferred[:3]}"
        )
    pulled = plan
    if codes is not None:
        pulled = with_direct_copies(
            plan,
            init_info.names,
            [c for c, _ in codes.slice_copies(model)],
        )
    router = RdtRouter(
        init_info.num_producers,
        num_consumers,
        owner_sets=init_info.owner_sets,
        name_owner_class=init_info.name_owner_class,
        names=init_info.names,
        group_lens=init_info.group_lens,
        workers_per_replica=workers_per_replica if num_replicas > 1 else 0,
    )
    pulls = build_pull_plan(pulled, router, consumer_id)
    return ConsumerPlan(consumer_id, metas, plan, pulled, pulls, codes)
