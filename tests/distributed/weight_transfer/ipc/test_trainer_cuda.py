# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA data plane: bytes exported by the trainer engine through CUDA IPC are
read, bit for bit, by a second process that rebuilds them from the JSON handles
(packed and unpacked), with or without checksums; a second send reuses nothing
stale, and a kept packed buffer is mapped once and exported anew after a
failure. Needs an NVIDIA GPU; skipped without one."""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import payload_checksum

from .cuda_rig import (
    CudaSource,
    PipeWorker,
    _stats,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for i in range(6):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        t = torch.randn(64, 32 + i, generator=gen, device="cuda").to(dtype)
        out[f"layers.{i}.weight"] = t
    out["norm.weight"] = torch.randn(7, generator=gen, device="cuda")
    return out


@pytest.mark.parametrize("checksums", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_cuda_ipc_bytes_arrive_bit_exact_in_another_process(reader, packed, checksums):
    from vllm.distributed.weight_transfer.buffers.cuda_ipc import physical_gpu_uuid

    tensors = _tensors()
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=packed,
            packed_buffer_size_bytes=20_000,
            verify_checksums=checksums,
        ),
        client=client,
        source=CudaSource(tensors),
    )
    engine.send_weights(weight_version="v1")
    assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
    assert client.calls[-1] == "finish" and "abort" not in client.calls
    assert client.versions == ["v1"]  # set after the receipt verified
    buffers = len(engine.last_plan.chunks) if packed else len(tensors)
    assert client.checksums_verified == (buffers if checksums else 0)
    assert client.keys == {physical_gpu_uuid(0)}
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t.cpu()), name


def test_second_send_reuses_nothing_stale(reader):
    tensors = _tensors()
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=20_000),
        client=client,
        source=CudaSource(tensors),
    )
    engine.send_weights()
    for t in tensors.values():
        t.mul_(-1)
    engine.send_weights()
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t.cpu()), name


def test_a_kept_packed_buffer_is_mapped_once_and_exported_anew_after_a_failure(
    reader,
):
    """``keep_packed_buffer=True`` on CUDA: the trainer packs into the same
    allocation at every sync and exports it once (a persistent handle); the
    reader keeps it mapped, so the second sync opens nothing and reads the
    new bytes. A failed sync drops the buffer on both sides; the next one
    packs into a new, freshly exported buffer. The memory goes back once
    both sides let go."""
    import gc

    payload_checksum(torch.zeros(1 << 16, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    tensors = _tensors()
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=20_000,
            keep_packed_buffer=True,
            verify_checksums=True,
        ),
        client=client,
        source=CudaSource(tensors),
    )

    def assert_received() -> None:
        for name, t in tensors.items():
            assert torch.equal(client.received[name], t.cpu()), name

    opened_before, _ = _stats(reader)
    engine.send_weights()
    assert_received()
    assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
    kept = engine._kept_buffer
    assert kept is not None and kept.handle.persistent
    export = kept.handle
    assert _stats(reader) == (opened_before + 1, 1), "one mapping, kept"

    for t in tensors.values():
        t.mul_(-1)
    engine.send_weights()
    assert_received()
    assert _stats(reader) == (opened_before + 1, 1), "the kept mapping is reused"
    assert engine._kept_buffer is kept and kept.handle is export, "exported once"

    client.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.send_weights()
    assert _stats(reader)[1] == 0 and engine._kept_buffer is None
    for t in tensors.values():
        t.add_(1)
    engine.send_weights()
    assert_received()
    assert engine._kept_buffer is not None and engine._kept_buffer is not kept
    assert _stats(reader) == (opened_before + 2, 1)

    # Let go on both sides: the trainer frees its buffer, and a sync that
    # does not name it makes the reader drop its mapping.
    engine.shutdown()
    del engine, kept, export
    other = torch.arange(16, dtype=torch.float32, device="cuda")
    other_engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, keep_packed_buffer=False),
        client=client,
        source=CudaSource({"x": other}),
    )
    other_engine.send_weights()
    assert _stats(reader)[1] == 0, "the reader dropped the buffer"
    del other_engine, other
    tensors.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() - base < (1 << 20), "memory went back"
