# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``planned_landing.LandingPlan`` on small hand-written models: which names
land straight in served tensors and which modules reload (and why), landing
equals the model's own ``load_weights``, partial updates are refused, and a
replaced tensor is noticed; ``sharded_rdt``'s ``ChunkLander`` lands the
planned modules' pulled bytes straight into the served tensors, reads them
back, and materializes and processes only the others. The engine paths
(plain CPU linear layers, MoE experts reloading, TP=1 and 2, the fresh-load
oracle) are in ``tests/entrypoints/rl/weight_transfer/test_ipc_llm.py`` and,
for ``sharded_rdt``, ``test_sharded_rdt_llm.py`` and
``test_sharded_rdt_http.py``."""

import pytest
import torch
from torch import nn

from vllm.distributed.weight_transfer.landing.completeness import (
    IncompleteUpdateError,
)
from vllm.distributed.weight_transfer.landing.planned import LandingPlan
from vllm.distributed.weight_transfer.plan.worker_plan import leaving_unprocessed
from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
from vllm.distributed.weight_transfer.pull.producer import pack_chunk
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.sharded_rdt.lander import ChunkLander
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

from ..plan.test_bake import CHECKPOINT, Toy, _metas, _param


class Doubling:
    """A quantization method whose processing rewrites the bytes."""

    def process_weights_after_loading(self, layer):
        layer.weight.data.mul_(2)


class HandleBuilding:
    """Keeps the weight's bytes but builds a kernel copy of them, as vLLM
    CPU's packed LM head does."""

    def process_weights_after_loading(self, layer):
        layer.handle = layer.weight.detach().clone()


class Leaving:
    """Processing that leaves the layer as it is."""

    def process_weights_after_loading(self, layer):
        pass


def _layer(method):
    layer = nn.Module()
    layer.weight = _param(4)
    layer.quant_method = method
    return layer


class Mixed(nn.Module):
    """``Toy`` plus layers that must reload, and one name (``shared.w``) that
    writes both a layer that could land directly and one that must reload."""

    def __init__(self):
        super().__init__()
        self.toy = Toy(rank=1)
        self.kept = _layer(Leaving())
        self.doubled = _layer(Doubling())
        self.handled = _layer(HandleBuilding())
        self.beside = _layer(Leaving())
        record_metadata_for_reloading(self)

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        def load(module, tensor):
            param = module.weight
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)

        for name, tensor in weights:
            if name.startswith("toy."):
                self.toy.load_weights([(name[len("toy.") :], tensor)])
            elif name == "shared.w":
                load(self.beside, tensor)
                load(self.doubled, tensor)
            else:
                load(getattr(self, name.split(".")[0]), tensor)


MIXED = {
    **{f"toy.{n}": t for n, t in CHECKPOINT.items()},
    "kept.weight": torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "handled.weight": torch.tensor([5.0, 6.0, 7.0, 8.0]),
    "shared.w": torch.tensor([9.0, 10.0, 11.0, 12.0]),
}


def _bake(model, checkpoint):
    return LandingPlan.bake(model, _metas(checkpoint), worker="test", vllm_config=None)


def test_only_layers_proven_to_keep_their_bytes_land_directly():
    plan = _bake(Mixed(), MIXED)
    assert plan.direct_names == {
        "toy.pair.a",
        "toy.pair.b",
        "toy.norm.weight",
        "kept.weight",
    }
    assert set(plan.reloaded) == {"doubled", "handled", "beside"}
    assert "changes the bytes" in plan.reloaded["doubled"]
    assert "changes the bytes" in plan.reloaded["handled"]
    assert plan.reloaded["beside"] == "shared.w also writes a reloaded module"
    # Rank 1 keeps half of pair.b's columns: 8 + 8 + 4 floats, plus kept's 4.
    assert plan.direct_bytes == 4 * (8 + 8 + 4 + 4)


def test_landing_equals_the_models_own_loaders():
    reference = Mixed()
    reference.load_weights(MIXED.items())
    model = Mixed()
    plan = _bake(model, MIXED)
    for name in plan.direct_names:
        plan.land(name, MIXED[name])
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    for name in ("toy.fused.weight", "toy.norm.weight", "kept.weight"):
        assert torch.equal(got[name], want[name]), name
    # Nothing outside the direct modules was written.
    assert not model.doubled.weight.any() and not model.beside.weight.any()


def test_an_update_with_part_of_a_direct_layer_is_refused():
    plan = _bake(Mixed(), MIXED)
    plan.check_whole(set())
    plan.check_whole({"toy.pair.a", "toy.pair.b", "kept.weight"})
    with pytest.raises(IncompleteUpdateError, match=r"toy\.fused \(lacks toy\.pair\.b"):
        plan.check_whole({"toy.pair.a", "kept.weight"})
    # The set that passed last is remembered; another set is checked again.
    plan.check_whole({"toy.pair.a", "toy.pair.b", "kept.weight"})
    with pytest.raises(IncompleteUpdateError, match=r"lacks toy\.pair\.a"):
        plan.check_whole({"toy.pair.b"})


@pytest.mark.parametrize(
    "replace",
    [
        lambda m: setattr(m.kept, "weight", _param(4)),
        lambda m: m.kept._parameters.__setitem__("weight", _param(4)),
        # An instance attribute shadows the parameter for ``getattr``.
        lambda m: m.kept.__dict__.__setitem__("weight", _param(4)),
        lambda m: delattr(m.kept, "weight"),
        lambda m: setattr(m.toy.norm, "weight", _param(4)),
        # The same objects in new memory (``.to()``, an offload and restore).
        lambda m: m._apply(lambda t: t.clone()),
        lambda m: setattr(m.kept.weight, "data", m.kept.weight.data.clone()),
    ],
    ids=[
        "setattr",
        "parameters dict",
        "shadowed",
        "deleted",
        "another module",
        "new storages",
        "param.data",
    ],
)
def test_a_replaced_served_tensor_unbinds_the_plan(replace):
    model = Mixed()
    plan = _bake(model, MIXED)
    assert plan.still_bound()
    replace(model)
    assert not plan.still_bound()


def test_the_bake_leaves_the_model_as_it_was():
    model = Mixed()
    model.load_weights(MIXED.items())
    before = {n: (t, t.detach().clone()) for n, t in model.named_parameters()}
    _bake(model, MIXED)
    for name, tensor in model.named_parameters():
        assert tensor is before[name][0], name
        assert torch.equal(tensor, before[name][1]), name
    assert not hasattr(model.handled, "handle")


def test_a_staged_update_stages_only_the_slices_this_rank_keeps():
    """``StagedUpdate.load_planned`` stages the planned slices of each direct
    name (rank 1 keeps half of ``pair.b``'s columns), not whole tensors, and
    the commit lands them as the model's own loaders would."""
    from vllm.distributed.weight_transfer.worker.staged import StagedUpdate

    reference = Mixed()
    reference.load_weights(MIXED.items())
    model = Mixed()
    plan = _bake(model, MIXED)
    staged = StagedUpdate(model, None, where="device", model_device=torch.device("cpu"))
    staged.start()
    staged.load_planned(plan, [(n, MIXED[n]) for n in sorted(plan.direct_names)])
    whole = sum(MIXED[n].numel() * 4 for n in plan.direct_names)
    assert staged.staged_bytes == plan.direct_bytes == whole - 8 * 4
    assert not model.kept.weight.any(), "nothing lands before the commit"
    staged.finish()
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    for name in ("toy.fused.weight", "toy.norm.weight", "kept.weight"):
        assert torch.equal(got[name], want[name]), name
    assert staged.staged_bytes == 0


class RecordingSteps:
    """Module steps for a model whose checkpoint-format tensors are real:
    records what it materializes and processes, and processes a module by
    its quantization method, as vLLM's per-layer step would."""

    def __init__(self, model):
        self.model = model
        self.materialized: list[str] = []
        self.processed: list[str] = []

    def materialize(self, module_name):
        self.materialized.append(module_name)

    def process(self, module_name):
        module = self.model.get_submodule(module_name)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        self.processed.append(module_name)


def _land_pulled(model, checkpoint, landing, opened):
    """One sharded_rdt sync of ``checkpoint`` into ``model`` with the planned
    landing ``landing``, as the engine lands it: every chunk packed by the
    producer's ``pack_chunk``, landed by ``ChunkLander`` and read back."""
    plan = leaving_unprocessed(landing.plan, landing.writers)
    pulls = build_pull_plan(plan, RdtRouter(1, 1), consumer_id=0)
    steps = RecordingSteps(model)
    lander = ChunkLander(model, plan, pulls, steps, direct=landing.bound_copies())
    lander.begin(before_first_module=lambda: opened.append("reload"))
    for index, chunk in enumerate(pulls.chunks):
        data = torch.empty(chunk.nbytes, dtype=torch.uint8)
        pack_chunk(chunk, checkpoint, data)
        lander.land(index, data)
        assert not lander.direct_differs(index, data)
    return lander, steps, pulls


def test_sharded_rdt_lands_planned_modules_straight_and_processes_the_rest():
    reference = Mixed()
    reference.load_weights(MIXED.items())
    for layer in (reference.doubled, reference.handled, reference.beside):
        layer.quant_method.process_weights_after_loading(layer)
    model = Mixed()
    landing = _bake(model, MIXED)
    opened: list[str] = []
    lander, steps, _ = _land_pulled(model, MIXED, landing, opened)
    # The layerwise reload opens once, for the first module it must rebuild;
    # only those modules are materialized and processed.
    assert opened == ["reload"]
    assert set(steps.materialized) == set(steps.processed) == set(landing.reloaded)
    assert lander.processed == steps.processed
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(model.handled.handle, reference.handled.handle)


def test_a_sync_whose_every_module_lands_straight_never_opens_the_reload():
    checkpoint = {n: t for n, t in MIXED.items() if n.startswith("toy.")}
    checkpoint["kept.weight"] = MIXED["kept.weight"]
    reference = Mixed()
    reference.load_weights(checkpoint.items())
    model = Mixed()
    landing = _bake(model, checkpoint)
    assert not landing.reloaded
    opened: list[str] = []
    lander, steps, pulls = _land_pulled(model, checkpoint, landing, opened)
    assert opened == [] and steps.materialized == steps.processed == []
    for name in ("toy.fused.weight", "toy.norm.weight", "kept.weight"):
        got = model.get_parameter(name)
        assert torch.equal(got, reference.get_parameter(name)), name
    # The read-back sees a served byte that differs from the pulled one.
    model.kept.weight.data[0] += 1
    data = torch.empty(pulls.chunks[-1].nbytes, dtype=torch.uint8)
    pack_chunk(pulls.chunks[-1], checkpoint, data)
    index = len(pulls.chunks) - 1
    assert lander.has_direct(index) and bool(lander.direct_differs(index, data))


@pytest.mark.parametrize("batch_method", ["loop", "foreach", None])
@pytest.mark.parametrize("bind_fresh", [False, True])
def test_direct_copies_land_batched_from_reused_receive_buffers(
    batch_method, bind_fresh
):
    """Each chunk's direct copies run as one program bound to the receive
    buffer it arrives in, kept for the next sync (the engine's buffers are
    reused). From buffers that are not reused, a program is bound once and
    run from each later one where the method allows it (Triton; here on CPU
    they go one by one), or bound anew each time with
    ``bind_fresh_buffers``. Every sync lands the trainer's values of that
    sync, bit for bit."""
    checkpoint = {n: t for n, t in MIXED.items() if n.startswith("toy.")}
    checkpoint["kept.weight"] = MIXED["kept.weight"]
    model = Mixed()
    landing = _bake(model, checkpoint)
    plan = leaving_unprocessed(landing.plan, landing.writers)
    pulls = build_pull_plan(plan, RdtRouter(1, 1), consumer_id=0)
    lander = ChunkLander(
        model,
        plan,
        pulls,
        RecordingSteps(model),
        direct=landing.bound_copies(),
        batch_method=batch_method,
        bind_fresh_buffers=bind_fresh,
    )
    with_direct = [i for i in range(len(pulls.chunks)) if lander.has_direct(i)]
    assert with_direct
    buffers = [torch.empty(c.nbytes, dtype=torch.uint8) for c in pulls.chunks]
    for step in range(4):
        values = {n: t * (step + 2) - step for n, t in checkpoint.items()}
        reference = Mixed()
        reference.load_weights(values.items())
        lander.begin()
        for index, chunk in enumerate(pulls.chunks):
            pack_chunk(chunk, values, buffers[index])
            # The last two syncs land from fresh buffers that are not reused.
            data = buffers[index] if step < 2 else buffers[index].clone()
            lander.land(index, data, reused=step < 2)
            assert not lander.direct_differs(index, data)
        for name in ("toy.fused.weight", "toy.norm.weight", "kept.weight"):
            got = model.get_parameter(name)
            assert torch.equal(got, reference.get_parameter(name)), (step, name)
        direct = sum(len(lander._direct[i]) for i in with_direct)
        batched = batch_method is not None and (step < 2 or bind_fresh)
        assert lander.batched == (direct if batched else 0)
        # Bound once for the reused buffers, then once for the fresh ones
        # (every time with bind_fresh_buffers).
        fresh_binds = 0 if step < 2 else (step - 1 if bind_fresh else 1)
        assert lander.binds == len(with_direct) * (1 + fresh_binds)


def test_chunks_that_land_straight_are_read_back_byte_for_byte():
    """A chunk every slice of which lands by a direct copy is packed again
    from the served tensors (the base a delta applies to when the worker
    keeps no copy): equal to the producer's packing, alignment gaps zero,
    whatever the buffer held. A chunk with a reloaded slice cannot be."""
    checkpoint = {n: t for n, t in MIXED.items() if n.startswith("toy.")}
    checkpoint["kept.weight"] = MIXED["kept.weight"]
    model = Mixed()
    lander, _, pulls = _land_pulled(model, checkpoint, _bake(model, checkpoint), [])
    assert len(pulls.chunks) == 1 and lander.can_read_back(0)
    packed = torch.empty(pulls.chunks[0].nbytes, dtype=torch.uint8)
    pack_chunk(pulls.chunks[0], checkpoint, packed)
    into = torch.full_like(packed, 0xA5)
    lander.read_back(0, into)
    assert torch.equal(into, packed)
    # A served byte changed out of band is what the read-back returns.
    model.kept.weight.data[0] += 1
    lander.read_back(0, into)
    assert not torch.equal(into, packed)
    # With slices that reload (processing changes their bytes) it cannot.
    model = Mixed()
    lander, _, pulls = _land_pulled(model, MIXED, _bake(model, MIXED), [])
    assert not lander.can_read_back(0)
    with pytest.raises(ValueError, match="cannot be read back"):
        lander.read_back(0, torch.empty(pulls.chunks[0].nbytes, dtype=torch.uint8))


def test_a_chunk_that_lands_straight_lies_in_pieces_of_the_served_tensors():
    """The pieces a delta may be written into are the served tensors' own
    memory, at the chunk offsets the producer packs them at: written there,
    the served tensor changes; laid out over zeros, they are the packed
    chunk. A chunk with a reloaded slice has none, and landing one in place
    refuses."""
    checkpoint = {n: t for n, t in MIXED.items() if n.startswith("toy.")}
    checkpoint["kept.weight"] = MIXED["kept.weight"]
    model = Mixed()
    lander, _, pulls = _land_pulled(model, checkpoint, _bake(model, checkpoint), [])
    pieces = lander.pieces(0)
    assert pieces is not None and lander.pieces(0) is pieces  # found once
    packed = torch.empty(pulls.chunks[0].nbytes, dtype=torch.uint8)
    pack_chunk(pulls.chunks[0], checkpoint, packed)
    laid_out = torch.zeros_like(packed)
    for offset, piece in pieces:
        laid_out[offset : offset + piece.numel()] = piece
    assert torch.equal(laid_out, packed)
    served = [
        p
        for p in model.parameters()
        if p.data_ptr() in {piece.data_ptr() for _, piece in pieces}
    ]
    assert served, "the pieces are views of the served parameters"
    before = served[0].detach().clone()
    next(piece for _, piece in pieces if piece.data_ptr() == served[0].data_ptr())[
        0
    ] ^= 1
    assert not torch.equal(served[0].detach(), before)
    lander.land_in_place(0)  # nothing reloads; processing as landing would
    model = Mixed()
    lander, _, _ = _land_pulled(model, MIXED, _bake(model, MIXED), [])
    assert lander.pieces(0) is None
    with pytest.raises(ValueError, match="no pieces"):
        lander.land_in_place(0)
