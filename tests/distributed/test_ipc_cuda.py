# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA data plane: bytes exported by the trainer engine through CUDA IPC are
read, bit for bit, by a second process that rebuilds them from the JSON handles
(packed and unpacked). Needs an NVIDIA GPU; skipped without one."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from vllm.distributed.weight_transfer import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _reader(conn) -> None:
    """Second process: import every update's buffers and send back CPU copies."""
    from vllm.distributed.weight_transfer.ipc_dataplane import BufferImporter
    from vllm.distributed.weight_transfer.ipc_wire import IPCWeightTransferUpdateInfo

    torch.cuda.set_device(0)
    importer = BufferImporter(torch.device("cuda", 0), local_rank=0)
    while True:
        msg = conn.recv()
        if msg is None:
            importer.close()
            conn.send(("closed", None))
            return
        if msg == "finish":  # as the worker engine does at finish_weight_update
            importer.close()
            conn.send(("ok", None))
            continue
        try:
            info = IPCWeightTransferUpdateInfo.from_dict(json.loads(msg))
            keys, bufs = [], []
            for hmap in info.buffers():
                key, handle = importer.select(hmap, "ipc_handles")
                keys.append(key)
                bufs.append(importer.open(handle))
            out = {}
            for v in info.views():
                raw = bufs[v.buffer][v.offset : v.offset + v.nbytes]
                out[v.name] = raw.view(v.dtype).view(v.shape).cpu()
            torch.cuda.synchronize()
            del bufs, raw
            if not info.packed:
                importer.close()
            conn.send(("ok", (keys, out)))
        except Exception as e:  # report, keep serving
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PipeWorker:
    """A client whose update_weights runs in the reader process."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.received: dict[str, torch.Tensor] = {}
        self.keys: set[str] = set()
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update" if "abort" not in update_info else "abort")
        if "abort" in update_info:
            return
        self.conn.send(json.dumps(update_info))  # the wire is plain JSON
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(payload)
        keys, tensors = payload
        self.keys.update(keys)
        self.received.update(tensors)

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self.conn.send("finish")
        assert self.conn.recv() == ("ok", None)


class CudaSource(WeightSource):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        yield from self.tensors.items()


@pytest.fixture(scope="module")
def reader():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send(None)
    assert parent.recv()[0] == "closed"
    proc.join(60)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for i in range(6):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        t = torch.randn(64, 32 + i, generator=gen, device="cuda").to(dtype)
        out[f"layers.{i}.weight"] = t
    out["norm.weight"] = torch.randn(7, generator=gen, device="cuda")
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_cuda_ipc_bytes_arrive_bit_exact_in_another_process(reader, packed):
    from vllm.distributed.weight_transfer.cuda_ipc_buffer import physical_gpu_uuid

    tensors = _tensors()
    client = PipeWorker(reader)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=20_000),
        client=client,
        source=CudaSource(tensors),
    )
    engine.send_weights()
    assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
    assert client.calls[-1] == "finish" and "abort" not in client.calls
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
