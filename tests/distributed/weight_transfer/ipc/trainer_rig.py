# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc trainer engine's test rig: a loopback worker that reads each update
from the shared memory the trainer exported, checks its publication header and
attests with a receipt like a worker engine (no vLLM engine), and the sources
and tensors the trainer tests send."""

import atexit
import gc
import json
import weakref

import torch

from vllm.distributed.weight_transfer import (
    ParamMeta,
    WeightSource,
)
from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.verification import (
    WeightState,
    WorkerPublication,
    is_prepare_request,
)


class LoopbackClient:
    """Plays one worker: checks each update's publication header, copies its
    tensors from JSON, and attests with a receipt at finish. ``corrupt`` is
    called with each mapped buffer before it is read (fault injection)."""

    def __init__(self, events=None, corrupt=None):
        self.events = events if events is not None else []
        self.calls = []
        self.received = {}
        self.init_info = None
        self.versions = []
        self.corrupt = corrupt
        self.pub = WorkerPublication(
            backend="ipc", worker_rank=0, worker_device="cpu:loopback:0"
        )

    def init_weight_transfer_engine(self, init_info):
        self.init_info = init_info
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")
        self.pub.start()

    def update_weights(self, update_info):
        if "abort" in update_info:
            self.calls.append("abort")
            if self.pub.fence.state == WeightState.UPDATING:
                self.pub.fail(update_info["abort"], weights_intact=True)
            return
        if is_prepare_request(update_info):
            self.calls.append("prepare")
            self.pub.prepare()
            return
        self.calls.append("update")
        message = self.pub.begin_message(json.loads(json.dumps(update_info)))
        info = IPCWeightTransferUpdateInfo.from_dict(message)
        self.events.append(("update", tuple(info.names)))
        importer = BufferImporter(torch.device("cpu"), local_rank=0, writable=True)
        handles = [importer.select(b, "ipc_handles")[1] for b in info.buffers()]
        buffers = [importer.open(h) for h in handles]
        try:
            for i, buf in enumerate(buffers):
                if self.corrupt is not None:
                    self.corrupt(buf)
                mine = [v for v in info.views() if v.buffer == i]
                start = min(v.offset for v in mine)
                end = max(v.offset + v.nbytes for v in mine)
                self.pub.check_buffer(i, buf[start:end])
            self.pub.touch()  # as an in-place worker: the weights change now
            for v in info.views():
                self.pub.admit(v.name, v.dtype, v.shape, v.nbytes)
                raw = buffers[v.buffer][v.offset : v.offset + v.nbytes]
                self.received[v.name] = raw.view(v.dtype).view(v.shape).clone()
                self.pub.landed(v.name, v.nbytes)
        except BaseException as e:
            self.pub.fail(e, weights_intact=True)
            raise
        finally:
            del buffers
            importer.close()

    def finish_weight_update(self, weight_version=None):
        self.calls.append(
            "finish" if weight_version is None else f"finish:{weight_version}"
        )
        if self.pub.fence.state == WeightState.UPDATING:
            self.pub.finish()
        if weight_version is not None:  # upstream's finish sets the version
            self.versions.append(weight_version)

    def update_weight_version(self, new_version):
        self.versions.append(new_version)

    def get_world_size(self):
        return 1


_imports_frozen = False


def collect_garbage() -> None:
    """``gc.collect()`` over what the tests made. The first call freezes
    every object alive by then (``gc.freeze``: the imported modules of vLLM,
    torch and transformers, which a full collection would otherwise walk,
    about 0.3 s each time on a 2-core machine)."""
    global _imports_frozen
    if not _imports_frozen:
        gc.collect()
        gc.freeze()
        # Unfrozen at exit, so that the interpreter's last collection still
        # frees them (extension modules report what it leaves behind).
        atexit.register(gc.unfreeze)
        _imports_frozen = True
    gc.collect()


class RecordingSource(WeightSource):
    """Yields fresh copies of ``tensors`` and records when each is made."""

    def __init__(self, tensors, events, meta_override=None, yield_override=None):
        self.tensors = tensors
        self.events = events
        self.meta_override = meta_override or {}
        self.yield_override = yield_override
        self.alive = []

    def metadata(self):
        metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]
        return [self.meta_override.get(m.name, m) for m in metas]

    def __iter__(self):
        items = self.yield_override or list(self.tensors.items())
        for name, t in items:
            collect_garbage()
            live = [r for r in self.alive if r() is not None]
            self.events.append(("materialize", name, len(live)))
            fresh = t.clone()
            self.alive.append(weakref.ref(fresh))
            yield name, fresh
            del fresh


def model_tensors(n=6):
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        out[f"layers.{i}.weight"] = torch.randn(8, 4 + i, generator=gen).to(dtype)
    out["norm.weight"] = torch.randn(3, generator=gen)
    return out
