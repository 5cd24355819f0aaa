# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc trainer engine's verified publication against a loopback worker that
checks the header and attests with a receipt (no vLLM engine): the version is
stamped only after the receipt verified and counts up across engines,
checksums catch a changed byte, a client that cannot verify sends unverified
or is refused when checksums are asked, and one client over two engines needs
both receipts."""

import pytest
import torch

from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import (
    ChecksumMismatch,
    WorkerPublication,
    is_fenced_version,
    is_prepare_request,
)

from .trainer_rig import (
    LoopbackClient,
    RecordingSource,
    model_tensors,
)


@pytest.mark.parametrize("packed", [True, False])
def test_checksums_catch_a_byte_changed_after_export(packed):
    def flip(buf):
        buf[3] ^= 0x10

    client = LoopbackClient(corrupt=flip)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed, verify_checksums=True),
        client=client,
        source=RecordingSource(model_tensors(2), []),
    )
    with pytest.raises(ChecksumMismatch, match="changed in transit"):
        engine.send_weights(weight_version="v1")
    assert client.calls[-2:] == ["abort", "finish"]
    # The worker refused the first message before touching a weight, and its
    # failure receipt says so: the served version is left alone.
    assert client.versions == []


@pytest.mark.parametrize("packed", [True, False])
def test_checksummed_send_is_verified_by_the_receipt(packed):
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0, packed=packed, packed_buffer_size_bytes=300, verify_checksums=True
        ),
        client=client,
        source=RecordingSource(model_tensors(), []),
    )
    engine.send_weights(weight_version="v1")
    assert engine.last_publication is not None
    verified = engine.last_publication.verified
    assert verified is not None
    # one checksum per payload buffer: per chunk packed, per tensor unpacked
    buffers = client.calls.count("update") if packed else len(model_tensors())
    assert verified.checksums_verified == buffers
    assert client.versions == ["v1"]


def test_model_versions_increase_across_trainer_engines():
    client = LoopbackClient()
    versions = []
    for _ in range(2):  # a fresh trainer engine per send, as after a restart
        engine = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0),
            client=client,
            source=RecordingSource(model_tensors(1), []),
        )
        engine.send_weights(weight_version="step-1")  # a label, not the version
        assert engine.last_publication is not None
        versions.append(engine.last_publication.header.model_version)
    assert versions[0] < versions[1]


def test_explicit_model_versions_count_up_and_never_go_backwards():
    client = LoopbackClient()

    def trainer(start):
        return IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0, model_version=start),
            client=client,
            source=RecordingSource(model_tensors(1), []),
        )

    engine = trainer(5)
    engine.send_weights()
    engine.send_weights()
    assert engine.last_publication.header.model_version == 6
    # the worker refuses an older version before anything lands
    with pytest.raises(ValueError, match="versions never go backwards"):
        trainer(3).send_weights()


def test_init_info_checksums_need_the_publication():
    with pytest.raises(ValueError, match="verify_checksums needs verify_publication"):
        IPCTrainerInitInfo(rank=0, verify_checksums=True, verify_publication=False)


def test_a_client_without_the_verification_calls_sends_unverified(caplog):
    """A client written against upstream's four-method protocol still works."""

    class UpstreamStyleClient(LoopbackClient):  # no get_world_size / version
        get_world_size = None  # type: ignore[assignment]
        update_weight_version = None  # type: ignore[assignment]

    tensors = model_tensors(2)
    client = UpstreamStyleClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=client,
        source=RecordingSource(tensors, []),
    )
    assert not engine.verify_publication
    assert "without verified publication" in caplog.text
    engine.send_weights(weight_version="v7")
    assert client.calls[-1] == "finish:v7"
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name


def test_checksums_need_a_client_that_can_verify():
    class UpstreamStyleClient(LoopbackClient):
        get_world_size = None  # type: ignore[assignment]
        update_weight_version = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="verify_checksums needs"):
        IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0, verify_checksums=True),
            client=UpstreamStyleClient(),
            source=RecordingSource(model_tensors(1), []),
        )


class TwoEngineClient:
    """Two loopback engines behind one client, as a Ray client over two
    actors: every call goes to both, and each engine's one worker has rank 0
    on its own device."""

    def __init__(self, silent_second=False):
        self.engines = [LoopbackClient(), LoopbackClient()]
        self.handles = ["engine-a", "engine-b"]
        for i, engine in enumerate(self.engines):
            engine.pub = WorkerPublication(
                backend="ipc", worker_rank=0, worker_device=f"cpu:engine{i}:0"
            )
        self.silent_second = silent_second

    def _all(self, method, *args):
        for i, engine in enumerate(self.engines):
            if (
                method == "update_weights"
                and is_prepare_request(args[0])
                and i == 1
                and self.silent_second
            ):
                continue  # this engine never prepares: no receipt
            getattr(engine, method)(*args)

    def init_weight_transfer_engine(self, init_info):
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._all("start_weight_update")

    def update_weights(self, update_info):
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._all("finish_weight_update", weight_version)

    def update_weight_version(self, new_version):
        self._all("update_weight_version", new_version)

    def get_world_size(self):
        return 2


def test_one_client_over_two_engines_is_verified_by_both_receipts():
    tensors = model_tensors()
    client = TwoEngineClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=300),
        client=client,
        source=RecordingSource(tensors, []),
    )
    engine.send_weights(weight_version="v1")
    assert engine.last_publication is not None
    verified = engine.last_publication.verified
    assert verified is not None and verified.workers == (0, 0)
    for loopback in client.engines:
        assert loopback.versions == ["v1"]
        for name, t in tensors.items():
            assert torch.equal(loopback.received[name], t), name
    engine.shutdown()


def test_an_engine_without_a_receipt_fails_the_sync_naming_the_count():
    client = TwoEngineClient(silent_second=True)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, receipt_timeout_s=0.5),
        client=client,
        source=RecordingSource(model_tensors(), []),
    )
    with pytest.raises(TimeoutError, match="1 of 2 worker"):
        engine.send_weights(weight_version="v1")
    # Neither engine committed: the trainer aborted both instead of finishing.
    for one in client.engines:
        assert "finish:v1" not in one.calls
        assert one.calls[-2:] == ["abort", "finish"]
    assert is_fenced_version(client.engines[0].versions[-1])
