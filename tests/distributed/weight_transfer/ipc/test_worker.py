# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc worker engine and its layerwise session on a small torch model (no
vLLM engine): weights land in the update target (the draft model too), a
failure restores every layer that did not complete, buffered weights never
alias the transfer buffer, and nothing is mapped after finish. A failure after
a weight landed fences the engine until a full resync, and an aborted update
closes quietly. Refused messages are in ``test_worker_refusals.py``, the
planned landing in ``test_worker_planned.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.buffers.handles import cpu_device_key
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.landing.layerwise import LayerwiseReloadSession
from vllm.distributed.weight_transfer.verification import (
    WeightsFencedError,
)

from .worker_rig import (
    EngineClient,
    TinyNet,
    make_engine,
    push,
    reload_ready,
    state,
)


@pytest.mark.parametrize(
    ("packed", "keep"),
    [(True, None), (True, False), (False, None)],
    ids=["packed-kept", "packed-freed", "unpacked"],
)
def test_update_lands_every_weight_and_releases_every_mapping(packed, keep):
    """Every mapping is released at the finish, except that of a packed
    buffer the trainer keeps for the next sync (the CPU default), which is
    the same memory then and stays mapped."""
    target, trainer = reload_ready(0), TinyNet(1)
    engine = make_engine(target)
    sender = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=packed,
            packed_buffer_size_bytes=64,
            keep_packed_buffer=keep,
        ),
        client=EngineClient(engine),
        source=ModuleSource(trainer),
    )
    sender.send_weights()
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    kept = sender._kept_buffer
    mapped = [] if engine._importer is None else engine._importer.kept()
    if packed and keep is None:
        assert kept is not None and kept.handle.persistent
        assert mapped == [kept.handle]
    else:
        assert kept is None and mapped == []
    assert engine.last_update_keys == {cpu_device_key(0)}
    sender.shutdown()


def test_packing_parameters_that_require_grad_records_no_autograd_history():
    """A trainer's parameters require grad; packing them must not record
    autograd history on the packed buffer (with it, each copy into a view
    of the buffer extends one graph, and a sync's cost grows with the square
    of the tensor count)."""
    target = reload_ready(0)
    engine = make_engine(target)
    model = TinyNet(1)
    assert all(p.requires_grad for p in model.parameters())
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, keep_packed_buffer=True),
        client=EngineClient(engine),
        source=ModuleSource(model),
    )
    trainer.send_weights()
    # The typed views of the buffer the trainer packs into, kept between
    # syncs: none carries a graph.
    views = [v for chunk in trainer._views.values() for v in chunk.values()]
    assert views and all(v.grad_fn is None and not v.requires_grad for v in views)
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    trainer.shutdown()


def test_the_kept_buffer_views_are_made_once_and_dropped_with_the_buffer():
    """The trainer makes the typed views of each chunk's slots in the buffer
    it keeps at the first sync and packs through the same views after an
    in-place change; they go with the buffer."""
    target, trainer = reload_ready(0), TinyNet(1)
    engine = make_engine(target)
    sender = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64),
        client=EngineClient(engine),
        source=ModuleSource(trainer),
    )
    sender.send_weights()
    made = {i: dict(views) for i, views in sender._views.items()}
    assert sender.last_plan is not None
    assert len(made) == len(sender.last_plan.chunks) and all(made.values())
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1).add_(0.25)
    sender.send_weights()
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    for index, views in made.items():
        for offset, view in views.items():
            assert sender._views[index][offset] is view
    sender.shutdown()
    assert sender._views == {} and sender._kept_buffer is None


def test_draft_target_receives_the_update_and_the_default_model_does_not():
    default, draft, trainer = reload_ready(0), reload_ready(2), TinyNet(1)
    before = state(default)
    engine = make_engine(default)
    engine.set_weight_update_target(draft, SimpleNamespace(dtype=None))
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=EngineClient(engine),
        source=ModuleSource(trainer),
    ).send_weights()
    engine.reset_weight_update_target()
    for name, want in state(trainer).items():
        assert torch.equal(dict(draft.named_parameters())[name], want), name
    for name, want in before.items():
        assert torch.equal(dict(default.named_parameters())[name], want), name


def test_a_failed_update_before_any_weight_leaves_the_model_untouched():
    target = reload_ready(0)
    before = state(target)
    engine = make_engine(target)
    engine.start_weight_update()
    # nothing is moved aside until weights arrive
    assert not dict(target.named_parameters())["a.weight"].is_meta
    with pytest.raises(ValueError, match="ipc_handles is missing"):
        engine.update_weights(
            {"names": ["a.weight", "a.bias"], "dtype_names": ["float32"], "shapes": []}
        )
    for name, want in before.items():
        param = dict(target.named_parameters())[name]
        assert not param.is_meta and torch.equal(param, want), name
    # a new update can start afterwards
    engine.start_weight_update()
    engine.finish_weight_update()
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_abort_restores_layers_that_did_not_complete():
    target = reload_ready(0)
    before = state(target)
    session = LayerwiseReloadSession(target, SimpleNamespace(dtype=None))
    session.start()
    session.load([("a.weight", torch.ones_like(before["a.weight"]))])
    assert dict(target.named_parameters())["a.weight"].is_meta  # a lacks its bias
    session.abort("test")
    for name, want in before.items():
        param = dict(target.named_parameters())[name]
        assert not param.is_meta and torch.equal(param, want), name


def test_abort_message_restores_and_finish_is_then_a_no_op():
    target = reload_ready(0)
    before = state(target)
    engine = make_engine(target)
    engine.start_weight_update()
    engine.update_weights({"abort": "trainer rank 1 died"})
    engine.finish_weight_update()
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_buffered_weights_of_incomplete_layers_are_copied_out_of_the_buffer():
    target = reload_ready(0)
    session = LayerwiseReloadSession(target, SimpleNamespace(dtype=None))
    session.start()
    buffer = torch.arange(24, dtype=torch.float32)
    weight = buffer.view(6, 4)  # layer a gets only its weight: stays buffered
    session.load(
        [("a.weight", weight)], foreign_storages={buffer.untyped_storage().data_ptr()}
    )
    buffer.zero_()  # the sender reuses its buffer
    session.load([("a.bias", torch.ones(6))])
    session.finish()
    assert torch.equal(
        target.a.weight, torch.arange(24, dtype=torch.float32).view(6, 4)
    )
    assert torch.equal(target.a.bias, torch.ones(6))


class FailingLoad:
    """Makes the session's ``load`` raise on call number ``n`` (from 1)."""

    def __init__(self, engine: IPCWeightTransferEngine, n: int) -> None:
        self.engine, self.n, self.calls = engine, n, 0
        self.original = LayerwiseReloadSession.load

    def __enter__(self):
        def load(session, *args, **kwargs):
            self.calls += 1
            if self.calls == self.n:
                raise RuntimeError("injected load failure")
            return self.original(session, *args, **kwargs)

        LayerwiseReloadSession.load = load  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc):
        LayerwiseReloadSession.load = self.original  # type: ignore[method-assign]


def test_a_failure_after_a_weight_landed_fences_until_a_full_resync():
    target, trainer = reload_ready(0), TinyNet(1)
    engine = make_engine(target)
    with FailingLoad(engine, 2), pytest.raises(RuntimeError, match="injected"):
        push(engine, trainer)
    status = engine.fence_status
    assert status["state"] == "fenced" and "injected" in status["reason"]
    with pytest.raises(WeightsFencedError, match="full resync is required"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(WeightsFencedError, match="full resync is required"):
        engine.finish_weight_update()
    push(engine, trainer)  # the resync
    assert engine.fence_status["state"] == "committed"
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_an_abort_after_a_weight_landed_fences_and_finish_closes_quietly():
    target, trainer = reload_ready(0), TinyNet(1)
    engine = make_engine(target)
    push(engine, TinyNet(2))
    engine.start_weight_update()
    engine._landed = True  # as after a landed chunk
    engine.pub.touch()
    engine.update_weights({"abort": "trainer rank 1 died"})
    engine.finish_weight_update()  # closes the aborted update without raising
    assert engine.fence_status["state"] == "fenced"
    push(engine, trainer)
    assert engine.fence_status["state"] == "committed"
