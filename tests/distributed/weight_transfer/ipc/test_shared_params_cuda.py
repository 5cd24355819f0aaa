# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared CUDA parameters over the CUDA data plane: a second process maps the
trainer's parameters once and reads them in place, a pinned source sends its
layout once then only its id, parameters in several segments travel as one
message, adopted parameters are read where they are, and a move found while
landing aborts the update and the next one goes whole. Needs an NVIDIA GPU;
skipped without one."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from vllm.distributed.weight_transfer import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import payload_checksum

from .cuda_rig import (
    CudaSource,
    PipeWorker,
    _answer,
    _stats,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pinned_trainer(
    reader, shared, model, **options
) -> tuple[PipeWorker, IPCTrainerWeightTransferEngine]:
    """A client into the reader and a trainer sending ``model`` with
    ``shared.source(model)``, checksums on (``options``: more trainer
    settings)."""
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, verify_checksums=True, **options),
        client=client,
        source=shared.source(model),
    )
    return client, engine


def _sync_and_check(engine, client: PipeWorker, model) -> None:
    """One sync; the reader received every parameter bit for bit."""
    engine.send_weights()
    for name, p in model.named_parameters():
        assert torch.equal(client.received[name], p.detach().cpu()), name


def _short_messages(reader) -> int:
    """Short messages (a layout id) the reader parsed so far."""
    reader.send("short_messages")
    status, count = _answer(reader, "short_messages")
    assert status == "ok"
    return count


class Net(torch.nn.Module):
    """Parameters of two dtypes, a bias-less layer, and one 4 MiB matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(32 + i, 64, bias=i % 2 == 0) for i in range(4)
        )
        self.norm = torch.nn.Parameter(torch.randn(7))
        self.big = torch.nn.Parameter(torch.randn(1024, 1024))
        self.layers[1].to(torch.bfloat16)


class ParamSource(WeightSource):
    """The module's parameters as they are at each sync."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self):
        return [
            ParamMeta(n, p.dtype, tuple(p.shape))
            for n, p in self.module.named_parameters()
        ]

    def __iter__(self):
        for name, p in self.module.named_parameters():
            yield name, p.detach()


def test_shared_parameters_are_mapped_once_and_read_in_place(reader):
    """``SharedParameters`` on CUDA: the trainer's parameters live in one
    device allocation, one message names it (nothing is packed), and the
    reader maps it once for all syncs. An optimizer-like in-place step is
    read through the kept mapping; a re-allocated parameter is packed, never
    read from the old place; after a failed sync (the reader drops every
    mapping) the buffer is exported anew and mapped again; and the memory
    goes back once both sides let go."""
    import gc

    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    # The checksums' first matrix product makes cuBLAS allocate its
    # workspaces (32 MiB and more on an H200), once per process: done here,
    # before the baseline, so only the trainer's memory is measured.
    payload_checksum(torch.zeros(1 << 16, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = Net().cuda()
    shared = SharedParameters.place(model)
    assert shared.device == torch.device("cuda", 0)
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=1 << 20,
            verify_checksums=True,
        ),
        client=client,
        source=ParamSource(model),
    )

    def assert_received(module: torch.nn.Module) -> None:
        for name, p in module.named_parameters():
            assert torch.equal(client.received[name], p.detach().cpu()), name

    opened_before, _ = _stats(reader)
    engine.send_weights()
    assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
    assert_received(model)
    # Nothing is packed from the buffer, so its chunks travel as one message.
    assert client.checksums_verified == 1
    assert engine._kept_buffer is None, "nothing was packed"
    assert _stats(reader) == (opened_before + 1, 1), "one mapping, kept"
    export = shared.handle

    with torch.no_grad():  # an optimizer step writes in place
        for p in model.parameters():
            p.mul_(-2).add_(0.5)
    del p
    engine.send_weights()
    assert_received(model)
    assert _stats(reader) == (opened_before + 1, 1), "the kept mapping is reused"
    assert shared.handle is export, "exported once"

    # A re-allocated parameter no longer lies in the buffer: its chunk is
    # packed, the others still read in place.
    layer = model.layers[2]
    assert isinstance(layer, torch.nn.Linear)
    layer.weight.data = layer.weight.data * 3
    assert shared.moved() == ["layers.2.weight"]
    engine.send_weights()
    assert_received(model)
    opened, kept = _stats(reader)
    assert opened > opened_before + 1 and kept == 1
    assert shared.handle is export

    # A failed sync: the trainer aborts, the reader drops every mapping (as
    # the worker engine does); the next sync exports the buffer anew.
    client.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.send_weights()
    assert _stats(reader)[1] == 0
    opened, _ = _stats(reader)
    engine.send_weights()
    assert_received(model)
    assert shared.handle is not export, "exported anew"
    assert _stats(reader)[0] > opened

    # Let go on both sides: the trainer's parameters and buffer, then the
    # reader's mapping (a sync that does not name the buffer drops it).
    shared.close()
    del model, layer, export, engine, shared
    other = torch.arange(16, dtype=torch.float32, device="cuda")
    other_engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=CudaSource({"x": other}),
    )
    other_engine.send_weights()
    assert _stats(reader)[1] == 0, "the reader dropped the buffer"
    del other_engine, other
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() - base < (1 << 20), "memory went back"


def test_a_pinned_source_sends_its_layout_once_then_only_its_id(reader):
    """``SharedParameters.source`` on CUDA: after the first sync, each sync
    is one short message (the layout's id and the kept export), read
    bit-exact through the kept mapping; a re-allocated parameter ends the
    short form (that sync goes whole, the moved tensor packed), and a failed
    sync makes the next one whole again, with a fresh export."""
    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    torch.manual_seed(1)
    model = Net().cuda()
    shared = SharedParameters.place(model)
    # (The check comes before each short message here; checked while it
    # lands: test_a_move_found_while_landing_is_aborted_then_sent_whole.)
    client, engine = _pinned_trainer(reader, shared, model, check_while_landing=False)

    sync_and_check = partial(_sync_and_check, engine, client, model)

    short_messages = partial(_short_messages, reader)

    shorts = short_messages()
    sync_and_check()
    export = shared.handle
    opened, _ = _stats(reader)
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2).add_(0.5)
        del p
        client.received.clear()  # the short message lists every name again
        sync_and_check()
    assert short_messages() == shorts + 2
    assert _stats(reader) == (opened, 1), "no new mapping"
    assert shared.handle is export

    model.norm.data = model.norm.data * 3  # re-allocated: the full way
    sync_and_check()
    assert short_messages() == shorts + 2
    with torch.no_grad():
        model.big.add_(1)
    sync_and_check()  # the norm still lies outside the buffer: whole again
    assert short_messages() == shorts + 2

    shared2 = SharedParameters.place(model)  # everything in a buffer again
    engine.source = shared2.source(model)
    sync_and_check()
    sync_and_check()
    assert short_messages() == shorts + 3
    client.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.send_weights()
    export = shared2.handle
    sync_and_check()
    assert short_messages() == shorts + 3, "whole after the failure"
    assert shared2.handle is not export, "exported anew"
    sync_and_check()
    assert short_messages() == shorts + 4
    shared.close()
    shared2.close()


def test_parameters_placed_in_several_segments_travel_as_one_message(reader):
    """``SharedParameters.place(..., max_segment_bytes=...)`` on CUDA: each
    segment is filled before the next is allocated and the parameters' old
    memory goes as they are copied, so placing needs about one segment more
    than the parameters, not twice them. Every sync is one message naming
    all segments, each mapped once and kept; the short form names them
    again; after a failed sync every segment is exported anew."""
    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    torch.manual_seed(2)
    # Eight 256 KiB matrices, two to a segment.
    model = torch.nn.Sequential(
        *(torch.nn.Linear(256, 256, bias=False) for _ in range(8))
    ).cuda()
    limit = 512 << 10
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    shared = SharedParameters.place(model, max_segment_bytes=limit)
    extra_peak = torch.cuda.max_memory_allocated() - before
    assert shared.num_segments == 4
    # One segment beyond the parameters at most (placing all 2 MiB in one
    # allocation would add 2 MiB), and nothing beyond them afterwards.
    assert extra_peak <= limit, extra_peak
    assert torch.cuda.memory_allocated() == before
    client, engine = _pinned_trainer(reader, shared, model)

    sync_and_check = partial(_sync_and_check, engine, client, model)

    opened_before, _ = _stats(reader)
    n = shared.num_segments
    sync_and_check()
    assert client.checksums_verified == n, "one checksum per segment"
    assert _stats(reader) == (opened_before + n, n), "each segment mapped once"
    exports = [shared.segment_handle(i) for i in range(n)]
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2).add_(0.5)
        del p
        client.received.clear()
        sync_and_check()
    assert _stats(reader) == (opened_before + n, n), "no new mapping"
    assert [shared.segment_handle(i) for i in range(n)] == exports
    reader.send("short_messages")
    assert _answer(reader, "short_messages")[1] >= 2, "the short form"
    client.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.send_weights()
    sync_and_check()
    assert all(shared.segment_handle(i) is not exports[i] for i in range(n))
    assert _stats(reader) == (opened_before + 2 * n, n)
    shared.close()


def test_adopted_parameters_are_read_where_they_are(reader):
    """``SharedParameters.adopt`` on CUDA: nothing is copied or allocated;
    each parameter storage is a segment, exported once, and the first sync
    names them all in one message; each later sync is the layout's id
    alone, read through the kept mappings, bit-exact. After a failed sync
    every storage is exported anew and mapped again. A re-allocated
    parameter's new storage is adopted before the next sync, which goes
    whole (nothing packed, never the old storage), and the old one is let
    go; the sync after is short again."""
    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    torch.manual_seed(3)
    model = Net().cuda()
    where = {n: p.data_ptr() for n, p in model.named_parameters()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    shared = SharedParameters.adopt(model)
    assert torch.cuda.memory_allocated() == before, "nothing allocated"
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
    n = shared.num_segments
    assert n == len(where), "one segment per parameter storage"
    client, engine = _pinned_trainer(reader, shared, model, check_while_landing=False)

    sync_and_check = partial(_sync_and_check, engine, client, model)

    short_messages = partial(_short_messages, reader)

    opened, _ = _stats(reader)
    shorts = short_messages()
    sync_and_check()
    assert engine._kept_buffer is None, "nothing was packed"
    assert _stats(reader) == (opened + n, n)
    exports = [shared.segment_handle(i) for i in range(n)]
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2).add_(0.5)
        del p
        client.received.clear()
        sync_and_check()
    assert short_messages() == shorts + 2
    assert _stats(reader) == (opened + n, n), "no new mapping"
    assert [shared.segment_handle(i) for i in range(n)] == exports

    client.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.send_weights()
    assert _stats(reader)[1] == 0, "the reader dropped every mapping"
    sync_and_check()  # whole, every storage exported anew and mapped again
    assert all(shared.segment_handle(i) is not exports[i] for i in range(n))
    assert _stats(reader) == (opened + 2 * n, n)

    model.norm.data = model.norm.data * 3  # re-allocated
    assert shared.moved() == ["norm"]
    opened, _ = _stats(reader)
    sync_and_check()
    assert shared.moved() == [] and shared.num_segments == n, "adopted anew"
    assert engine._kept_buffer is None, "nothing was packed"
    assert short_messages() == shorts + 2, "whole, with a new layout id"
    assert _stats(reader) == (opened + 1, n), "the new storage mapped, the old let go"
    with torch.no_grad():
        model.norm.add_(1)
    sync_and_check()
    assert short_messages() == shorts + 3, "short again"
    shared.close()


def test_a_move_found_while_landing_is_aborted_then_sent_whole(reader):
    """``check_while_landing`` on CUDA (adopted storages): once a sync found
    nothing moved, the next short message goes at once and the source is
    checked while it lands. A parameter re-allocated meanwhile is found by
    that check: the update is aborted (the reader drops every mapping, as
    the worker engine does), and the same ``send_weights`` goes whole with
    the new storage adopted and every storage exported anew, bit-exact."""
    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    torch.manual_seed(5)
    model = Net().cuda()
    shared = SharedParameters.adopt(model)
    n = shared.num_segments
    client, engine = _pinned_trainer(reader, shared, model)

    def step_and_sync() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2).add_(0.5)
        client.received.clear()
        engine.send_weights()
        for name, p in model.named_parameters():
            assert torch.equal(client.received[name], p.detach().cpu()), name

    step_and_sync()
    step_and_sync()
    assert engine.checked_while_landing == 1
    opened, _ = _stats(reader)
    client.calls.clear()
    model.norm.data = model.norm.data * 3  # re-allocated
    step_and_sync()
    assert client.calls.count("abort") == 1
    assert engine.checked_while_landing == 1
    assert shared.moved() == [] and shared.num_segments == n, "adopted anew"
    assert engine._kept_buffer is None, "nothing was packed"
    assert _stats(reader) == (opened + n, n), "every storage mapped again"
    step_and_sync()  # checked first: the last sync found something moved
    assert engine.checked_while_landing == 1
    step_and_sync()
    assert engine.checked_while_landing == 2
    shared.close()
