# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream 0.32's ipc handles on a GPU: ``reduce_tensor`` tuples exported the
way upstream's trainer exports them (one per tensor, or one flat uint8 buffer
with tensors back to back, unaligned) are read bit for bit by a second process
through the fork's wire parsing and CUDA importer. Needs an NVIDIA GPU."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _reader(conn) -> None:
    """Second process: read every update as the worker engine does."""
    from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
    from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo

    torch.cuda.set_device(0)
    importer = BufferImporter(torch.device("cuda", 0), local_rank=0)
    for msg in iter(conn.recv, None):
        try:
            info = IPCWeightTransferUpdateInfo.from_dict(msg)
            assert info.upstream_wire
            bufs = [
                importer.open(importer.select(hmap, "ipc_handles")[1])
                for hmap in info.buffers()
            ]
            out = {}
            for v in info.views():
                raw = bufs[v.buffer][v.offset : v.offset + v.nbytes]
                if v.offset % v.dtype.itemsize:
                    raw = raw.clone()
                out[v.name] = raw.view(v.dtype).view(v.shape).cpu()
            torch.cuda.synchronize()
            del bufs
            importer.close()
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def test_upstream_handles_are_read_bit_for_bit():
    from torch.multiprocessing.reductions import reduce_tensor

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()
    try:
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        w = torch.randn(8, 16, device="cuda")
        base = torch.randn(100, device="cuda").to(torch.bfloat16)
        view = base[10:40]  # at a storage offset
        torch.cuda.synchronize()
        parent.send(
            {
                "names": ["w", "v"],
                "dtype_names": ["float32", "bfloat16"],
                "shapes": [[8, 16], [30]],
                "ipc_handles": [
                    {uuid: reduce_tensor(w)[1]},
                    {uuid: reduce_tensor(view)},  # the (rebuild_fn, args) pair
                ],
                "ipc_handles_pickled": None,
            }
        )
        status, got = parent.recv()
        assert status == "ok", got
        assert torch.equal(got["w"], w.cpu())
        assert torch.equal(got["v"], view.cpu())

        a = torch.randn(3, device="cuda").to(torch.bfloat16)  # 6 bytes
        b = torch.randn(5, device="cuda")  # 20 bytes at offset 6
        buf = torch.zeros(64, dtype=torch.uint8, device="cuda")
        buf[:6].copy_(a.view(torch.uint8))
        buf[6:26].copy_(b.view(torch.uint8))
        torch.cuda.synchronize()
        parent.send(
            {
                "names": ["a", "b"],
                "dtype_names": ["bfloat16", "float32"],
                "shapes": [[3], [5]],
                "tensor_sizes": [6, 20],
                "ipc_handles": {uuid: reduce_tensor(buf)[1]},
            }
        )
        status, got = parent.recv()
        assert status == "ok", got
        assert torch.equal(got["a"], a.cpu())
        assert torch.equal(got["b"], b.cpu())
    finally:
        parent.send(None)
        proc.join(timeout=60)
