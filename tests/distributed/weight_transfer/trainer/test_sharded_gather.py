# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A trainer whose parameters are DTensors (FSDP2's layout: a 1-D mesh,
dimension 0 in equal shards) packs each one by gathering its shards straight
into the tensor's slot of the packed buffer: one all-gather and no full
tensor per sync. Two gloo ranks on the CPU; rank 0's client drives the
fork's ``ipc`` worker engine over a plain module in its own process."""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from vllm.distributed.weight_transfer.testing.direct_engine import (
    load_through_weight_loaders,
)
from vllm.distributed.weight_transfer.testing.multirank import free_port
from vllm.distributed.weight_transfer.trainer.sharded_gather import gather_full_into

WORLD = 2


class Net(torch.nn.Module):
    """``a``'s rows (6) split evenly over two ranks; ``b``'s (5) do not."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(6, 5)

    def load_weights(self, weights):
        return load_through_weight_loaders(self, weights)


class NoClient:
    def __getattr__(self, name):
        raise AssertionError(f"a non-sender rank called client.{name}")


def _trainer_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )
        from vllm.distributed.weight_transfer.testing.direct_engine import (
            DirectEngineClient,
            direct_ipc_engine,
        )
        from vllm.model_executor.model_loader.reload import (
            record_metadata_for_reloading,
        )

        mesh = init_device_mesh("cpu", (WORLD,))
        full, sharded = Net(1), Net(1)
        for module in (sharded.a, sharded.b):
            for name, p in list(module.named_parameters()):
                shards = distribute_tensor(p.detach(), mesh, [Shard(0)])
                setattr(module, name, torch.nn.Parameter(shards))
        gathers = []
        original = DTensor.full_tensor

        def counted(self, *args, **kwargs):
            gathers.append(tuple(self.shape))
            return original(self, *args, **kwargs)

        DTensor.full_tensor = counted  # type: ignore[method-assign]
        served = Net(0)
        client: object
        if rank == 0:
            record_metadata_for_reloading(served)
            client = DirectEngineClient(direct_ipc_engine(served))
        else:
            client = NoClient()
        trainer = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=rank), client=client, source=ModuleSource(sharded)
        )
        served_equal = []
        for scale in (1.0, -3.0):  # a second sync after an in-place step
            with torch.no_grad():
                for model in (full, sharded):
                    for p in model.parameters():
                        p.mul_(scale).add_(0.5)
            trainer.send_weights()
            if rank == 0:
                got = dict(served.named_parameters())
                served_equal.append(
                    all(torch.equal(got[n], p) for n, p in full.named_parameters())
                )
        trainer.shutdown()
        results.put((rank, None, trainer.gathered_into_slots, gathers, served_equal))
    except BaseException:
        results.put((rank, traceback.format_exc(), 0, [], []))
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_are_gathered_straight_into_their_packed_slots():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_trainer_rank, args=(rank, port, results), daemon=True)
        for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        got = dict((r[0], r[1:]) for r in (results.get(timeout=240) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, (error, in_slots, gathers, served_equal) in sorted(got.items()):
        assert error is None, f"rank {rank}:\n{error}"
        # Per sync: a.weight and a.bias (6 rows, even) gathered in place;
        # b.weight and b.bias (5 rows) through full_tensor() and a copy.
        assert in_slots == 4, (rank, in_slots)
        assert sorted(gathers) == sorted([(5, 6), (5,)] * 2), (rank, gathers)
    assert got[0][3] == [True, True], "the served module equals the trainer's"


def test_a_plain_tensor_is_copied_and_reported_as_not_gathered():
    out = torch.empty(3, 2)
    src = torch.arange(6.0).reshape(3, 2)
    assert gather_full_into(out, src) is False
    assert torch.equal(out, src)


@pytest.mark.parametrize("world", [1])
def test_a_one_rank_mesh_gathers_in_place(world):
    """(A mesh of one rank: the gather is a copy into the slot; no process
    group beyond this one is needed.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=world
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(12.0).reshape(4, 3)
        shards = distribute_tensor(full, mesh, [Shard(0)])
        out = torch.empty(4, 3)
        assert gather_full_into(out, shards) is True
        assert torch.equal(out, full)
        assert gather_full_into(out.t(), shards.t()) is False  # not dim 0: a copy
    finally:
        dist.destroy_process_group()
