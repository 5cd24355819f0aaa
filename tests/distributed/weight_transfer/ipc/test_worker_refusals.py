# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the ipc worker engine refuses before it commits (no vLLM engine): a
manifest the served checkpoint contradicts is rejected before anything loads,
dtypes that do not fit their parameters are refused (after good syncs too), a
layer missing parameters is not committed, a name sent twice is refused, and a
malformed abort after a weight landed still closes the update."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.buffers.handles import cpu_device_key
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.landing.completeness import IncompleteUpdateError
from vllm.distributed.weight_transfer.verification import (
    ManifestMismatch,
)

from .worker_rig import (
    EngineClient,
    TinyNet,
    make_engine,
    push,
    reload_ready,
    state,
)


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
