# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where ``shared_params.SharedParameters`` places a model's parameters: in
segments of at most the size asked, adopted storages followed when a
parameter is re-allocated or resized in place, empty tensors kept in their
segment, and the chunks the ipc trainer sends when tensors come out of segment
order or between shared ones (no vLLM engine)."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.ipc.shared_params import (
    SharedParameters,
)
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

from .shared_params_rig import (
    TWO_SEGMENTS,
    RecordingClient,
    assert_served,
    pinned_rig,
    step,
    trainer_for,
)
from .worker_rig import (
    EngineClient,
    TinyNet,
    make_engine,
    planned_ready,
    state,
)


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

    from .worker_rig import LoaderNet

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
