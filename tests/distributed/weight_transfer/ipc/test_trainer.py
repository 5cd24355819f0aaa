# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc trainer engine against a loopback worker (no vLLM engine): bytes
arrive intact in both modes, chunks are flushed before the next tensor is
materialized (overlapped or one at a time), the shared-memory buffer is reused
or freed as asked, a source that disagrees with its metadata is rejected
naming the tensor with the server told to abort, and the upstream wire's
limits are kept. The verified-publication steps are in
``test_trainer_verification.py``."""

import os
import time

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.buffers.shm import SHM_DIR
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import (
    is_fenced_version,
)

from .trainer_rig import (
    LoopbackClient,
    RecordingSource,
    model_tensors,
)


def shm_files():
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"vllm-wt-{os.getpid()}-")}


@pytest.mark.parametrize("packed", [True, False])
def test_every_tensor_arrives_bit_exact(packed):
    tensors = model_tensors()
    events: list = []
    client = LoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=300),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights(weight_version="v1")
    assert client.init_info == {"packed": packed}
    assert client.calls[0] == "init" and client.calls[1] == "start"
    # the receipt is verified after prepare, then the commit stamps the version
    assert client.calls[-2:] == ["prepare", "finish:v1"]
    assert client.versions == ["v1"]
    assert engine.last_plan is not None
    assert client.calls.count("update") == len(engine.last_plan.chunks) > 1
    assert list(client.received) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    # a CPU packed buffer is kept for the next sync until shutdown
    assert len(shm_files()) == (1 if packed else 0)
    engine.shutdown()
    assert shm_files() == set()


def test_the_shared_memory_buffer_is_reused_across_syncs_until_shutdown():
    tensors = model_tensors()
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=300),
        client=client,
        source=RecordingSource(tensors, []),
    )
    engine.send_weights()
    kept = shm_files()
    assert len(kept) == 1
    for t in tensors.values():
        t.add_(1)
    engine.send_weights()
    assert shm_files() == kept
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    engine.shutdown()
    assert shm_files() == set()


def test_keep_packed_buffer_false_frees_the_buffer_after_each_sync():
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, keep_packed_buffer=False),
        client=LoopbackClient(),
        source=RecordingSource(model_tensors(), []),
    )
    engine.send_weights()
    assert shm_files() == set()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_a_chunk_is_sent_before_its_buffer_half_is_filled_again(overlap):
    """In turn, each chunk's update call comes before the next tensor is
    materialized. Overlapped, the call runs on a helper thread while the next
    chunk fills the other half, so the order there is only: chunk k's call
    has happened before chunk k+2 (the same half) starts to fill. Either way
    at most the tensor being copied is alive when the next one is asked for."""
    tensors = model_tensors(8)
    events: list = []
    client = LoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=400,
            overlap_chunks=overlap,
        ),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights()
    plan = engine.last_plan
    assert plan is not None
    order = [e[:2] for e in events]
    if not overlap:
        expected: list[tuple] = []
        for chunk in plan.chunks:
            expected += [("materialize", n) for n in chunk.names]
            expected.append(("update", tuple(chunk.names)))
        assert order == expected
    else:
        assert len(plan.chunks) >= 3
        assert sorted(order) == sorted(
            [("materialize", n) for c in plan.chunks for n in c.names]
            + [("update", tuple(c.names)) for c in plan.chunks]
        )
        for k in range(len(plan.chunks) - 2):
            sent = order.index(("update", tuple(plan.chunks[k].names)))
            refill = order.index(("materialize", plan.chunks[k + 2].names[0]))
            assert sent < refill, k
    assert max(e[2] for e in events if e[0] == "materialize") == 0


def test_drop_in_upstream_call_works_through_the_factory():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    client = LoopbackClient()
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(model),
    ).send_weights()
    for name, p in model.named_parameters():
        assert torch.equal(client.received[name], p.detach())
    assert client.calls == ["init", "start", "update", "prepare", "finish"]


def test_trainer_init_needs_a_source():
    with pytest.raises(ValueError, match="needs source="):
        IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=LoopbackClient()
        )


def test_init_info_rejects_bad_sizes():
    with pytest.raises(ValueError, match="packed_buffer_size_bytes must be positive"):
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        IPCTrainerInitInfo(rank=0, timeout_s=0)


def _bad_sources(tensors):
    names = list(tensors)
    items = list(tensors.items())
    t0 = tensors[names[0]]
    return {
        "name": (
            None,
            [("wrong.name", t0)] + items[1:],
            r"yielded 'wrong.name' where metadata\(\) announced 'layers.0.weight'",
        ),
        "order": (
            None,
            [items[1], items[0]] + items[2:],
            "yielded 'layers.1.weight' where metadata.. announced 'layers.0.weight'",
        ),
        "shape": (
            {names[0]: ParamMeta(names[0], t0.dtype, (4, 8))},
            None,
            r"'layers.0.weight' with shape \[8, 4\] but metadata\(\) says \[4, 8\]",
        ),
        "dtype": (
            {names[0]: ParamMeta(names[0], torch.float16, tuple(t0.shape))},
            None,
            r"'layers.0.weight' as float32 but metadata\(\) says float16",
        ),
        "too_few": (None, items[:-1], "stopped before 'norm.weight'"),
        "too_many": (None, items + [("extra", t0)], "yielded 'extra' after the"),
    }


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
    "case", ["name", "order", "shape", "dtype", "too_few", "too_many"]
)
def test_source_disagreeing_with_metadata_is_rejected_and_aborted(case, packed):
    tensors = model_tensors(3)
    meta_override, yield_override, match = _bad_sources(tensors)[case]
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed),
        client=client,
        source=RecordingSource(tensors, [], meta_override, yield_override),
    )
    with pytest.raises(ValueError, match=match):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()


def test_server_failure_is_raised_and_the_update_aborted():
    class FailingClient(LoopbackClient):
        def update_weights(self, update_info):
            if "abort" in update_info:
                return super().update_weights(update_info)
            raise RuntimeError("worker said no")

    client = FailingClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=client,
        source=RecordingSource(model_tensors(2), []),
    )
    with pytest.raises(RuntimeError, match="worker said no"):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()
    assert len(client.versions) == 1 and is_fenced_version(client.versions[0])
    assert "worker said no" in client.versions[0]


def test_resident_parameters_are_packed_with_a_fused_copy_bit_exact():
    """Parameters (and views of them) cost no memory to hold, so a chunk's copies
    from them are batched; the bytes still arrive exactly, across chunks and
    mixed dtypes, and a second send sees in-place changes."""
    module = torch.nn.Module()
    for name, t in model_tensors().items():
        module.register_parameter(
            name.replace(".", "_"), torch.nn.Parameter(t, requires_grad=False)
        )
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=300),
        client=client,
        source=ModuleSource(module),
    )
    for step in range(2):
        engine.send_weights()
        assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
        for name, p in module.named_parameters():
            assert torch.equal(client.received[name], p.detach()), (step, name)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-2)


class SlowLoopbackClient(LoopbackClient):
    """A loopback whose updates take a while and record when they run, and
    whether two calls ever overlapped. With ``await_materialized``, update
    ``k`` waits (up to 10 s) until the source has materialized more than
    ``await_materialized * k`` tensors (when fewer than ``total_tensors``) and
    records whether that happened."""

    def __init__(
        self, events, fail_on_update=None, await_materialized=None, total_tensors=0
    ):
        super().__init__(events)
        self.total_tensors = total_tensors
        self.active = 0
        self.max_active = 0
        self.fail_on_update = fail_on_update
        self.updates = 0
        self.await_materialized = await_materialized
        self.saw_next_chunk: list[bool] = []

    def _materialized(self):
        return sum(1 for e in list(self.events) if e[0] == "materialize")

    def update_weights(self, update_info):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if "abort" not in update_info:
                self.updates += 1
                self.events.append(("update-begin", self.updates))
                time.sleep(0.05)
                target = (self.await_materialized or 0) * self.updates
                if self.await_materialized and target < self.total_tensors:
                    deadline = time.monotonic() + 10.0
                    while (
                        self._materialized() <= target and time.monotonic() < deadline
                    ):
                        time.sleep(0.01)
                    self.saw_next_chunk.append(self._materialized() > target)
                if self.updates == self.fail_on_update:
                    raise RuntimeError(f"update {self.updates} failed")
            super().update_weights(update_info)
            if "abort" not in update_info:
                self.events.append(("update-end", self.updates))
        finally:
            self.active -= 1


def small_tensors(n=12):
    gen = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(16, 4, generator=gen) for i in range(n)}  # 256 B


def test_overlap_packs_the_next_chunk_while_the_last_one_loads():
    tensors = small_tensors()
    events: list = []
    # two tensors per chunk: update k waits for chunk k + 1's first tensor
    client = SlowLoopbackClient(events, await_materialized=2, total_tensors=12)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights()
    plan = engine.last_plan
    assert plan is not None and plan.overlapped and len(plan.chunks) == 6
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    assert client.max_active == 1  # never two update calls at once
    # while update k ran, the trainer materialized chunk k + 1
    assert client.saw_next_chunk == [True] * 5
    assert len(shm_files()) == 1  # the buffer is kept for the next sync
    engine.shutdown()
    assert shm_files() == set()


def test_overlap_off_sends_one_chunk_at_a_time():
    events: list = []
    client = SlowLoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024, overlap_chunks=False),
        client=client,
        source=RecordingSource(small_tensors(), events),
    )
    engine.send_weights()
    assert engine.last_plan is not None and not engine.last_plan.overlapped
    for k in range(1, client.updates + 1):
        begin = events.index(("update-begin", k))
        end = events.index(("update-end", k))
        assert not any(e[0] == "materialize" for e in events[begin:end])
    engine.shutdown()


def test_a_failing_update_in_flight_is_raised_and_aborted_after_it_returns():
    events: list = []
    client = SlowLoopbackClient(events, fail_on_update=2)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024),
        client=client,
        source=RecordingSource(small_tensors(), events),
    )
    with pytest.raises(RuntimeError, match="update 2 failed"):
        engine.send_weights()
    assert client.max_active == 1
    assert client.updates == 2  # nothing sent after the failure
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()  # a failed sync drops the kept buffers
    assert is_fenced_version(client.versions[-1])


def test_upstream_wire_refuses_cpu_tensors_and_aborts():
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, wire="upstream"),
        client=client,
        source=RecordingSource(model_tensors(), []),
    )
    assert not engine.verify_publication  # upstream's worker has no receipts
    with pytest.raises(ValueError, match="wire='upstream' sends CUDA IPC handles"):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    engine.shutdown()


def test_upstream_wire_plans_tensors_back_to_back_one_chunk_at_a_time():
    source = RecordingSource(model_tensors(), [])  # float32 and bfloat16, odd sizes
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(),
        source=source,
        wire="upstream",
        packed_buffer_size_bytes=300,
    )
    plan = engine._plan_for(list(source.metadata()))
    assert plan.packed and not plan.overlapped and len(plan.chunks) > 1
    for fields, chunk in zip(engine._chunk_fields, plan.chunks, strict=True):
        # no field upstream 0.32's IPCWeightTransferUpdateInfo lacks
        assert set(fields) == {"names", "dtype_names", "shapes", "tensor_sizes"}
        assert chunk.slots[0].offset == 0
        ends = [s.offset + s.nbytes for s in chunk.slots]
        assert [s.offset for s in chunk.slots[1:]] == ends[:-1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"wire": "grpc"}, "wire must be 'fork' or 'upstream'"),
        ({"wire": "upstream", "verify_checksums": True}, "needs wire='fork'"),
    ],
)
def test_init_info_rejects_a_bad_wire(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IPCTrainerInitInfo(rank=0, **kwargs)


def test_engine_options_live_in_one_init_info():
    source = RecordingSource(model_tensors(), [])
    # upstream's keyword arguments
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(), source=source, packed=False
    )
    assert engine.init_info == IPCTrainerInitInfo(rank=0, packed=False)
    assert not engine.packed
    # keywords override the fields of a given init info
    base = IPCTrainerInitInfo(rank=2, overlap_chunks=False, timeout_s=5.0)
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(),
        source=source,
        is_sender=False,
        init_info=base,
        packed_buffer_size_bytes=1024,
    )
    assert engine.init_info == IPCTrainerInitInfo(
        rank=2, overlap_chunks=False, timeout_s=5.0, packed_buffer_size_bytes=1024
    )
    assert engine.rank == 2
    with pytest.raises(TypeError):
        IPCTrainerWeightTransferEngine(
            client=LoopbackClient(), source=source, no_such_option=1
        )
