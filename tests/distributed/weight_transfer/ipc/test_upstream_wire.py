# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream vLLM 0.32's ipc wire against the fork's worker and HTTP client.

Upstream sends ``reduce_tensor`` argument tuples (CUDA IPC) in ``ipc_handles``,
pickled into ``ipc_handles_pickled`` over HTTP. The worker unpickles only
under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, reads the tuples as the fork's
CUDA handles, and refuses them on a CPU worker with a message saying why. The
HTTP client pickles raw tuples as upstream's does and never the fork's JSON
handles. The tuples here are built by hand (a CPU machine cannot export CUDA
memory); their layout is ``reduce_tensor``'s."""

from __future__ import annotations

import base64
import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer.buffers.handles import (
    CudaIpcHandle,
    cpu_device_key,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc.upstream_wire import (
    upstream_args,
    upstream_handle,
)
from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def reduce_args(
    size=(4, 4), stride=(4, 1), offset=2, dtype=torch.float32, storage_bytes=1024
) -> tuple:
    """What ``reduce_tensor(t)[1]`` returns for a CUDA tensor ``t``."""
    return (
        torch.Tensor,
        torch.Size(size),
        stride,
        offset,
        torch.storage.TypedStorage,
        dtype,
        0,
        b"\x01" * 64,
        storage_bytes,
        0,
        False,
        b"/torch_1_2",
        3,
        None,
        True,
    )


def unpacked_message(**overrides):
    msg = {
        "names": ["w"],
        "dtype_names": ["float32"],
        "shapes": [[4, 4]],
        "ipc_handles": [{UUID: reduce_args()}],
    }
    msg.update(overrides)
    return msg


def pickled(handles) -> str:
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def test_pickled_handles_are_refused_without_the_flag(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    msg = unpacked_message(ipc_handles=None)
    msg["ipc_handles_pickled"] = pickled([{UUID: reduce_args()}])
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        IPCWeightTransferUpdateInfo.from_dict(msg)


def test_pickled_handles_are_read_with_the_flag(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    handles = [{UUID: reduce_args()}]
    msg = unpacked_message(ipc_handles=None)
    msg["ipc_handles_pickled"] = pickled(handles)
    info = IPCWeightTransferUpdateInfo.from_dict(msg)
    assert info.upstream_wire and info.ipc_handles_pickled is None
    assert info.ipc_handles == handles
    handle = info.buffers()[0][UUID]
    assert isinstance(handle, CudaIpcHandle)
    # 16 float32 elements from element 2 of the storage: bytes [8, 72)
    assert (handle.nbytes, handle.tensor_offset) == (64, 8)
    assert handle.event_handle is None and handle.ref_counter_offset == 3


def test_a_none_pickled_field_is_no_field(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    info = IPCWeightTransferUpdateInfo.from_dict(
        {**unpacked_message(), "ipc_handles_pickled": None}
    )
    assert info.upstream_wire


def test_both_handle_fields_are_refused(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    msg = unpacked_message()
    msg["ipc_handles_pickled"] = pickled(msg["ipc_handles"])
    with pytest.raises(ValueError, match="Cannot specify both"):
        IPCWeightTransferUpdateInfo.from_dict(msg)


def test_the_whole_reduce_tensor_pair_is_accepted():
    info = IPCWeightTransferUpdateInfo.from_dict(
        unpacked_message(ipc_handles=[{UUID: (print, reduce_args())}])
    )
    assert info.buffers()[0][UUID].nbytes == 64


def test_packed_upstream_tensors_lie_back_to_back_unaligned():
    buffer = reduce_args(size=(1000,), stride=(1,), offset=0, dtype=torch.uint8)
    info = IPCWeightTransferUpdateInfo.from_dict(
        {
            "names": ["a", "b"],
            "dtype_names": ["bfloat16", "float32"],
            "shapes": [[3], [2]],
            "tensor_sizes": [6, 8],
            "ipc_handles": {UUID: buffer},
        }
    )
    assert [v.offset for v in info.views()] == [0, 6]
    assert info.buffers()[0][UUID].nbytes == 1000


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (reduce_args(stride=(1, 4)), "non-contiguous"),
        (reduce_args(size=(8, 8), stride=(8, 1), storage_bytes=64), "storage"),
        (reduce_args()[:14], "15 arguments"),
        (
            reduce_args(size=(2, 2), stride=(2, 1)),
            r"covers 16 bytes but the tensor needs 64",
        ),
    ],
)
def test_malformed_upstream_handles_are_refused_when_read(args, match):
    info = IPCWeightTransferUpdateInfo.from_dict(
        unpacked_message(ipc_handles=[{UUID: args}])
    )
    with pytest.raises(ValueError, match=match):
        info.buffers()


def test_json_and_upstream_handles_do_not_mix():
    shm = {"kind": "shm", "name": "vllm-wt-1-a", "nbytes": 64}
    msg = unpacked_message(
        names=["w", "v"],
        dtype_names=["float32"] * 2,
        shapes=[[4, 4]] * 2,
        ipc_handles=[{UUID: reduce_args()}, {cpu_device_key(0): shm}],
    )
    with pytest.raises(ValueError, match="not both"):
        IPCWeightTransferUpdateInfo.from_dict(msg)


def test_upstream_args_round_trip():
    handle = upstream_handle(reduce_args(), "h")
    again = upstream_handle(upstream_args(handle), "h")
    assert again == handle


def make_engine(device: torch.device) -> IPCWeightTransferEngine:
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(dtype=None, model=None),
    )
    return IPCWeightTransferEngine(
        SimpleNamespace(backend="ipc"),
        vllm_config,
        device,
        torch.nn.Linear(4, 4),
    )


def test_the_engine_is_built_without_touching_its_device():
    engine = make_engine(torch.device("cuda"))
    assert engine._pub is None


def test_a_cpu_worker_refuses_upstream_handles_and_says_why():
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    engine = make_engine(torch.device("cpu"))
    record_metadata_for_reloading(engine.model)
    engine.start_weight_update()
    with pytest.raises(ValueError, match="CUDA IPC handles; this worker runs on cpu"):
        engine.update_weights(unpacked_message(names=["weight"]))
    engine.start_weight_update()
    engine.finish_weight_update()


def test_http_client_pickles_only_raw_handles(monkeypatch):
    sent = []
    monkeypatch.setattr(
        HTTPVLLMWeightSyncClient,
        "_post",
        lambda self, route, body=None: sent.append(body),
    )
    client = HTTPVLLMWeightSyncClient("http://localhost:1")
    shm = {"kind": "shm", "name": "vllm-wt-1-a", "nbytes": 64}
    fork = {"names": ["w"], "ipc_handles": {cpu_device_key(0): shm}}
    raw = {"names": ["w"], "ipc_handles": [{UUID: reduce_args()}]}
    client.update_weights([fork, raw])
    fork_sent, raw_sent = sent[0]["update_info"]
    assert fork_sent == fork and "ipc_handles_pickled" not in json.dumps(fork_sent)
    assert "ipc_handles" not in raw_sent
    decoded = pickle.loads(base64.b64decode(raw_sent["ipc_handles_pickled"]))
    assert decoded == raw["ipc_handles"]
