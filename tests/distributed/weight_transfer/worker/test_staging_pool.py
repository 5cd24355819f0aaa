# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The staging pool (``staging_pool``): a worker's staged updates reuse the
last committed update's staging buffers, never one a served tensor uses, and
a failed update frees them all. Alone, and through the ipc worker engine on
a small torch model."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.worker import staged as staged_module
from vllm.distributed.weight_transfer.worker.staged import (
    StagedUpdate,
    StagingDoesNotFit,
)
from vllm.distributed.weight_transfer.worker.staging_pool import (
    StagingPool,
    buffer_kind,
)

from ..ipc.worker_rig import EngineClient, NoReload, TinyNet, planned_ready, state
from .test_staged import (
    FailsAtMessage,
    assert_state,
    staged_engine,
    trainer_for,
)

CPU = torch.device("cpu")
ROW = buffer_kind((4,), torch.float32, CPU, False)
MATRIX = buffer_kind((2, 3), torch.float32, CPU, False)


def test_the_next_update_takes_the_last_ones_buffers_in_order():
    pool = StagingPool()
    assert pool.take(ROW) is None
    first, second = pool.allocate(ROW), pool.allocate(ROW)
    pool.end_update(served=[])
    assert pool.reserved_bytes == 2 * 16
    assert pool.take(ROW) is first and pool.take(ROW) is second
    assert pool.take(ROW) is None
    assert pool.take(MATRIX) is None  # another shape is never handed out
    assert pool.reuses == 2


def test_buffers_the_update_did_not_take_are_freed_at_its_end():
    pool = StagingPool()
    pool.allocate(ROW)
    pool.allocate(MATRIX)
    pool.end_update(served=[])
    kept = pool.take(ROW)
    pool.end_update(served=[])  # the matrix was not taken
    assert pool.reserved_bytes == 16
    assert pool.take(MATRIX) is None and pool.take(ROW) is kept


def test_a_buffer_a_served_tensor_uses_is_never_handed_out_again():
    pool = StagingPool()
    kept_by_a_loader = pool.allocate(ROW)
    copied = pool.allocate(ROW)
    served = torch.nn.Parameter(kept_by_a_loader[1:])  # a view of it serves
    pool.end_update(served=[served])
    assert pool.take(ROW) is copied
    assert pool.take(ROW) is None


def test_a_buffer_something_else_still_views_is_never_handed_out_again():
    pool = StagingPool()
    viewed = pool.allocate(MATRIX)
    free = pool.allocate(MATRIX)
    handle = {"weight": viewed.t()}  # a kernel handle that kept a view
    pool.end_update(served=[])
    assert pool.take(MATRIX) is free
    assert pool.take(MATRIX) is None
    assert handle["weight"].shape == (3, 2)


def test_drop_frees_every_buffer_kept_or_taken():
    pool = StagingPool()
    pool.allocate(ROW)
    pool.end_update(served=[])
    pool.take(ROW)
    pool.allocate(MATRIX)
    pool.drop()
    assert pool.reserved_bytes == 0 and pool.take(ROW) is None


def staged_bytes_ptrs(engine) -> set[int]:
    pool = engine.staging_pool
    return {b.data_ptr() for q in pool._reusable.values() for b in q}


def test_every_sync_after_the_first_stages_into_the_same_memory():
    """Planned landing with host staging: the second and third syncs stage
    into the first one's buffers, commit exactly, and no served tensor ever
    shares memory with staging; a failed sync frees the pool and the next
    one is exact."""
    target = planned_ready(0)
    engine = staged_engine(target, landing="planned")
    served = {p.data_ptr() for p in target.parameters()}
    buffers: set[int] | None = None
    for seed in (1, 2, 3):
        trainer = TinyNet(seed)
        with NoReload():
            trainer_for(EngineClient(engine), trainer).send_weights()
        assert_state(target, state(trainer))
        now = staged_bytes_ptrs(engine)
        assert now and not now & served
        assert buffers is None or now == buffers
        buffers = now
    assert buffers is not None
    assert engine.staging_pool.reuses >= 2 * len(buffers)
    assert {p.data_ptr() for p in target.parameters()} == served

    trainer = TinyNet(4)
    before = state(target)
    with pytest.raises(RuntimeError, match="injected"):
        trainer_for(FailsAtMessage(engine, 2), trainer).send_weights()
    assert_state(target, before)
    assert engine.staging_pool.reserved_bytes == 0
    assert engine.fence_status["state"] != "fenced"
    with NoReload():
        trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))


def test_a_staged_tensor_a_loader_keeps_is_not_reused():
    """A landing that makes a served parameter use the staged tensor itself
    (instead of copying it) takes that buffer out of the pool: the next
    update stages elsewhere and the served weight is left alone."""
    model = TinyNet(0)
    pool = StagingPool()

    def commit(value: float) -> torch.Tensor:
        session = StagedUpdate(model, None, where="host", model_device=CPU, pool=pool)
        session.start()
        staged = session.stage(torch.full((6, 4), value))

        def adopt(_session) -> None:
            model.a.weight.data = staged

        session._lands.append(adopt)  # what an adopting loader would do
        session._prepared = True
        session.finish()
        return staged

    first = commit(1.0)
    assert model.a.weight.data_ptr() == first.data_ptr()
    second = commit(2.0)
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(model.a.weight, torch.full((6, 4), 2.0))


def test_kept_buffers_count_as_free_and_go_when_staging_would_not_fit(monkeypatch):
    """Staging the size of the kept buffers fits with no other memory free;
    an update needing more first lets the kept buffers go, then is refused
    against what is free."""
    model = TinyNet(0)
    pool = StagingPool()
    pool.allocate(buffer_kind((256,), torch.float32, CPU, False))
    pool.end_update(served=[])
    monkeypatch.setattr(staged_module, "free_bytes", lambda device: 0)
    session = StagedUpdate(model, None, where="host", model_device=CPU, pool=pool)
    session.start()
    session.expect(1024, "an update the kept buffers cover")
    assert pool.reserved_bytes == 1024
    with pytest.raises(StagingDoesNotFit):
        session.expect(2048, "an update larger than them")
    assert pool.reserved_bytes == 0


def test_a_tensor_no_kept_buffer_fits_does_not_count_them_as_free(monkeypatch):
    """A tensor of a new shape needs memory of its own: with too little free,
    the kept buffers (of another shape) are let go first, and the tensor is
    staged against what that frees."""
    model = TinyNet(0)
    pool = StagingPool()
    pool.allocate(buffer_kind((256,), torch.float32, CPU, False))
    pool.end_update(served=[])
    free = {"bytes": 0}
    monkeypatch.setattr(staged_module, "free_bytes", lambda device: free["bytes"])
    session = StagedUpdate(model, None, where="host", model_device=CPU, pool=pool)
    session.start()
    with pytest.raises(StagingDoesNotFit):
        session.stage(torch.ones(8), "a tensor of a new shape")
    assert pool.reserved_bytes == 0  # the kept buffer was let go first
    free["bytes"] = 10_000
    assert torch.equal(session.stage(torch.ones(8)), torch.ones(8))
