# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA data plane's test rig: a second process that reads each update as a
worker engine does (it checks the header, checksums the mapped bytes on the
GPU when asked and attests with a receipt at finish), the pipe client that
drives it, and the sources the trainer sends from."""

from __future__ import annotations

import json

import torch

from vllm.distributed.weight_transfer import ParamMeta, WeightSource


def _reader(conn) -> None:
    """Second process: import every update's buffers and send back CPU copies."""
    from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
    from vllm.distributed.weight_transfer.ipc.layout_memo import LayoutMemo
    from vllm.distributed.weight_transfer.verification import (
        WorkerPublication,
        device_identity,
        is_prepare_request,
    )

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    importer = BufferImporter(device, local_rank=0)
    pub = WorkerPublication(
        backend="ipc", worker_rank=0, worker_device=device_identity(device)
    )
    prepared = None  # the receipt written at the prepare message
    # As the worker engine parses: a short message names a layout parsed before.
    layouts = LayoutMemo()
    while True:
        msg = conn.recv()
        if msg is None:
            importer.close()
            conn.send(("closed", None))
            return
        if msg == "start":
            pub.start()
            layouts.discard()
            prepared = None
            conn.send(("ok", None))
            continue
        if msg == "drop":
            importer.close()
            layouts.discard()
            pub.fail(RuntimeError("aborted"), weights_intact=True)
            conn.send(("ok", None))
            continue
        if msg == "stats":
            conn.send(("ok", (importer.mappings_opened, len(importer.kept()))))
            continue
        if msg == "short_messages":
            conn.send(("ok", layouts.compact))
            continue
        if msg == "finish":  # as the worker engine does at finish_weight_update
            importer.close(keep_persistent=True)
            try:
                # The receipt went out at the trainer's prepare message.
                receipt = pub.finish() or prepared
            except Exception as e:  # a failed update: report, keep serving
                layouts.discard()
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            layouts.commit()
            conn.send(("ok", receipt.checksums_verified if receipt else None))
            continue
        try:
            update_info = json.loads(msg)
            if is_prepare_request(update_info):
                # The trainer's prepare message: the receipt is written now.
                prepared = pub.prepare()
                conn.send(("ok", ([], {})))
                continue
            info = layouts.parse(pub.begin_message(update_info))
            keys, bufs = [], []
            for hmap in info.buffers():
                key, handle = importer.select(hmap, "ipc_handles")
                keys.append(key)
                bufs.append(importer.open(handle))
            out = {}
            for i, buf in enumerate(bufs):
                # What the trainer checksummed: the chunk's own bytes, which
                # start mid-buffer for a chunk in the second half (overlap).
                mine = [v for v in info.views() if v.buffer == i]
                start = min(v.offset for v in mine)
                end = max(v.offset + v.nbytes for v in mine)
                pub.check_buffer(i, buf[start:end])
            for v in info.views():
                pub.admit(v.name, v.dtype, v.shape, v.nbytes)
                raw = bufs[v.buffer][v.offset : v.offset + v.nbytes]
                out[v.name] = raw.view(v.dtype).view(v.shape).cpu()
                pub.landed(v.name, v.nbytes)
            torch.cuda.synchronize()
            layouts.landed(info)
            del bufs, raw
            if not info.packed:
                importer.close()
            conn.send(("ok", (keys, out)))
        except Exception as e:  # report, keep serving
            pub.fail(e, weights_intact=True)
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _answer(conn, what: str):
    """The reader's answer, or an error if it does not come (a dead reader
    would otherwise leave the test waiting forever)."""
    if not conn.poll(120):
        raise TimeoutError(f"the reader did not answer {what} within 120 s")
    return conn.recv()


class PipeWorker:
    """A client whose update_weights runs in the reader process."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.received: dict[str, torch.Tensor] = {}
        self.keys: set[str] = set()
        self.calls: list[str] = []
        self.versions: list[str] = []
        self.checksums_verified: int | None = None
        # Raise on the next update_weights call (a failing transport).
        self.fail_next = False

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")
        self.conn.send("start")
        assert _answer(self.conn, "start") == ("ok", None)

    def update_weights(self, update_info):
        self.calls.append("update" if "abort" not in update_info else "abort")
        if "abort" in update_info:
            # As the worker engine does on a failed update: drop every mapping.
            self.conn.send("drop")
            assert _answer(self.conn, "drop") == ("ok", None)
            return
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.conn.send(json.dumps(update_info))  # the wire is plain JSON
        status, payload = _answer(self.conn, "update_weights")
        if status != "ok":
            raise RuntimeError(payload)
        keys, tensors = payload
        self.keys.update(keys)
        self.received.update(tensors)

    def finish_weight_update(self, weight_version=None):
        # The trainer hands the new version to the commit itself.
        if weight_version is not None:
            self.versions.append(weight_version)
        self.calls.append("finish")
        self.conn.send("finish")
        status, answer = _answer(self.conn, "finish")
        assert status == "ok", answer
        self.checksums_verified = answer

    def update_weight_version(self, new_version):
        self.versions.append(new_version)

    def get_world_size(self):
        return 1


class CudaSource(WeightSource):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        yield from self.tensors.items()


def _stats(reader) -> tuple[int, int]:
    """(mappings the reader opened so far, mappings it keeps now)."""
    reader.send("stats")
    status, stats = _answer(reader, "stats")
    assert status == "ok"
    return tuple(stats)
