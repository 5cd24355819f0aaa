# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc wire format: JSON round trips, and every malformed message rejected
with a ValueError naming the field, before any weight is touched."""

import json
import time

import pytest
import torch

from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
from vllm.distributed.weight_transfer.buffers.handles import (
    CudaIpcHandle,
    ShmHandle,
    cpu_device_key,
    select_cpu_key,
)
from vllm.distributed.weight_transfer.ipc.layout_memo import LayoutMemo
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
    layout_digest,
)
from vllm.distributed.weight_transfer.verification import (
    abort_reason,
)

KEY = cpu_device_key(0)
SHM = {"kind": "shm", "name": "vllm-wt-1-abc", "nbytes": 1024}


def packed(**overrides):
    msg = {
        "names": ["a.weight", "b.weight"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[2, 3], [4]],
        "tensor_sizes": [24, 8],
        "offsets": [0, 64],
        "ipc_handles": {KEY: dict(SHM)},
    }
    msg.update(overrides)
    return msg


def unpacked(**overrides):
    msg = {
        "names": ["a.weight", "b.weight"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[2, 3], [4]],
        "ipc_handles": [
            {KEY: {"kind": "shm", "name": "vllm-wt-1-a", "nbytes": 24}},
            {KEY: {"kind": "shm", "name": "vllm-wt-1-b", "nbytes": 8}},
        ],
    }
    msg.update(overrides)
    return msg


def committed(memo: LayoutMemo, message: dict) -> IPCWeightTransferUpdateInfo:
    """``message`` parsed by ``memo``, landed, and its update committed: what
    a worker does for a message of a sync that succeeds."""
    info = memo.parse(json.loads(json.dumps(message)))
    memo.landed(info)
    memo.commit()
    return info


def short(message: dict, **fields) -> dict:
    """The short form naming the layout of full ``message``, with its
    digest (as the trainer sends it); ``fields`` add to it or replace."""
    out = {"layout": message["layout"], "layout_digest": layout_digest(message)}
    out.update(fields)
    return out


def test_packed_message_round_trips_through_json():
    info = IPCWeightTransferUpdateInfo.from_dict(packed())
    assert info.packed
    wire = json.loads(json.dumps(info.to_dict()))
    again = IPCWeightTransferUpdateInfo.from_dict(wire)
    assert again.to_dict() == info.to_dict()
    views = again.views()
    assert [(v.name, v.dtype, v.shape, v.offset, v.nbytes) for v in views] == [
        ("a.weight", torch.float32, (2, 3), 0, 24),
        ("b.weight", torch.bfloat16, (4,), 64, 8),
    ]
    assert isinstance(again.buffers()[0][KEY], ShmHandle)


def test_packed_offsets_default_to_back_to_back():
    info = IPCWeightTransferUpdateInfo.from_dict(packed(offsets=None))
    assert [v.offset for v in info.views()] == [0, 24]


def test_a_chunk_with_an_earlier_layout_reuses_its_views_and_checks_its_handles():
    """``LayoutMemo``: a packed chunk that lists the same tensors at the same
    offsets as at an earlier sync (another buffer name, say) reuses that
    message's checked views; any change of layout parses afresh, and the new
    handles are checked either way."""
    memo = LayoutMemo()
    first = committed(memo, packed())
    other = packed(names=["c.weight", "d.weight"], offsets=[0, 32])
    other_chunk = committed(memo, other)
    renamed = {**SHM, "name": "vllm-wt-1-next"}
    again = memo.parse(json.loads(json.dumps(packed(ipc_handles={KEY: renamed}))))
    assert memo.reused == 1 and again._views is first._views
    handle, earlier = again.buffers()[0][KEY], first.buffers()[0][KEY]
    assert isinstance(handle, ShmHandle) and isinstance(earlier, ShmHandle)
    assert handle.name == "vllm-wt-1-next"
    assert earlier.name == SHM["name"]  # the earlier message is unchanged
    assert [v.name for v in other_chunk.views()] == ["c.weight", "d.weight"]
    # One offset moved: parsed afresh.
    moved = memo.parse(packed(ipc_handles={KEY: renamed}, offsets=[0, 128]))
    assert moved._views is not first._views and memo.reused == 1
    assert [v.offset for v in moved.views()] == [0, 128]
    # A handle too small for the tensors is refused on the reuse path too.
    small = {**SHM, "nbytes": 100}
    with pytest.raises(ValueError, match="covers 100 bytes but the tensors need 136"):
        memo.parse(packed(ipc_handles={KEY: small}, offsets=[0, 128]))
    # An unpacked message is never reused.
    memo.parse(unpacked())
    memo.parse(unpacked())
    assert memo.reused == 1


def test_a_short_message_names_a_layout_parsed_before():
    """A full packed message that carries ``layout`` is remembered under that
    id; a later ``{"layout": id, "ipc_handles": ...}`` reuses its views with
    the new handles, checked to cover the tensors. An id the worker never
    parsed, extra fields, or a layout on an unpacked message are refused."""
    memo = LayoutMemo()
    full = packed(layout="sync-a")
    first = committed(memo, full)
    assert first.to_dict()["layout"] == "sync-a"
    assert first.layout_digest() == layout_digest(full)
    renamed = {**SHM, "name": "vllm-wt-1-next"}
    brief = memo.parse(short(full, ipc_handles={KEY: renamed}))
    assert brief._views is first._views and memo.compact == 1 and brief.short_form
    handle = brief.buffers()[0][KEY]
    assert isinstance(handle, ShmHandle) and handle.name == "vllm-wt-1-next"
    with pytest.raises(ValueError, match="committed no full message with that layout"):
        memo.parse(short(packed(layout="sync-b"), ipc_handles={KEY: SHM}))
    with pytest.raises(ValueError, match="covers 10 bytes but the tensors need 72"):
        memo.parse(short(full, ipc_handles={KEY: {**SHM, "nbytes": 10}}))
    with pytest.raises(ValueError, match="unknown field"):
        memo.parse(short(full, ipc_handles={KEY: SHM}, offsets=[0]))
    with pytest.raises(ValueError, match="update_info.layout must be"):
        IPCWeightTransferUpdateInfo.from_dict({**unpacked(), "layout": "x"})
    with pytest.raises(ValueError, match="update_info.layout must be"):
        IPCWeightTransferUpdateInfo.from_dict(packed(layout=""))
    # Only the newest ``max_layouts`` ids are kept.
    small = LayoutMemo(max_layouts=1)
    committed(small, packed(layout="one"))
    committed(small, packed(layout="two"))
    with pytest.raises(ValueError, match="committed no full message"):
        small.parse(short(packed(layout="one"), ipc_handles={KEY: SHM}))
    assert small.parse(short(packed(layout="two"), ipc_handles={KEY: SHM})).names == [
        "a.weight",
        "b.weight",
    ]


# ---------------------------------------------------------------------------
# hostile input against the layout memo: whatever is refused, aborted or
# sent under a trainer's layout id, a later short form lands exactly the
# layout the trainer's digest names, or is refused.

Q0, Q1 = "layers.0.q_proj.weight", "layers.1.q_proj.weight"


def q_projs(**overrides):
    """A trainer's whole sync under layout id ``L``: two same-shaped
    ``q_proj`` weights and a bias, in one segment."""
    fields = {
        "names": [Q0, Q1, "layers.1.bias"],
        "dtype_names": ["float32", "float32", "float32"],
        "shapes": [[2, 4], [2, 4], [4]],
        "tensor_sizes": [32, 32, 16],
        "offsets": [0, 64, 128],
        "layout": "L",
    }
    return packed(**{**fields, **overrides})


def swapped(message):
    """``message`` with its two ``q_proj`` names swapped (same shapes)."""
    names = list(message["names"])
    names[0], names[1] = names[1], names[0]
    return {**message, "names": names}


def landed_names(info):
    return [(v.name, v.offset) for v in info.views()]


def test_a_refused_message_under_a_layout_id_changes_no_later_short_form():
    """The exact sequence: full ``L``, then its short form; a client's full
    message under ``L`` with the ``q_proj`` names swapped and a segment
    that does not exist is parsed, then refused (never landed): the next
    short form still lands the trainer's layout. The same message landed
    in an update that was aborted, failed or superseded teaches nothing."""
    memo = LayoutMemo()
    trainer = q_projs()
    committed(memo, trainer)
    again = memo.parse(short(trainer, ipc_handles={KEY: SHM}))
    memo.landed(again)
    memo.commit()
    gone = {**SHM, "name": "vllm-wt-no-such-segment"}
    hostile = swapped(q_projs(ipc_handles={KEY: gone}))
    parsed = memo.parse(hostile)  # the worker then fails to map it
    assert landed_names(parsed)[0] == (Q1, 0)
    memo.discard()
    # Landed, then aborted / failed / a new update started: all discard.
    memo.parse(hostile)
    memo.landed(memo.parse(swapped(q_projs())))
    memo.discard()
    after = memo.parse(short(trainer, ipc_handles={KEY: SHM}))
    assert landed_names(after) == [(Q0, 0), (Q1, 64), ("layers.1.bias", 128)]
    # A short form that lands teaches nothing of its own: ``L`` still names
    # the full message that set it.
    memo.landed(after)
    memo.commit()
    held, digest = memo._by_layout["L"]
    assert not held.short_form and digest == layout_digest(trainer)


def test_a_short_form_bound_to_another_layout_under_its_id_is_refused():
    """A client's full message under ``L`` that did land and commit (its
    right: it served what it sent) replaces what ``L`` names; the trainer's
    short form, whose digest is of its own layout, is then refused naming
    the field and telling it to send the full message."""
    memo = LayoutMemo()
    trainer = q_projs()
    committed(memo, trainer)
    committed(memo, swapped(q_projs()))
    with pytest.raises(
        ValueError, match=r"update_info.layout_digest is .* send the full message"
    ):
        memo.parse(short(trainer, ipc_handles={KEY: SHM}))
    # The short form of what was committed under L still goes.
    bound = memo.parse(short(swapped(q_projs()), ipc_handles={KEY: SHM}))
    assert landed_names(bound)[0] == (Q1, 0)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"layout_digest": None}, "layout_digest must be 64 lowercase hex"),
        ({"layout_digest": 7}, "layout_digest must be 64 lowercase hex"),
        ({"layout_digest": "ab" * 16}, "layout_digest must be 64 lowercase hex"),
        ({"layout_digest": "AB" * 32}, "layout_digest must be 64 lowercase hex"),
        ({"layout_digest": "0" * 64}, "update_info.layout_digest is 0000"),
        ({"layout": ["L"]}, "committed no full message with that layout"),
        ({"names": [Q0]}, "missing required field|unknown field|dtype_names"),
        ({"offsets": [0, 64, 128]}, "unknown field"),
        ({"publication_digest": "x"}, "unknown field"),
    ],
    ids=[
        "null-digest",
        "int-digest",
        "truncated-digest",
        "uppercase-digest",
        "wrong-digest",
        "layout-not-a-string",
        "partial-full-form",
        "stray-offsets",
        "stray-field",
    ],
)
def test_a_malformed_short_form_is_refused(fields, match):
    memo = LayoutMemo()
    trainer = q_projs()
    committed(memo, trainer)
    message = short(trainer, ipc_handles={KEY: SHM}, **fields)
    with pytest.raises(ValueError, match=match):
        memo.parse(message)


def test_a_short_form_without_its_digest_is_refused():
    memo = LayoutMemo()
    trainer = q_projs()
    committed(memo, trainer)
    with pytest.raises(ValueError, match="layout_digest"):
        memo.parse({"layout": "L", "ipc_handles": {KEY: SHM}})


def test_a_replayed_short_form_of_a_replaced_layout_is_refused():
    """A short form recorded at an earlier sync and replayed after the
    trainer committed a new full message under the same id (another
    offset) names the old digest: refused. One whose layout was never
    committed (its update aborted) is refused as unknown."""
    memo = LayoutMemo()
    old = q_projs()
    committed(memo, old)
    replay = short(old, ipc_handles={KEY: SHM})
    memo.parse(replay)
    committed(memo, q_projs(offsets=[0, 64, 192]))
    with pytest.raises(ValueError, match="update_info.layout_digest is"):
        memo.parse(replay)
    aborted = q_projs(layout="M")
    memo.landed(memo.parse(aborted))
    memo.discard()
    with pytest.raises(ValueError, match="committed no full message"):
        memo.parse(short(aborted, ipc_handles={KEY: SHM}))


def test_the_layout_digest_covers_every_field_of_the_layout_in_order():
    base = layout_digest(q_projs())
    for changed in (
        swapped(q_projs()),
        q_projs(
            dtype_names=["float32", "float32", "float16"], tensor_sizes=[32, 32, 8]
        ),
        q_projs(shapes=[[4, 2], [2, 4], [4]]),
        q_projs(offsets=[0, 64, 192]),
        q_projs(ipc_handles={KEY: {**SHM, "name": "vllm-wt-1-other"}}),
        q_projs(ipc_handles={"cpu:h:0": dict(SHM)}),
    ):
        assert layout_digest(changed) != base
    # Not what travels with every message anew: the same layout and memory.
    assert layout_digest(q_projs(layout="other")) == base
    # The worker's digest of the parsed message is the trainer's of the JSON
    # it sent: one buffer, several, and CUDA handles.
    cuda = q_projs(ipc_handles={"GPU-1": {**_block_handle(0), "nbytes": 256}})
    for message in (q_projs(), several(layout="multi"), cuda):
        info = IPCWeightTransferUpdateInfo.from_dict(json.loads(json.dumps(message)))
        assert info.layout_digest() == layout_digest(message)


def several(**overrides):
    """A packed message over two buffers (a ``SharedParameters`` placed in
    two segments): a.weight in the first, b.weight and c.bias in the second."""
    seg = [
        {"kind": "shm", "name": "vllm-wt-1-s0", "nbytes": 64, "persistent": True},
        {"kind": "shm", "name": "vllm-wt-1-s1", "nbytes": 128, "persistent": True},
    ]
    msg = {
        "names": ["a.weight", "b.weight", "c.bias"],
        "dtype_names": ["float32", "bfloat16", "float32"],
        "shapes": [[2, 3], [4], [2]],
        "tensor_sizes": [24, 8, 8],
        "offsets": [0, 0, 64],
        "buffer_indexes": [0, 1, 1],
        "ipc_handles": {KEY: seg},
    }
    msg.update(overrides)
    return msg


def test_a_packed_message_over_several_buffers_places_each_tensor_in_its_own():
    info = IPCWeightTransferUpdateInfo.from_dict(json.loads(json.dumps(several())))
    assert info.packed
    assert [(v.name, v.buffer, v.offset) for v in info.views()] == [
        ("a.weight", 0, 0),
        ("b.weight", 1, 0),
        ("c.bias", 1, 64),
    ]
    buffers = info.buffers()
    assert [getattr(b[KEY], "name", None) for b in buffers] == [
        "vllm-wt-1-s0",
        "vllm-wt-1-s1",
    ]
    assert info.to_dict() == several()
    # The short form names the same number of buffers.
    memo = LayoutMemo()
    full = several(layout="multi")
    committed(memo, full)
    brief = memo.parse(short(full, ipc_handles=several()["ipc_handles"]))
    assert len(brief.buffers()) == 2 and memo.compact == 1
    with pytest.raises(ValueError, match="must list 2 buffers per device key"):
        memo.parse(short(full, ipc_handles={KEY: dict(SHM)}))
    # ... or no handles at all: those of the message that set the layout,
    # which the worker must still map (checked where the mappings are).
    bare = memo.parse(short(full))
    assert bare.reuses_handles and not brief.reuses_handles
    assert bare._views is brief._views and bare.buffers() == brief.buffers()
    single = packed(layout="single")
    committed(memo, single)
    with pytest.raises(ValueError, match="a layout of one buffer without ipc_handles"):
        memo.parse(short(single))


SEGS = several()["ipc_handles"][KEY]


@pytest.mark.parametrize(
    "message, match",
    [
        (several(buffer_indexes=None), "buffer_indexes is required"),
        (several(buffer_indexes=[0, 2, 1]), r"buffer_indexes\[1\] .* is 2"),
        (several(buffer_indexes=[0, 1]), "buffer_indexes has 2 entries"),
        (several(offsets=[0, 0, 4]), "inside the previous tensor of its buffer"),
        (packed(buffer_indexes=[0, 0]), "only valid when ipc_handles lists"),
        (unpacked(buffer_indexes=[0, 0]), "only valid for a packed update"),
        (
            several(ipc_handles={KEY: [SEGS[0], {**SEGS[1], "nbytes": 70}]}),
            r"ipc_handles\['cpu:.*'\]\[1\] covers 70 bytes but the tensors need 72",
        ),
        (
            several(ipc_handles={KEY: SEGS, "cpu:h:1": SEGS[:1]}),
            "every key must list the same buffers",
        ),
        (several(ipc_handles={KEY: []}), "non-empty list of handles"),
    ],
)
def test_a_malformed_message_over_several_buffers_is_refused(message, match):
    with pytest.raises(ValueError, match=match):
        IPCWeightTransferUpdateInfo.from_dict(message)


def _block_handle(start: int) -> dict:
    """A CUDA handle of 80 bytes at ``start`` of one allocation."""
    return {
        "kind": "cuda",
        "nbytes": 80,
        "device": 0,
        "storage_handle": "AAEC",
        "storage_size_bytes": 256,
        "storage_offset_bytes": start,
        "tensor_offset": 0,
        "ref_counter_handle": "AwQ=",
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": True,
    }


def test_buffers_of_one_message_must_not_share_bytes():
    """Each buffer's tensors are kept apart by the per-buffer order rule,
    which holds only if the buffers are apart: a segment listed twice, or two
    CUDA handles over overlapping bytes of one allocation, are refused;
    neighbours in one allocation are fine."""
    with pytest.raises(ValueError, match="buffers 0 and 1 share bytes"):
        IPCWeightTransferUpdateInfo.from_dict(
            several(ipc_handles={KEY: [SEGS[0], SEGS[0]]})
        )
    for second, ok in ((80, True), (40, False)):
        message = several(
            ipc_handles={"GPU-1": [_block_handle(0), _block_handle(second)]}
        )
        if ok:
            assert len(IPCWeightTransferUpdateInfo.from_dict(message).buffers()) == 2
        else:
            with pytest.raises(ValueError, match="buffers 0 and 1 share bytes"):
                IPCWeightTransferUpdateInfo.from_dict(message)


def test_unpacked_message_round_trips_through_json():
    info = IPCWeightTransferUpdateInfo.from_dict(unpacked())
    assert not info.packed
    again = IPCWeightTransferUpdateInfo.from_dict(
        json.loads(json.dumps(info.to_dict()))
    )
    assert [v.buffer for v in again.views()] == [0, 1]


def test_cuda_handle_round_trips_through_json():
    h = {
        "kind": "cuda",
        "nbytes": 32,
        "device": 0,
        "storage_handle": "AAEC",
        "storage_size_bytes": 64,
        "storage_offset_bytes": 0,
        "tensor_offset": 0,
        "ref_counter_handle": "AwQ=",
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": True,
    }
    info = IPCWeightTransferUpdateInfo.from_dict(
        packed(ipc_handles={"GPU-1": h}, offsets=None)
    )
    handle = info.buffers()[0]["GPU-1"]
    assert isinstance(handle, CudaIpcHandle)
    assert handle.to_dict() == h


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (packed(extra=1), r"update_info has unknown field\(s\) \['extra'\]"),
        ({"names": [], "shapes": []}, r"missing field\(s\) \['dtype_names'\]"),
        (packed(ipc_handles=None), "update_info.ipc_handles is missing"),
        (packed(ipc_handles_pickled="gASV"), "Cannot specify both"),
        (packed(dtype_names=["float32"]), "dtype_names has 1 entries but names has 2"),
        (packed(shapes=[[2, 3]]), "shapes has 1 entries but names has 2"),
        (packed(tensor_sizes=[24]), "tensor_sizes has 1 entries but names has 2"),
        (packed(offsets=[0]), "offsets has 1 entries but names has 2"),
        (packed(names=["a", "a"]), "lists 'a' more than once"),
        (packed(names="a"), "names must be a list of strings"),
        (packed(dtype_names=["float32", "float99"]), r"dtype_names\[1\].*float99"),
        (packed(dtype_names=["float32", "Tensor"]), "not a torch dtype name"),
        (packed(shapes=[[2, -3], [4]]), r"shapes\[0\].*non-negative"),
        (packed(tensor_sizes=[24, 9]), r"tensor_sizes\[1\] \('b.weight'\) is 9"),
        (packed(tensor_sizes=None), "tensor_sizes is required for a packed update"),
        (packed(offsets=[0, 20]), r"offsets\[1\].*inside the previous tensor"),
        (packed(offsets=[0, 25]), r"offsets\[1\].*not a multiple"),
        (packed(offsets=[0, -64]), r"offsets\[1\].*integer >= 0"),
        (
            packed(ipc_handles={KEY: {**SHM, "nbytes": 70}}),
            "covers 70 bytes but the tensors need 72",
        ),
        (packed(ipc_handles={}), "non-empty object"),
        (packed(ipc_handles={KEY: ["rebuild", "args"]}), "must be a handle object"),
        (packed(ipc_handles={KEY: {"kind": "tcp"}}), r"kind is 'tcp'"),
        (
            packed(ipc_handles={KEY: {**SHM, "name": "/etc/passwd"}}),
            "not a segment of this backend",
        ),
        (
            packed(ipc_handles={KEY: {**SHM, "path": "x"}}),
            r"unknown field\(s\) \['path'\]",
        ),
        (packed(ipc_handles={KEY: {"kind": "shm", "name": "vllm-wt-x"}}), "missing"),
        (packed(ipc_handles=3), "must be an object .packed. or a list"),
        (
            unpacked(ipc_handles=[{KEY: SHM}]),
            "ipc_handles has 1 entries but names has 2",
        ),
        (unpacked(offsets=[0, 0]), "offsets is only valid for a packed update"),
        (
            unpacked(
                ipc_handles=[
                    {KEY: {"kind": "shm", "name": "vllm-wt-1-a", "nbytes": 23}},
                    {KEY: {"kind": "shm", "name": "vllm-wt-1-b", "nbytes": 8}},
                ]
            ),
            r"ipc_handles\[0\].*covers 23 bytes but the tensor needs 24",
        ),
    ],
)
def test_malformed_update_is_rejected_naming_the_field(message, match):
    with pytest.raises(ValueError, match=match):
        IPCWeightTransferUpdateInfo.from_dict(message)


def test_update_must_be_an_object():
    with pytest.raises(ValueError, match="update_info must be an object"):
        IPCWeightTransferUpdateInfo.from_dict([packed()])


def test_cuda_handle_outside_its_storage_is_rejected():
    h = {
        "kind": "cuda",
        "nbytes": 32,
        "device": 0,
        "storage_handle": "AAEC",
        "storage_size_bytes": 16,
        "storage_offset_bytes": 0,
        "tensor_offset": 0,
        "ref_counter_handle": "AwQ=",
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": True,
    }
    with pytest.raises(ValueError, match="16-byte storage"):
        IPCWeightTransferUpdateInfo.from_dict(packed(ipc_handles={"GPU-1": h}))
    with pytest.raises(ValueError, match="storage_handle is not valid base64"):
        IPCWeightTransferUpdateInfo.from_dict(
            packed(ipc_handles={"GPU-1": {**h, "storage_handle": "**", "nbytes": 1}})
        )


def test_init_info_rejects_unknown_and_mistyped_fields():
    assert IPCWeightTransferInitInfo.from_dict({"packed": True}).packed
    assert not IPCWeightTransferInitInfo.from_dict({}).packed
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['buffer'\]"):
        IPCWeightTransferInitInfo.from_dict({"packed": True, "buffer": 1})
    with pytest.raises(ValueError, match="packed must be a bool"):
        IPCWeightTransferInitInfo.from_dict({"packed": "yes"})


def test_abort_message():
    assert abort_reason(packed()) is None
    assert abort_reason({"abort": "trainer died"}) == "trainer died"
    with pytest.raises(ValueError, match="must be the only field"):
        abort_reason({"abort": "x", "names": []})


def test_cpu_worker_selects_its_trainer_rank_modulo_the_rank_count():
    keys = [cpu_device_key(0, "h"), cpu_device_key(1, "h"), cpu_device_key(0, "other")]
    assert select_cpu_key(keys, 0, "h") == "cpu:h:0"
    assert select_cpu_key(keys, 1, "h") == "cpu:h:1"
    assert select_cpu_key(keys, 3, "h") == "cpu:h:1"
    assert select_cpu_key(keys, 0, "nohost") is None
    with pytest.raises(ValueError, match=r"trainer ranks \[0, 2\]"):
        select_cpu_key(["cpu:h:0", "cpu:h:2"], 0, "h")


def test_worker_rejects_a_handle_for_a_device_it_does_not_have():
    info = IPCWeightTransferUpdateInfo.from_dict(
        packed(ipc_handles={"cpu:elsewhere:0": dict(SHM)})
    )
    importer = BufferImporter(torch.device("cpu"), local_rank=0)
    with pytest.raises(ValueError, match="no shared-memory handle for this host"):
        importer.select(info.buffers()[0], "update_info.ipc_handles")
    cuda_only = {
        KEY: {
            "kind": "cuda",
            "nbytes": 128,
            "device": 0,
            "storage_handle": "AAEC",
            "storage_size_bytes": 128,
            "storage_offset_bytes": 0,
            "tensor_offset": 0,
            "ref_counter_handle": "AwQ=",
            "ref_counter_offset": 0,
            "event_handle": None,
            "event_sync_required": False,
        }
    }
    info = IPCWeightTransferUpdateInfo.from_dict(packed(ipc_handles=cuda_only))
    with pytest.raises(
        ValueError, match="is a 'cuda' handle but this worker runs on cpu"
    ):
        importer.select(info.buffers()[0], "update_info.ipc_handles")


@pytest.mark.parametrize(
    "name", ["vllm-wt-1-abc\n", "vllm-wt-1/../x", "\nvllm-wt-1", "vllm-wt-"]
)
def test_shm_names_must_match_in_full(name):
    with pytest.raises(ValueError, match="is not a segment of this backend"):
        ShmHandle(name=name, nbytes=8)


@pytest.mark.parametrize("rank", ["0\n", " 0", "\u0660", "1_0"])
def test_cpu_keys_must_end_in_ascii_digits(rank):
    with pytest.raises(ValueError, match="must end in a trainer rank"):
        select_cpu_key([f"cpu:h:{rank}"], 0, hostname="h")


@pytest.mark.serial
def test_a_duplicate_among_many_names_is_found_in_linear_time():
    n = 48_000
    names = [f"layers.{i}.weight" for i in range(n)] + ["layers.7.weight"]
    msg = {
        "names": names,
        "dtype_names": ["float32"] * (n + 1),
        "shapes": [[1]] * (n + 1),
        "tensor_sizes": [4] * (n + 1),
        "ipc_handles": {KEY: dict(SHM, nbytes=4 * (n + 1))},
    }
    started = time.monotonic()
    with pytest.raises(ValueError, match="lists 'layers.7.weight' more than once"):
        IPCWeightTransferUpdateInfo.from_dict(msg)
    assert time.monotonic() - started < 2.0  # quadratic: tens of seconds
