# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The short form of a shared-parameter update: a pinned source that knows
nothing moved sends its layout by id, and the worker engine lands it only
while that layout still holds. A moved, replaced or reshaped parameter ends
the short form; a worker without the layout, or given another digest, refuses
it unfenced and the next sync goes whole; a refused or aborted update leaves
no layout behind (no vLLM engine)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from .shared_params_rig import (
    ONE_SEGMENT,
    TWO_SEGMENTS,
    ShortFormClient,
    assert_served,
    kept_segments,
    pinned_rig,
    step,
    trainer_for,
)
from .worker_rig import (
    TinyNet,
    state,
)


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
