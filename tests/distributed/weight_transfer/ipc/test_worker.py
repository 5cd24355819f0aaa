# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc worker engine and its layerwise session on a small torch model (no
vLLM engine): weights land in the update target (the draft model too), a
failure restores every layer that did not complete, buffered weights never
alias the transfer buffer, and nothing is mapped after finish. Verified
publication on the engine: a manifest the served checkpoint contradicts is
rejected before anything loads, a failure after a weight landed fences the
engine until a full resync, and an aborted update closes quietly."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.buffers.handles import cpu_device_key
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.landing.completeness import IncompleteUpdateError
from vllm.distributed.weight_transfer.landing.layerwise import LayerwiseReloadSession
from vllm.distributed.weight_transfer.testing.direct_engine import (
    DirectEngineClient,
    direct_ipc_engine,
    load_through_weight_loaders,
)
from vllm.distributed.weight_transfer.verification import (
    ManifestMismatch,
    WeightsFencedError,
)


class TinyNet(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor)
        return set(params)


def reload_ready(seed: int) -> TinyNet:
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    net = TinyNet(seed)
    record_metadata_for_reloading(net)
    return net


# The worker engine over a plain module, and the client that drives it.
make_engine = direct_ipc_engine
EngineClient = DirectEngineClient


def state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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


def push(engine: IPCWeightTransferEngine, model: torch.nn.Module, **kwargs) -> None:
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64, **kwargs),
        client=EngineClient(engine),
        source=ModuleSource(model),
    ).send_weights()


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


def test_manifest_contradicting_the_checkpoint_is_rejected_before_loading(tmp_path):
    from safetensors.torch import save_file

    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    checkpoint = {n: p.detach().clone() for n, p in TinyNet(0).named_parameters()}
    checkpoint["b.weight"] = torch.zeros(3, 7)  # the served model differs here
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    engine = make_engine(target, checkpoint=str(tmp_path))
    with pytest.raises(
        ManifestMismatch, match=r"b.weight \[3, 6\] \(served model: \[3, 7\]\)"
    ):
        push(engine, trainer)
    assert engine.fence_status["state"] == "idle"  # nothing landed
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_an_integer_dtype_declared_for_a_float_parameter_is_rejected():
    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    trainer.b.bias = torch.nn.Parameter(
        trainer.b.bias.detach().view(torch.int32), requires_grad=False
    )  # the float bytes, declared int32
    engine = make_engine(target)  # no checkpoint: checks the module's parameters
    with pytest.raises(
        ManifestMismatch, match=r"b.bias as int32 \(served model: float"
    ):
        push(engine, trainer)
    assert engine.fence_status["state"] == "idle"  # nothing landed
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


class Only(WeightSource):
    """The tensors of ``model`` named in ``names``, as a partial update."""

    def __init__(self, model: torch.nn.Module, names: set[str]) -> None:
        self.inner, self.names = ModuleSource(model), names

    def metadata(self):
        return [m for m in self.inner.metadata() if m.name in self.names]

    def __iter__(self):
        return ((n, t) for n, t in self.inner if n in self.names)


def test_a_dtype_changed_after_good_syncs_is_still_refused():
    """The worker skips the manifest's and the message's dtype checks only
    for the very layout that passed them; a later sync declaring another
    dtype is checked and refused."""
    target, trainer = reload_ready(0), TinyNet(1)
    engine = make_engine(target)
    push(engine, trainer)
    push(engine, trainer)
    before = state(target)
    trainer.b.bias = torch.nn.Parameter(
        trainer.b.bias.detach().view(torch.int32), requires_grad=False
    )
    with pytest.raises(
        ManifestMismatch, match=r"b.bias as int32 \(served model: float"
    ):
        push(engine, trainer)
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_a_layer_updated_without_all_its_parameters_is_refused_not_committed():
    """A linear layer's bias alone (its weight absent) would be rebuilt with the
    weight's memory uninitialized; the update is refused at finish and the
    layer keeps its weights."""
    target = reload_ready(0)
    before = state(target)
    engine = make_engine(target)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=EngineClient(engine),
        source=Only(TinyNet(0), {"b.bias"}),  # the values it already holds
    )
    with pytest.raises(IncompleteUpdateError, match="it lacks b.weight"):
        trainer.send_weights()
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert "b.weight" in engine.fence_status["reason"]
    # a whole layer alone is fine, and it resyncs the engine
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=EngineClient(engine),
        source=ModuleSource(TinyNet(1)),
    )
    trainer.send_weights()
    assert engine.fence_status["state"] == "committed"


def _raw_update(engine, tensors: dict[str, torch.Tensor], dtype_names=None):
    """One headerless packed update of ``tensors`` through shared memory."""
    from vllm.distributed.weight_transfer.buffers.shm import SharedMemoryBuffer

    flat = [
        t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()
    ]
    sizes = [f.numel() for f in flat]
    buf = SharedMemoryBuffer(sum(sizes))
    assert buf.tensor is not None
    offsets = [0, *itertools.accumulate(sizes)][: len(sizes)]
    for f, off in zip(flat, offsets, strict=True):
        buf.tensor[off : off + f.numel()].copy_(f)
    message = {
        "names": list(tensors),
        "dtype_names": dtype_names
        or [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "ipc_handles": {
            cpu_device_key(0): {"kind": "shm", "name": buf.name, "nbytes": buf.nbytes}
        },
        "tensor_sizes": sizes,
        "offsets": offsets,
    }
    try:
        engine.update_weights(message)
    finally:
        buf.close()


def test_float_bytes_declared_int32_without_a_header_are_refused():
    target = reload_ready(0)
    before = state(target)
    engine = make_engine(target)
    engine.init_transfer_engine(engine.parse_init_info({"packed": True}))
    engine.start_weight_update()
    bias = TinyNet(1).b.bias.detach()
    with pytest.raises(ValueError, match=r"b.bias as int32 \(served model: float"):
        _raw_update(engine, {"b.bias": bias.view(torch.int32)})
    engine.finish_weight_update()
    assert engine.fence_status["state"] != "fenced"  # nothing landed
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_a_name_sent_again_in_a_later_message_is_refused():
    target = reload_ready(0)
    engine = make_engine(target)
    engine.init_transfer_engine(engine.parse_init_info({"packed": True}))
    engine.start_weight_update()
    new = TinyNet(1)
    _raw_update(engine, {"a.weight": new.a.weight})
    with pytest.raises(ValueError, match="'a.weight' more than once"):
        _raw_update(engine, {"a.weight": new.a.weight, "a.bias": new.a.bias})
    assert engine.fence_status["state"] == "fenced"  # a.weight had landed
    engine.update_weights({"abort": "test"})
    engine.finish_weight_update()


def test_a_malformed_abort_after_a_weight_landed_still_closes_the_update():
    target = reload_ready(0)
    engine = make_engine(target)
    engine.init_transfer_engine(engine.parse_init_info({"packed": True}))
    engine.start_weight_update()
    _raw_update(engine, {"a.weight": TinyNet(1).a.weight})
    with pytest.raises(ValueError, match="abort"):
        engine.update_weights({"abort": "x", "names": []})
    status = engine.fence_status
    assert status["state"] == "fenced" and "malformed abort" in status["reason"]
    engine.finish_weight_update()  # closes the aborted update quietly
    assert engine._session is None
    push(engine, TinyNet(1))  # a full resync recovers
    assert engine.fence_status["state"] == "committed"


class LoaderNet(TinyNet):
    """``TinyNet`` whose loading goes through weight loaders, as a vLLM
    model's does, so the planner can record it."""

    def load_weights(self, weights):
        return load_through_weight_loaders(self, weights)


def planned_ready(seed: int) -> LoaderNet:
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    net = LoaderNet(seed)
    record_metadata_for_reloading(net)
    return net


class NoReload:
    """Makes any use of the layerwise reload fail the test."""

    def __enter__(self):
        self.original = LayerwiseReloadSession.begin_landing

        def begin_landing(session):
            raise AssertionError("the layerwise reload was used")

        LayerwiseReloadSession.begin_landing = begin_landing  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        LayerwiseReloadSession.begin_landing = self.original  # type: ignore[method-assign]


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
