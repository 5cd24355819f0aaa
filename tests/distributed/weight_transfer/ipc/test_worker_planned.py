# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc worker engine's planned landing on a small torch model (no vLLM
engine): weights are copied without the layerwise reload where the loaders can
be planned and reloaded where they cannot, a failure after a planned landing
(or a wrong byte read back with checksums) fences until a full resync, served
tensors given new storage are planned again, and a forward pass or an idle
deadline during the landing fences."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from .worker_rig import (
    EngineClient,
    LoaderNet,
    NoReload,
    TinyNet,
    make_engine,
    planned_ready,
    push,
    state,
)


@pytest.mark.parametrize("packed", [True, False])
def test_planned_landing_copies_every_weight_without_the_reload(packed):
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    with NoReload():
        for seed in (1, 2):
            trainer = TinyNet(seed)
            push(engine, trainer, packed=packed)
            for name, want in state(trainer).items():
                assert torch.equal(dict(target.named_parameters())[name], want), name
            if seed == 1:
                plan = engine.landing_plan
    assert engine.landing_plan is plan, "the plan is baked once per trainer layout"
    assert plan is not None and plan.direct_names == {
        "a.weight",
        "a.bias",
        "b.weight",
        "b.bias",
    }
    assert engine.fence_status["state"] == "committed"


class RewritingNet(LoaderNet):
    """Its weight loaders write the parameter again after the copy (as a
    loader that post-processes in place would): no plan can replay that."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)

        def rewriting_loader(param, loaded):
            param.data.copy_(loaded)
            param.data.add_(0.0)

        for param in self.parameters():
            param.weight_loader = rewriting_loader  # type: ignore[attr-defined]


def test_planned_landing_reloads_when_the_loaders_cannot_be_planned():
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    target, trainer = RewritingNet(0), TinyNet(1)
    record_metadata_for_reloading(target)
    engine = make_engine(target, landing="planned")
    for _ in range(2):
        push(engine, trainer)
        for name, want in state(trainer).items():
            assert torch.equal(dict(target.named_parameters())[name], want), name
    assert engine.landing_plan is None
    assert "not a slice of a checkpoint tensor" in (engine.landing_refused or "")


@pytest.mark.parametrize(
    "keep", [False, None], ids=["per-tensor-landing", "bound-over-kept-buffer"]
)
def test_a_failure_after_a_planned_landing_fences_until_a_full_resync(keep):
    """A planned landing that fails part-way fences: tensor by tensor
    (a packed buffer freed after each sync), and as the chunks' programs
    bound over the packed buffer the trainer keeps (the CPU default)."""
    from vllm.distributed.weight_transfer.ipc.chunk_programs import BoundChunk
    from vllm.distributed.weight_transfer.landing.planned import LandingPlan

    target, trainer = planned_ready(0), TinyNet(1)
    engine = make_engine(target, landing="planned")
    owner, attr = (LandingPlan, "land") if keep is False else (BoundChunk, "__call__")
    original, calls = getattr(owner, attr), []
    fail_at = 3 if keep is False else 2

    def failing(*args):
        calls.append(args)
        if len(calls) == fail_at:
            raise RuntimeError("injected landing failure")
        original(*args)

    setattr(owner, attr, failing)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            push(engine, trainer, keep_packed_buffer=keep)
    finally:
        setattr(owner, attr, original)
    assert len(calls) == fail_at
    status = engine.fence_status
    assert status["state"] == "fenced" and "injected" in status["reason"]
    push(engine, trainer, keep_packed_buffer=keep)  # the resync
    assert engine.fence_status["state"] == "committed"
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


@pytest.mark.parametrize(
    "keep", [False, None], ids=["per-tensor-landing", "bound-over-kept-buffer"]
)
def test_with_checksums_a_planned_landing_is_read_back_and_a_wrong_byte_fences(keep):
    """With payload checksums on, the worker reads the planned landing back:
    a served region that does not hold the trainer's slice (here: one byte
    flipped after the landing wrote it, as a wrong copy table would) fails
    the update naming the tensor, and fences; without the flip the same
    syncs pass the check."""
    from vllm.distributed.weight_transfer.ipc.chunk_programs import BoundChunk
    from vllm.distributed.weight_transfer.landing.planned import LandingPlan

    target, trainer = planned_ready(0), TinyNet(1)
    engine = make_engine(target, landing="planned")
    checked = dict(verify_checksums=True, keep_packed_buffer=keep)
    for seed in (1, 2):  # the check passes on a right landing
        trainer = TinyNet(seed)
        push(engine, trainer, **checked)
        assert engine.fence_status["state"] == "committed"
    owner, attr = (LandingPlan, "land") if keep is False else (BoundChunk, "__call__")
    original = getattr(owner, attr)

    def flipping(*args):
        original(*args)
        with torch.no_grad():
            target.b.weight.view(-1)[0:1].view(torch.int32).add_(1)

    setattr(owner, attr, flipping)
    try:
        with pytest.raises(Exception, match="planned landing wrote bytes that differ"):
            push(engine, TinyNet(3), **checked)
    finally:
        setattr(owner, attr, original)
    status = engine.fence_status
    assert status["state"] == "fenced" and "b.weight" in status["reason"]
    push(engine, trainer, **checked)  # the resync
    assert engine.fence_status["state"] == "committed"
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def _send_acting_midway(engine, trainer, act) -> None:
    """Sync ``trainer`` into ``engine`` in small chunks, running ``act()``
    once the first chunks have landed (before the fourth tensor is read)."""

    class ActsMidway(WeightSource):
        def metadata(self):
            return ModuleSource(trainer).metadata()

        def __iter__(self):
            for i, item in enumerate(ModuleSource(trainer)):
                if i == 3:
                    act()
                yield item

    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64),
        client=EngineClient(engine),
        source=ActsMidway(),
    ).send_weights()


@pytest.mark.parametrize("keep", [False, None], ids=["per-tensor", "bound-kept"])
def test_served_tensors_given_new_storage_are_planned_again_not_written_stale(keep):
    """The served parameters keep their objects but get new storages
    (``Module._apply``, as ``.to()`` or an offload and restore does): the
    next planned sync plans again and writes the new memory; it never
    writes the old storage through views (or a copy program) cut from it,
    which the read-back would have agreed with."""
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    checked = dict(verify_checksums=True, keep_packed_buffer=keep)
    push(engine, TinyNet(1), **checked)
    push(engine, TinyNet(2), **checked)
    first = engine.landing_plan
    target._apply(lambda t: t.clone())
    assert first is not None and not first.still_bound()
    trainer = TinyNet(3)
    push(engine, trainer, **checked)
    assert engine.fence_status["state"] == "committed"
    assert engine.landing_plan is not first
    served = dict(target.named_parameters())
    for name, want in state(trainer).items():
        assert torch.equal(served[name], want), name


def test_a_forward_pass_during_a_planned_landing_fences():
    """Bytes copied straight into served tensors cannot be put back: a
    forward pass while the update is open fences the engine, naming why."""
    target, trainer = planned_ready(0), TinyNet(1)
    engine = make_engine(target, landing="planned")

    def forward() -> None:
        with pytest.raises(NotImplementedError):
            target(torch.zeros(4))  # TinyNet has no forward

    with pytest.raises(Exception, match="forward pass"):
        _send_acting_midway(engine, trainer, forward)
    status = engine.fence_status
    assert status["state"] == "fenced" and "forward pass" in status["reason"]
    push(engine, trainer)
    assert engine.fence_status["state"] == "committed"


def test_a_planned_update_idle_past_its_deadline_fences_naming_it():
    """Bytes copied straight into served tensors, then a trainer that stalls:
    the next call is past ``update_timeout_s``, the update is aborted and the
    engine fenced with the deadline as the reason; a full sync recovers."""
    import time

    target, trainer = planned_ready(0), TinyNet(1)
    engine = make_engine(target, landing="planned", update_timeout_s=0.2)

    with pytest.raises(Exception, match="update_timeout_s=0.2"):
        _send_acting_midway(engine, trainer, lambda: time.sleep(0.5))
    status = engine.fence_status
    assert status["state"] == "fenced" and "update_timeout_s" in status["reason"]
    push(engine, trainer)
    assert engine.fence_status["state"] == "committed"
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
