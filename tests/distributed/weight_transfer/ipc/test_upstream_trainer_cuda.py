# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fork's trainer speaking upstream 0.32's ipc wire
(``IPCTrainerInitInfo(wire="upstream")``), read on a GPU by a second process
the way an upstream 0.32 worker reads it, and by the fork's worker parsing.

The upstream reader follows upstream's documented worker: a packed chunk's
handle map holds the ``reduce_tensor`` arguments of one flat uint8 buffer under
the GPU's UUID, rebuilt with ``rebuild_cuda_tensor`` on the worker's device,
and its tensors lie back to back from the buffer's start (``tensor_sizes``);
an unpacked message holds one such map per tensor, each rebuilding the tensor
itself. When upstream's own ``packed_tensor.py`` is importable (the device
harness carries it, see ``tools/fork/device/prepare.sh``), packed chunks are
also read with its ``packed_ipc_consumer``. Needs an NVIDIA GPU."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest
import torch

from vllm.distributed.weight_transfer import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc.trainer import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The fields upstream 0.32's IPCWeightTransferUpdateInfo has.
UPSTREAM_FIELDS = {
    "names",
    "dtype_names",
    "shapes",
    "ipc_handles",
    "ipc_handles_pickled",
    "tensor_sizes",
}


def _read_as_upstream(msg: dict, uuid: str) -> dict[str, torch.Tensor]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def rebuild(args: tuple) -> torch.Tensor:
        on_this_device = list(args)
        on_this_device[6] = 0  # the worker's own device index
        return rebuild_cuda_tensor(*on_this_device)

    handles = msg["ipc_handles"]
    out: dict[str, torch.Tensor] = {}
    if isinstance(handles, dict):  # packed: one flat buffer
        buf = rebuild(handles[uuid])
        offset = 0
        for name, dtype_name, shape, size in zip(
            msg["names"],
            msg["dtype_names"],
            msg["shapes"],
            msg["tensor_sizes"],
            strict=True,
        ):
            raw = buf[offset : offset + size]
            offset += size
            out[name] = raw.view(getattr(torch, dtype_name)).view(shape).cpu()
        return out
    for name, dtype_name, shape, hmap in zip(
        msg["names"], msg["dtype_names"], msg["shapes"], handles, strict=True
    ):
        tensor = rebuild(hmap[uuid])
        assert tensor.dtype == getattr(torch, dtype_name), name
        assert list(tensor.shape) == list(shape), name
        out[name] = tensor.cpu()
    return out


def _read_with_upstream_consumer(msg: dict, importer) -> dict[str, torch.Tensor]:
    from packed_tensor_upstream import packed_ipc_consumer

    return {
        name: tensor.cpu()
        for name, tensor in packed_ipc_consumer(
            msg["ipc_handles"],
            msg["names"],
            msg["shapes"],
            msg["dtype_names"],
            msg["tensor_sizes"],
            0,
            importer=importer,
        )
    }


def _read_as_fork(msg: dict, importer) -> dict[str, torch.Tensor]:
    from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo

    info = IPCWeightTransferUpdateInfo.from_dict(msg)
    assert info.upstream_wire
    bufs = [
        importer.open(importer.select(hmap, "ipc_handles")[1])
        for hmap in info.buffers()
    ]
    out = {}
    for v in info.views():
        raw = bufs[v.buffer][v.offset : v.offset + v.nbytes]
        out[v.name] = raw.view(v.dtype).view(v.shape).cpu()
    del bufs
    if not info.packed:
        importer.close()
    return out


def _reader(conn) -> None:
    """Second process: read every message three ways, send back CPU copies."""
    from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter

    torch.cuda.set_device(0)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    fork_importer = BufferImporter(torch.device("cuda", 0), local_rank=0)
    try:
        from packed_tensor_upstream import PackedBufferImporter

        upstream_importer = PackedBufferImporter()
    except ImportError:
        upstream_importer = None
    for msg in iter(conn.recv, None):
        if msg == "finish":
            fork_importer.close()
            if upstream_importer is not None:
                upstream_importer.close()
            conn.send(("ok", None))
            continue
        try:
            extra = set(msg) - UPSTREAM_FIELDS
            assert not extra, f"fields upstream's worker refuses: {sorted(extra)}"
            got = {"upstream": _read_as_upstream(msg, uuid)}
            if upstream_importer is not None and isinstance(msg["ipc_handles"], dict):
                got["upstream_consumer"] = _read_with_upstream_consumer(
                    msg, upstream_importer
                )
            got["fork"] = _read_as_fork(msg, fork_importer)
            torch.cuda.synchronize()
            conn.send(("ok", got))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PipeClient:
    """Upstream's four-method client whose update_weights is read elsewhere."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.received: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: list[str] = []
        self.init_infos: list[dict] = []

    def init_weight_transfer_engine(self, init_info):
        self.init_infos.append(init_info)

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        self.conn.send(update_info)  # pickled by the pipe, as Ray would
        if not self.conn.poll(120):
            raise TimeoutError("the reader did not answer within 120 s")
        status, got = self.conn.recv()
        if status != "ok":
            raise RuntimeError(got)
        for reader, tensors in got.items():
            self.received.setdefault(reader, {}).update(tensors)

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self.conn.send("finish")
        assert self.conn.poll(120), "the reader did not answer finish"
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
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


@pytest.mark.parametrize("packed", [True, False])
def test_upstream_wire_is_read_bit_for_bit_as_upstream_reads_it(reader, packed):
    gen = torch.Generator(device="cuda").manual_seed(3)
    tensors = {
        f"layers.{i}.w": torch.randn(16, 24, device="cuda", generator=gen)
        for i in range(4)
    }
    tensors.update(
        {
            f"layers.{i}.b": torch.randn(40, device="cuda", generator=gen).to(
                torch.bfloat16
            )
            for i in range(4)
        }
    )
    client = PipeClient(reader)
    info = IPCTrainerInitInfo(
        rank=0,
        packed=packed,
        wire="upstream",
        # several chunks: each tensor is 1,536 or 80 bytes
        packed_buffer_size_bytes=4096,
    )
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        init_info=info, client=client, source=CudaSource(tensors)
    )
    assert client.init_infos == [{"packed": packed}]
    assert not engine.verify_publication
    engine.send_weights()
    engine.send_weights()  # the buffer and its handle are reused
    assert client.calls[0] == "start" and client.calls[-1] == "finish"
    if packed:
        assert client.calls.count("update") >= 4  # several chunks per sync
        assert engine.last_plan is not None and not engine.last_plan.overlapped
    readers = {"upstream", "fork"}
    if packed and importlib.util.find_spec("packed_tensor_upstream") is not None:
        readers.add("upstream_consumer")  # upstream 0.32's own code read it
    assert set(client.received) == readers
    expected = {n: t.cpu() for n, t in tensors.items()}
    for reader_name, got in client.received.items():
        assert set(got) == set(expected), reader_name
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, (reader_name, name)
            assert torch.equal(got[name], tensor), (reader_name, name)
    engine.shutdown()
