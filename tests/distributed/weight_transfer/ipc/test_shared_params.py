# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU trainer whose parameters live in shared memory
(``shared_params.SharedParameters``): ``ipc`` sends them without packing, the
worker reads the trainer's own bytes and keeps the segment mapped across
updates, and a parameter the trainer re-allocated is packed as before, never
read stale. On the ipc worker engine with a small torch model (no vLLM
engine); the planned landing makes it one copy per byte. At the end, the
CUDA bookkeeping (a kept mapping, fresh exports) with torch's import faked."""

from __future__ import annotations

import contextlib
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SharedParameters,
    shared_place,
)
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from .test_worker import (
    EngineClient,
    TinyNet,
    make_engine,
    planned_ready,
    reload_ready,
    state,
)


def trainer_for(engine, model, **kwargs):
    kwargs.setdefault("packed_buffer_size_bytes", 64)
    return IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, **kwargs),
        client=EngineClient(engine),
        source=ModuleSource(model),
    )


def kept_segments(engine) -> list:
    importer = engine._importer
    return [] if importer is None else importer.kept()


def segment_name(shared: SharedParameters) -> str:
    assert shared.shm_name is not None
    return shared.shm_name


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
@pytest.mark.parametrize("landing", ["reload", "planned"])
def test_parameters_in_shared_memory_are_sent_without_packing(landing, checksums):
    target = planned_ready(0) if landing == "planned" else reload_ready(0)
    engine = make_engine(target, landing=landing)
    model = TinyNet(1)
    shared = SharedParameters.place(model)
    trainer = trainer_for(engine, model, verify_checksums=checksums)
    trainer.send_weights()
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert trainer._kept_buffer is None, "nothing was packed"
    kept = kept_segments(engine)
    assert [h.name for h in kept] == [segment_name(shared)]
    # An optimizer step writes in place, into the segment; the next sync reads
    # it through the mapping kept from the first.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2).add_(0.5)
    trainer.send_weights()
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert kept_segments(engine) == kept
    assert engine._importer is not None
    assert engine._importer.mappings_opened == 1, "the mapping is reused"
    assert engine.fence_status["state"] == "committed"
    shared.close()


class RecordingClient(EngineClient):
    """Also records the names each update message carries."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.messages: list[list[str]] = []

    def update_weights(self, update_info):
        if "names" in update_info:
            self.messages.append(list(update_info["names"]))
        super().update_weights(update_info)


def test_chunks_in_one_segment_travel_as_one_message_landed_by_one_program():
    """The chunk cap (64 bytes here: one tensor per chunk) bounds a packed
    buffer; nothing is packed from a segment, so its chunks go to the
    workers as one message. The worker parses that message's layout once
    and binds its planned landing once (``chunk_programs``); the second sync
    reuses both."""
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    model = TinyNet(1)
    shared = SharedParameters.place(model)
    client = RecordingClient(engine)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64),
        client=client,
        source=ModuleSource(model),
    )
    trainer.send_weights()
    names = list(state(model))
    assert trainer.last_plan is not None and len(trainer.last_plan.chunks) > 1
    assert client.messages == [names]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3).sub_(1)
    trainer.send_weights()
    assert client.messages == [names, names]
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    programs = engine.chunk_programs
    assert programs is not None and programs.binds == 1 and len(programs) == 1
    assert programs.names_bound() == len(names)
    assert engine.layouts.reused == 1
    shared.close()


class ShortFormClient(RecordingClient):
    """Also records each message's form: "full" (names, with the layout id
    when it carries one) or "short" (only a layout id and the handles, or
    the id alone over several segments); ``handles`` records whether each
    message carried handles."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.forms: list[tuple[str, str | None]] = []
        self.handles: list[bool] = []

    def update_weights(self, update_info):
        # (Not the receipts' prepare message; over several segments the
        # short form carries no handles.)
        if "ipc_handles" in update_info or "layout" in update_info:
            form = "full" if "names" in update_info else "short"
            self.forms.append((form, update_info.get("layout")))
            self.handles.append("ipc_handles" in update_info)
        super().update_weights(update_info)


# ``max_segment_bytes`` for TinyNet's parameters (128, 64, 128 and 64 bytes
# as placed): all in one segment, or in two of 192 bytes.
ONE_SEGMENT = 1 << 20
TWO_SEGMENTS = 192


@contextlib.contextmanager
def pinned_rig(
    max_segment_bytes: int = ONE_SEGMENT, staging: str | None = None, **kwargs
):
    """A planned worker engine over ``planned_ready(0)`` (``target``), a
    trainer ``model`` placed in shared memory (``shared``, closed at exit;
    ``max_segment_bytes`` goes to ``place``) and its ``trainer`` sending
    with ``shared.source(model)`` through a ``ShortFormClient``
    (``client``); ``kwargs`` go to the trainer's init. ``staging``: the
    engine stages updates there (``WeightTransferConfig.staging``)."""
    target = planned_ready(0)
    config: dict[str, Any] = {}
    if staging is not None:
        config = {"staging": staging, "update_timeout_s": 60.0}
    engine = make_engine(target, landing="planned", **config)
    model = TinyNet(1)
    shared = SharedParameters.place(model, max_segment_bytes=max_segment_bytes)
    client = ShortFormClient(engine)
    kwargs.setdefault("packed_buffer_size_bytes", 64)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, **kwargs),
        client=client,
        source=shared.source(model),
    )
    try:
        yield SimpleNamespace(
            target=target,
            engine=engine,
            model=model,
            shared=shared,
            trainer=trainer,
            client=client,
        )
    finally:
        shared.close()


def step(model, scale: float = 3.0) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale).sub_(1)


def assert_served(target, model) -> None:
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


@pytest.mark.parametrize(
    "max_segment_bytes", [ONE_SEGMENT, TWO_SEGMENTS], ids=["one", "two_segments"]
)
@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
def test_a_source_that_knows_nothing_moved_resends_its_layout_by_id(
    checksums, max_segment_bytes
):
    """``SharedParameters.source``: the first sync sends the whole layout
    once, with an id; while every parameter stays where it was, each later
    sync sends only that id and the handles, walks no tensor, and the worker
    reuses the parsed layout and the bound program. The same over two
    segments: one message names both, each mapped once, and the short form
    names no handles."""
    with pinned_rig(max_segment_bytes, verify_checksums=checksums) as rig:
        rig.trainer.send_weights()
        assert_served(rig.target, rig.model)
        ((form, layout),) = rig.client.forms
        assert form == "full" and layout is not None
        reads = []
        for scale in (3.0, -0.5):
            step(rig.model, scale)
            rig.trainer.send_weights()
            assert_served(rig.target, rig.model)
            reads.append(rig.engine._last_reads)
        assert rig.client.forms[1:] == [("short", layout), ("short", layout)]
        engine = rig.engine
        # The short form without handles reads the kept mappings as the
        # sync before did, selecting and checking no handle again.
        assert reads[0] is not None
        assert (reads[1] is reads[0]) == (max_segment_bytes == TWO_SEGMENTS)
        assert engine.layouts.compact == 2
        programs = engine.chunk_programs
        assert programs is not None and programs.binds == 1
        assert engine._importer is not None
        segments = rig.shared.num_segments
        assert segments == (1 if max_segment_bytes == ONE_SEGMENT else 2)
        assert engine._importer.mappings_opened == segments
        # Over several segments the short form names no handles.
        assert rig.client.handles == [True] + [segments == 1] * 2
        assert engine.fence_status["state"] == "committed"


def test_parameters_are_placed_in_segments_of_at_most_the_size_asked():
    """Each segment is filled before the next is allocated, and a parameter
    larger than the limit gets one of its own; offsets run end to end
    across the segments, and every parameter is found where it was put."""
    model = TinyNet(1)
    before = state(model)
    shared = SharedParameters.place(model, max_segment_bytes=128)
    try:
        # a.weight (128 B as placed) | a.bias (64) | b.weight (128) | b.bias (64)
        assert shared.num_segments == 4
        assert len(set(shared.shm_names)) == 4 and shared.shm_name is None
        assert shared.offsets == {
            "a.weight": 0,
            "a.bias": 128,
            "b.weight": 192,
            "b.bias": 320,
        }
        for name, p in model.named_parameters():
            assert shared.locate(p) == shared.offsets[name], name
            assert torch.equal(p, before[name]), name
        part = shared.message_part([(128, 24), (192, 72), (320, 12)])
        assert part.segments == (1, 2, 3) and part.indexes == [0, 1, 2]
        assert part.offsets == [0, 0, 0]
        assert part.spans == ((0, 24), (0, 72), (0, 12))
        with pytest.raises(ValueError, match="segment_handle"):
            _ = shared.handle
    finally:
        shared.close()
    with pytest.raises(ValueError, match="at least 64"):
        SharedParameters.place(TinyNet(1), max_segment_bytes=8)


def test_a_parameter_moved_out_of_one_of_several_segments_is_packed_alone():
    """With the parameters in two segments, a re-allocated one is packed
    and the others, in both segments, still go unpacked around it."""
    with pinned_rig(TWO_SEGMENTS) as rig:
        trainer, model = rig.trainer, rig.model
        trainer.send_weights()
        model.b.weight.data = model.b.weight.data.clone() - 1
        step(model)
        trainer.send_weights()
        assert_served(rig.target, model)
        assert trainer._kept_buffer is not None, "the moved parameter was packed"
        assert rig.client.messages[-3:] == [
            ["a.weight", "a.bias"],
            ["b.weight"],
            ["b.bias"],
        ]
        assert rig.engine.fence_status["state"] == "committed"


def test_a_worker_that_let_go_of_the_segments_refuses_a_short_form_without_handles():
    """Over several segments the short form names no handles: the worker
    reads the exports the layout's message named, which it must still map.
    A worker that released them (another trainer's update read other
    buffers) refuses the message before anything lands, never mapping an
    old export again; what it served stays, unfenced, and the trainer's
    next sync is whole."""
    with pinned_rig(TWO_SEGMENTS) as rig:
        trainer, client, model, target = rig.trainer, rig.client, rig.model, rig.target
        trainer.send_weights()
        other = TinyNet(2)  # packed into a buffer that trainer keeps
        packing = trainer_for(rig.engine, other)
        packing.send_weights()
        assert kept_segments(rig.engine) == [packing._kept_buffer.handle]
        step(model)
        with pytest.raises(Exception, match="no longer maps every buffer"):
            trainer.send_weights()
        assert_served(target, other)
        assert rig.engine.fence_status["state"] != "fenced"
        trainer.send_weights()
        assert_served(target, model)
        assert [form for form, _ in client.forms] == ["full", "short", "full"]
        packing.shutdown()


def test_adopting_is_for_cuda_parameters_only():
    with pytest.raises(ValueError, match="adopt shares CUDA parameters in place"):
        SharedParameters.adopt(TinyNet(1))


def test_adopted_storages_follow_a_reallocated_parameter():
    """``adopt``'s bookkeeping (run here on CPU tensors, which no worker
    could map; test_ipc_cuda.py syncs it on a GPU): each parameter storage is
    a segment where it lies, nothing copied; the source adopts the new
    storage of a re-allocated or replaced parameter when it next looks, lets
    go of the storage nothing lies in any more, and keeps every other
    segment and offset as they were."""
    model = TinyNet(1)
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    shared = SharedParameters._of_storages(model, torch.device("cpu"))
    try:
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
        assert shared.num_segments == 4
        before = dict(shared.offsets)
        source = shared.source(model)
        assert source.pinned() is not None
        old = model.a.weight.data
        model.a.weight.data = old.clone() + 1
        model.b.bias = torch.nn.Parameter(model.b.bias.detach() * 2)
        assert source.pinned() is None
        assert shared.moved() == ["a.weight"]  # (b.bias: a new object)
        source.metadata()  # looks again: adopts both new storages
        assert shared.moved() == [] and shared.num_segments == 4
        for name, p in model.named_parameters():
            assert shared.locate(p) == shared.offsets[name], name
        assert shared.offsets["a.bias"] == before["a.bias"]
        assert shared.offsets["b.weight"] == before["b.weight"]
        assert shared.offsets["a.weight"] > max(before.values())
        assert shared.locate(old) is None, "the old storage was let go"
        with pytest.raises(ValueError, match="was let go"):
            shared.segment_bytes(0)
        assert source.pinned() is not None
        # A placed buffer is never adopted anew: its moved parameters pack.
        placed_model = TinyNet(2)
        placed = SharedParameters.place(placed_model)
        placed_model.a.weight.data = placed_model.a.weight.data.clone()
        assert placed.readopt(placed_model.named_parameters()) == []
        assert placed.moved() == ["a.weight"]
        placed.close()
    finally:
        shared.close()


class _Flat(torch.nn.Module):
    """Parameters in the order w1, an empty one, w2, w3; each its own
    storage unless built over one flat tensor."""

    def __init__(self, flat: torch.Tensor | None = None) -> None:
        super().__init__()
        parts = flat.split(16) if flat is not None else torch.randn(48).split(16)
        self.w1 = torch.nn.Parameter(parts[0] if flat is not None else parts[0].clone())
        self.e = torch.nn.Parameter(torch.empty(0))
        self.w2 = torch.nn.Parameter(parts[1] if flat is not None else parts[1].clone())
        self.w3 = torch.nn.Parameter(parts[2] if flat is not None else parts[2].clone())


def _message_part(shared: SharedParameters, model: torch.nn.Module):
    """What the trainer's send makes of ``model``'s tensors over ``shared``:
    an empty tensor at the end of the one before it, the order checked per
    segment."""
    from vllm.distributed.weight_transfer.ipc.shared_params import SegmentOrder

    order, found = SegmentOrder(shared), []
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        offset = shared.locate(p) if nbytes else order.last_end
        assert offset is not None and order.fits(offset, nbytes), name
        order.add(offset, nbytes)
        found.append((offset, nbytes))
    return shared.message_part(found)


def test_an_empty_tensor_at_a_segments_end_stays_in_that_segment():
    """An empty parameter after one that ends its segment belongs to that
    segment, not to the next: once the next was let go (its parameter
    re-allocated), every sync would otherwise name a released segment."""
    model = _Flat()
    shared = SharedParameters._of_storages(model, torch.device("cpu"))
    source = shared.source(model)
    try:
        assert _message_part(shared, model).segments == (0, 1, 2)
        model.w2.data = model.w2.data.clone()  # segment 1 is let go
        source.metadata()
        assert shared._segments is not None and shared._segments[1] is None
        part = _message_part(shared, model)
        assert part.segments == (0, 2, 3)
        assert part.indexes is not None and part.indexes[1] == 0  # the empty one
        assert len(part.payloads()) == 3
    finally:
        shared.close()


def test_readopt_keeps_the_place_of_every_parameter_current():
    """Parameters re-created over one new storage: the first is adopted anew
    and the others are found in its segment; each one's recorded offset is
    where it lies now, and nothing keeps the old storage's segment."""
    model = _Flat(torch.randn(48))
    shared = SharedParameters._of_storages(model, torch.device("cpu"))
    source = shared.source(model)
    try:
        assert shared.num_segments == 1
        fresh = _Flat(torch.randn(48))
        for name in ("w1", "w2", "w3"):
            setattr(model, name, getattr(fresh, name))
        source.metadata()
        assert shared.num_segments == 1
        for name, p in model.named_parameters():
            if p.numel():
                assert shared._params[name] is p, name
                assert shared.offsets[name] == shared.locate(p), name
        assert shared._segments is not None and shared._segments[0] is None
        # ``handle`` is the one live segment's (exports faked: CPU tensors).
        shared.segment_handle = lambda i: ("export of", i)  # type: ignore[method-assign, assignment, return-value]
        assert shared.handle == ("export of", 1)
    finally:
        shared.close()


def test_a_storage_resized_in_place_is_let_go_before_anything_is_read():
    """An adopted storage freed and re-allocated in place (FSDP2 frees its
    unsharded storages between steps): its segment refuses to be sent until
    the source looks again, which lets it go and adopts the new memory."""
    model = _Flat()
    shared = SharedParameters._of_storages(model, torch.device("cpu"))
    source = shared.source(model)
    try:
        storage = model.w2.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        with pytest.raises(ValueError, match="resized or freed in place"):
            shared.segment_bytes(1)
        storage.resize_(nbytes)
        assert source.pinned() is None
        source.metadata()
        assert shared._segments is not None and shared._segments[1] is None
        assert shared.locate(model.w2) == shared.offsets["w2"]
        assert shared.segment_at(shared.offsets["w2"]) == 3
        assert source.pinned() is not None
    finally:
        shared.close()


def _reallocate(model):
    model.a.weight.data = model.a.weight.data.clone() + 3


def _replace(model):
    model.a.weight = torch.nn.Parameter(model.a.weight.detach() + 3)


def _shrink_in_place(model):
    # Same address and dtype; fewer elements: the shape the sync must send
    # changed, so the metadata is looked at again (the engine refuses it).
    model.b.bias.data = model.b.bias.data[:2]


@pytest.mark.parametrize("meanwhile", [True, False], ids=["check_meanwhile", "first"])
@pytest.mark.parametrize("change", [_reallocate, _replace], ids=lambda f: f.__name__)
def test_a_parameter_moved_or_replaced_ends_the_short_form(change, meanwhile):
    """Whatever moved a parameter (a new allocation, a new Parameter object
    on the module) is seen: the sync goes the full way, the moved tensor
    packed, and lands exactly; the stale bytes are never committed. Checked
    first, the short form is not even sent. Checked while the short form
    lands (``check_while_landing``, after a sync in which nothing had
    moved), that update is aborted and the same ``send_weights`` goes again
    in full: it returns with the new weights served, nothing left fenced."""
    with pinned_rig(check_while_landing=meanwhile) as rig:
        trainer, model = rig.trainer, rig.model
        trainer.send_weights()
        step(model)
        trainer.send_weights()
        change(model)
        step(model, -2.0)
        trainer.send_weights()
        assert_served(rig.target, model)
        forms = [form for form, _ in rig.client.forms]
        # (The full way is two messages: the moved tensor packed, then the
        # others from the segment.)
        if meanwhile:
            assert forms == ["full", "short", "short", "full", "full"]
            assert trainer.checked_while_landing == 1
        else:
            assert forms == ["full", "short", "full", "full"]
            assert trainer.checked_while_landing == 0
        assert rig.engine.fence_status["state"] == "committed"
        # The whole sync's publication, verified, is the one committed.
        committed = rig.engine.fence_status["model_version"]
        assert committed == trainer.last_publication.header.model_version
        assert trainer._kept_buffer is not None, "the moved parameter was packed"
        # The moved parameter stays out of the placed buffer, so the source
        # never says nothing moved again: later syncs check first, go full.
        for _ in range(2):
            step(model)
            trainer.send_weights()
            assert_served(rig.target, model)
        assert trainer.checked_while_landing == int(meanwhile)


def test_a_move_found_while_landing_a_staged_update_fences_nothing():
    """With staging the short form lands in the worker's staging: the abort
    drops it, so nothing serving was touched and nothing is fenced at any
    point; the sync then goes whole and commits."""
    with pinned_rig(staging="host") as rig:
        trainer, model, engine = rig.trainer, rig.model, rig.engine
        trainer.send_weights()
        step(model)
        trainer.send_weights()
        assert trainer.checked_while_landing == 1
        _reallocate(model)
        step(model, -2.0)
        states: list[str] = []
        finish = rig.client.finish_weight_update

        def watched_finish(weight_version=None):
            states.append(engine.fence_status["state"])
            finish(weight_version)

        rig.client.finish_weight_update = watched_finish
        trainer.send_weights()
        assert_served(rig.target, model)
        assert [form for form, _ in rig.client.forms][2:] == ["short", "full", "full"]
        # The aborted update's finish and the whole sync's: never fenced.
        assert "fenced" not in states and len(states) == 2, states
        assert engine.fence_status["state"] == "committed"


@pytest.mark.parametrize("moved", [True, False], ids=["moved", "nothing_moved"])
def test_a_short_message_that_fails_while_checked_meanwhile(moved):
    """The short message fails while the check runs. If a parameter moved,
    the failure is the move's doing (a segment resized in place is refused
    before its handle is read): the same ``send_weights`` goes again whole.
    If nothing moved, the failure is the sync's: it raises, the old weights
    serve unfenced, and the next sync goes whole."""
    with pinned_rig() as rig:
        trainer, model = rig.trainer, rig.model
        trainer.send_weights()
        step(model)
        trainer.send_weights()
        served = state(rig.target)
        if moved:
            _reallocate(model)
        step(model)
        send = trainer._send_whole_message

        def refused(whole):
            trainer._send_whole_message = send
            raise ValueError("segment 0 was resized or freed in place")

        trainer._send_whole_message = refused
        if moved:
            trainer.send_weights()
            assert_served(rig.target, model)
        else:
            with pytest.raises(ValueError, match="resized or freed"):
                trainer.send_weights()
            for name, want in served.items():
                assert torch.equal(dict(rig.target.named_parameters())[name], want)
            assert rig.engine.fence_status["state"] != "fenced"
            trainer.send_weights()
            assert_served(rig.target, model)
            assert rig.client.forms[-1][0] == "full"
        assert rig.engine.fence_status["state"] == "committed"


class _CheckAfterLanding:
    """A pinned source whose check, when made while landing, first waits
    until the client saw the short message land: a check that ran before
    the send would wait out ``timeout_s`` and report it."""

    def __init__(self, source, timeout_s: float = 10.0) -> None:
        self.landed = threading.Event()
        self.waited_for_landing: list[bool] = []
        original = source.pinned

        def pinned(yielding: bool = False):
            if yielding:
                self.waited_for_landing.append(self.landed.wait(timeout_s))
            return original(yielding)

        source.pinned = pinned


def test_the_check_runs_while_the_short_form_lands():
    """After a sync that found nothing moved, the next one sends its short
    form at once and checks the source on a helper thread meanwhile."""
    with pinned_rig() as rig:
        trainer, client = rig.trainer, rig.client
        watch = _CheckAfterLanding(trainer.source)
        forward = client.update_weights

        def update_weights(update_info):
            forward(update_info)
            if "layout" in update_info and "names" not in update_info:
                watch.landed.set()

        client.update_weights = update_weights
        trainer.send_weights()
        assert trainer.checked_while_landing == 0, "nothing known yet"
        step(rig.model)
        trainer.send_weights()
        assert_served(rig.target, rig.model)
        assert watch.waited_for_landing == [True]
        assert trainer.checked_while_landing == 1
        assert [form for form, _ in client.forms] == ["full", "short"]


def test_a_shape_changed_in_place_is_seen_and_refused_with_its_cause():
    with pinned_rig() as rig:
        rig.trainer.send_weights()
        before = state(rig.target)
        _shrink_in_place(rig.model)
        # (This toy engine has no checkpoint shapes; its loader names the shape.)
        with pytest.raises(Exception, match=r"torch.Size\(\[2\]\)"):
            rig.trainer.send_weights()
        assert rig.client.forms[-1][0] == "full", "the new shape was sent, not the id"
        served = dict(rig.target.named_parameters())
        for name, want in before.items():
            assert torch.equal(served[name], want), name


def test_a_worker_without_the_layout_refuses_the_short_form_then_syncs_whole():
    """A worker that no longer holds the layout (a restarted engine, say)
    refuses the short message before anything lands: the old weights serve,
    nothing is fenced, and the trainer's next sync is whole again."""
    with pinned_rig() as rig:
        trainer, client, model, target = rig.trainer, rig.client, rig.model, rig.target
        trainer.send_weights()
        served = state(target)
        rig.engine.layouts._by_layout.clear()
        step(model)
        with pytest.raises(Exception, match="committed no full message with that"):
            trainer.send_weights()
        for name, want in served.items():
            assert torch.equal(dict(target.named_parameters())[name], want), name
        assert rig.engine.fence_status["state"] != "fenced"
        trainer.send_weights()
        assert_served(target, model)
        assert [form for form, _ in client.forms] == ["full", "short", "full"]
        assert client.forms[2][1] != client.forms[0][1], "a new layout id"
        step(model)
        trainer.send_weights()
        assert client.forms[-1] == ("short", client.forms[2][1])
        assert_served(target, model)


class CapturingClient(ShortFormClient):
    """Also keeps the last full message sent with a layout id, as sent
    (``full``), and rewrites each short message with ``tamper`` when set."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.full: dict[str, Any] | None = None
        self.tamper: Any = None

    def update_weights(self, update_info):
        if "names" in update_info and "layout" in update_info:
            self.full = dict(update_info)
        elif "layout" in update_info and self.tamper is not None:
            update_info = self.tamper(dict(update_info))
        super().update_weights(update_info)


def _swapped_layout_from_elsewhere(full: dict[str, Any]) -> dict[str, Any]:
    """The trainer's full message, headerless, under the same layout id with
    a changed layout (a.bias read from the padding after a.weight) and a
    segment that does not exist: refused when the worker maps it."""
    hostile = {k: v for k, v in full.items() if k in FULL_FIELDS}
    names = hostile["names"]
    offsets = list(hostile["offsets"])
    i = names.index("a.bias")
    offsets[i] = offsets[names.index("a.weight")] + 96  # a.weight is 96 bytes
    assert offsets[i] < hostile["offsets"][i], "a real change of layout"
    hostile["offsets"] = offsets
    (key,) = hostile["ipc_handles"]
    handle = dict(hostile["ipc_handles"][key])
    handle["name"] = "vllm-wt-no-such-segment"
    hostile["ipc_handles"] = {key: handle}
    return hostile


FULL_FIELDS = {
    "names",
    "dtype_names",
    "shapes",
    "tensor_sizes",
    "offsets",
    "buffer_indexes",
    "ipc_handles",
    "layout",
}


def _assert_unfenced_serving(rig, served: dict[str, torch.Tensor]) -> None:
    assert rig.engine.fence_status["state"] != "fenced"
    for name, want in served.items():
        assert torch.equal(dict(rig.target.named_parameters())[name], want), name


def test_a_refused_message_under_the_layout_id_changes_no_later_short_form():
    """Two syncs (full with layout id L, then L's short form); a client then
    sends, in an update of its own, the trainer's full message under L with
    another layout and a segment that does not exist: refused, nothing
    landed, not fenced. The trainer's next short form lands exactly the
    trainer's weights: the worker learns a layout only from a message that
    landed in an update that committed."""
    with pinned_rig() as rig:
        client = CapturingClient(rig.engine)
        rig.trainer.client = client
        rig.trainer.send_weights()
        step(rig.model)
        rig.trainer.send_weights()
        assert [form for form, _ in client.forms] == ["full", "short"]
        layout = client.forms[0][1]
        assert client.full is not None
        served = state(rig.target)
        hostile = _swapped_layout_from_elsewhere(client.full)
        engine = rig.engine
        engine.start_weight_update()
        with pytest.raises(Exception, match="vllm-wt-no-such-segment"):
            engine.update_weights(hostile)
        engine.finish_weight_update()
        _assert_unfenced_serving(rig, served)
        step(rig.model, -0.5)
        rig.trainer.send_weights()
        assert client.forms[-1] == ("short", layout)
        assert_served(rig.target, rig.model)
        assert engine.fence_status["state"] == "committed"


def test_a_layout_landed_in_an_update_that_was_aborted_is_not_remembered():
    """Staged, so an abort after landing leaves the engine unfenced: another
    layout sent under the trainer's id over its own segment lands, and the
    update is aborted. The trainer's next short form still lands its own
    layout."""
    with pinned_rig(staging="host") as rig:
        client = CapturingClient(rig.engine)
        rig.trainer.client = client
        rig.trainer.send_weights()
        assert client.full is not None
        served = state(rig.target)
        hostile = _swapped_layout_from_elsewhere(client.full)
        engine = rig.engine
        engine.start_weight_update()
        engine.update_weights({**hostile, "ipc_handles": client.full["ipc_handles"]})
        engine.update_weights({"abort": "the client gives up"})
        engine.finish_weight_update()
        _assert_unfenced_serving(rig, served)
        step(rig.model)
        rig.trainer.send_weights()
        assert client.forms[-1] == ("short", client.forms[0][1])
        assert_served(rig.target, rig.model)


def test_a_short_form_with_another_digest_is_refused_unfenced_then_syncs_whole():
    """A short form whose ``layout_digest`` is not the digest of the layout
    the worker holds under its id is refused before anything lands: the
    old weights serve, nothing is fenced, and the trainer's next sync sends
    the full message again."""
    with pinned_rig() as rig:
        client = CapturingClient(rig.engine)
        rig.trainer.client = client
        rig.trainer.send_weights()
        served = state(rig.target)
        client.tamper = lambda m: {**m, "layout_digest": "0" * 64}
        step(rig.model)
        with pytest.raises(Exception, match="update_info.layout_digest is 0000"):
            rig.trainer.send_weights()
        _assert_unfenced_serving(rig, served)
        client.tamper = None
        rig.trainer.send_weights()
        assert_served(rig.target, rig.model)
        assert [form for form, _ in client.forms] == ["full", "short", "full"]


def test_a_reallocated_parameter_is_packed_never_read_stale():
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    model = TinyNet(1)
    shared = SharedParameters.place(model)
    trainer = trainer_for(engine, model)
    trainer.send_weights()
    # The trainer replaces a parameter's memory; the segment still holds the
    # old values at the old place.
    model.a.weight.data = model.a.weight.data.clone() + 3
    assert shared.moved() == ["a.weight"]
    assert shared_place(model.a.weight) is None
    trainer.send_weights()
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert trainer._kept_buffer is not None, "the moved parameter's chunk was packed"
    # The chunks in the segment before and after the moved parameter's travel
    # as one message each, around the packed one, in the source's order.
    client = RecordingClient(engine)
    trainer.client = client
    trainer.send_weights()
    assert client.messages == [
        ["a.weight"],
        ["a.bias", "b.weight", "b.bias"],
    ], client.messages
    shared.close()


def test_a_closed_segment_is_unlinked_and_its_parameters_still_train():
    model = TinyNet(1)
    before = state(model)
    shared = SharedParameters.place(model)
    path = os.path.join("/dev/shm", segment_name(shared))
    assert os.path.exists(path)
    for name, want in before.items():
        assert torch.equal(dict(model.named_parameters())[name], want), name
    shared.close()
    assert not os.path.exists(path)
    assert shared_place(model.a.weight) is None
    with torch.no_grad():
        model.a.weight.add_(1)  # still valid memory
    assert torch.equal(model.a.weight, before["a.weight"] + 1)


def test_a_worker_drops_a_kept_segment_once_an_update_reads_others():
    target = reload_ready(0)
    engine = make_engine(target)
    model = TinyNet(1)
    shared = SharedParameters.place(model)
    trainer_for(engine, model).send_weights()
    assert len(kept_segments(engine)) == 1
    other = TinyNet(2)  # not shared: packed into a buffer that trainer keeps
    packing = trainer_for(engine, other)
    packing.send_weights()
    assert packing._kept_buffer is not None
    assert kept_segments(engine) == [packing._kept_buffer.handle], (
        "the segment is released; the packed buffer kept for the next sync stays"
    )
    packing.shutdown()
    for name, want in state(other).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    shared.close()


class Reversed(ModuleSource):
    """The module's tensors in the reverse of their order in the segment."""

    def metadata(self):
        return list(reversed(super().metadata()))

    def __iter__(self):
        return iter(reversed(list(super().__iter__())))


def test_tensors_out_of_segment_order_are_packed():
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    model = TinyNet(1)
    shared = SharedParameters.place(model)
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1 << 16),
        client=EngineClient(engine),
        source=Reversed(model),
    ).send_weights()
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    shared.close()


class LayerBFirst(ModuleSource):
    """The module's tensors with layer ``b``'s before layer ``a``'s: out of
    order across two segments, in order within each."""

    def _order(self, items):
        return sorted(items, key=lambda item: not _name(item).startswith("b."))

    def metadata(self):
        return self._order(super().metadata())

    def __iter__(self):
        return iter(self._order(list(super().__iter__())))


def _name(item) -> str:
    return item.name if hasattr(item, "name") else item[0]


def test_segments_may_come_in_any_order_with_their_tensors_in_order_within_each():
    """The wire's order rule holds per buffer: a source that yields the
    second segment's tensors first still sends nothing packed, as one
    message (an adopted parameter re-allocated lands in a segment laid
    after all others, whatever its place in the source)."""
    target = planned_ready(0)
    engine = make_engine(target, landing="planned")
    model = TinyNet(1)
    shared = SharedParameters.place(model, max_segment_bytes=TWO_SEGMENTS)
    client = RecordingClient(engine)
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64),
        client=client,
        source=LayerBFirst(model),
    )
    trainer.send_weights()
    assert_served(target, model)
    assert trainer._kept_buffer is None, "nothing was packed"
    assert client.messages == [["b.weight", "b.bias", "a.weight", "a.bias"]]
    shared.close()


def _with_empty(net):
    """``net`` with an empty parameter between its layers' tensors."""
    net.a.register_parameter(
        "empty", torch.nn.Parameter(torch.empty(0), requires_grad=False)
    )
    return net


def test_an_empty_tensor_between_shared_ones_keeps_the_chunk_unpacked():
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from .test_worker import LoaderNet

    target = _with_empty(LoaderNet(0))
    record_metadata_for_reloading(target)
    engine = make_engine(target)
    model = _with_empty(TinyNet(1))
    assert [n for n, _ in model.named_parameters()][2] == "a.empty"
    shared = SharedParameters.place(model)
    trainer = trainer_for(engine, model, packed_buffer_size_bytes=1 << 16)
    trainer.send_weights()
    for name, want in state(model).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert trainer._kept_buffer is None, "nothing was packed"
    shared.close()


# The CUDA bookkeeping, without a GPU: torch's import is replaced by a fake
# that records each call. (test_ipc_cuda.py runs the real thing on a GPU.)


def _cuda_handle(counter_offset: int, persistent: bool = True):
    import base64

    from vllm.distributed.weight_transfer.buffers.handles import CudaIpcHandle

    b64 = base64.b64encode(b"x" * 64).decode("ascii")
    return CudaIpcHandle(
        nbytes=256,
        device=0,
        storage_handle=b64,
        storage_size_bytes=1024,
        storage_offset_bytes=0,
        tensor_offset=0,
        ref_counter_handle=b64,
        ref_counter_offset=counter_offset,
        event_handle=None,
        event_sync_required=False,
        persistent=persistent,
    )


def test_a_kept_cuda_mapping_hands_each_new_counter_to_torch(monkeypatch):
    """A persistent CUDA buffer is mapped once and kept across ``close``; a
    later message about it with a new reference counter goes through torch's
    import again (which finds its cached mapping and releases that counter);
    the same counter again does not. Non-persistent buffers are released."""
    from vllm.distributed.weight_transfer.buffers import cuda_ipc as cuda_ipc_buffer
    from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
    from vllm.distributed.weight_transfer.buffers.handles import handle_from_dict

    imports: list[int] = []

    def fake_import(handle, device_index):
        imports.append(handle.ref_counter_offset)
        return torch.zeros(handle.nbytes, dtype=torch.uint8)

    monkeypatch.setattr(cuda_ipc_buffer, "import_cuda_bytes", fake_import)
    importer = BufferImporter(torch.device("cuda", 0), local_rank=0)
    first = _cuda_handle(counter_offset=1)
    assert handle_from_dict(first.to_dict(), "h") == first  # the field travels
    assert "persistent" not in _cuda_handle(1, persistent=False).to_dict()

    importer.open(first)
    importer.open(first)  # another chunk of the same message
    importer.open(_cuda_handle(counter_offset=7, persistent=False))
    assert imports == [1, 7] and importer.mappings_opened == 2
    importer.close(keep_persistent=True)
    assert importer.kept() == [first]

    importer.open(_cuda_handle(counter_offset=2))  # the next sync's export
    assert imports == [1, 7, 2] and importer.mappings_opened == 2
    importer.close(keep_persistent=True)
    importer.open(_cuda_handle(counter_offset=2))  # the same export again
    assert imports == [1, 7, 2]
    importer.close()
    assert importer.kept() == []


def test_the_trainer_exports_anew_only_what_workers_did_not_keep():
    """``_SharedInSync``, per segment: a segment the last successful sync
    named keeps its export; any other is exported anew once, at its first
    use, also when other segments of its buffer were kept (workers keep
    mappings per segment)."""
    import weakref

    from vllm.distributed.weight_transfer.ipc.trainer import _SharedInSync

    class Owner:
        def __init__(self) -> None:
            self.exports: list[int | None] = []

        def export_anew(self, index: int | None = None) -> None:
            self.exports.append(index)

    def part(owner: Owner, *segments: int) -> SimpleNamespace:
        return SimpleNamespace(
            owner=owner, segments=segments, segment_set=frozenset(segments)
        )

    kept_one, new_one = Owner(), Owner()
    kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary(
        {kept_one: frozenset({0, 1})}
    )
    sync = _SharedInSync(kept)
    for _ in range(3):  # three chunks name each buffer
        sync.use(part(kept_one, 0, 1))  # type: ignore[arg-type]
        sync.use(part(new_one, 0))  # type: ignore[arg-type]
    assert (kept_one.exports, new_one.exports) == ([], [0])
    assert sync.kept(part(kept_one, 0, 1)) and not sync.kept(part(new_one, 0))  # type: ignore[arg-type]
    # The next sync named only segment 1 of kept_one (segment 0's chunks
    # packed): the workers let go of segment 0, so the sync after that
    # exports it anew and keeps segment 1's export.
    sync = _SharedInSync(weakref.WeakKeyDictionary({kept_one: frozenset({1})}))  # type: ignore[arg-type]
    sync.use(part(kept_one, 0, 1))  # type: ignore[arg-type]
    sync.use(part(kept_one, 0))  # type: ignore[arg-type]
    assert kept_one.exports == [0]
    assert not sync.kept(part(kept_one, 0, 1))  # type: ignore[arg-type]
    assert sync.used[kept_one] == {0, 1}  # type: ignore[index]
