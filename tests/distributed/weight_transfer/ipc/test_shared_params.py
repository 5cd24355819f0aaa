# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A CPU trainer whose parameters live in shared memory
(``shared_params.SharedParameters``): ``ipc`` sends them without packing, the
worker reads the trainer's own bytes and keeps the segment mapped across
updates (dropping it once an update reads others), and a parameter the
trainer re-allocated is packed as before, never read stale. On the ipc worker
engine with a small torch model (no vLLM engine). At the end, the CUDA
bookkeeping (a kept mapping, fresh exports) with torch's import faked. The
segments' layout is in ``test_shared_params_layout.py``, the short form in
``test_shared_params_short_form.py``."""

from __future__ import annotations

import os
from types import SimpleNamespace

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

from .shared_params_rig import (
    RecordingClient,
    kept_segments,
    trainer_for,
)
from .worker_rig import (
    TinyNet,
    make_engine,
    planned_ready,
    reload_ready,
    state,
)


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

    from vllm.distributed.weight_transfer.ipc.whole_sync import _SharedInSync

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
