# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ipc trainer engine against a loopback worker (no vLLM engine): bytes
arrive intact in both modes, chunks are flushed before the next tensor is
materialized, and a source that disagrees with its metadata is rejected naming
the tensor, with the server told to abort. The loopback checks the publication
header and attests with a receipt like a worker engine, so the trainer's
verified-publication steps run too: the version is stamped only after the
receipt verified, checksums catch a changed byte, and a failure fences the
served version."""

import gc
import json
import os
import time
import weakref

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
from vllm.distributed.weight_transfer.buffers.shm import SHM_DIR
from vllm.distributed.weight_transfer.ipc.wire import IPCWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import (
    ChecksumMismatch,
    WeightState,
    WorkerPublication,
    is_fenced_version,
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
            gc.collect()
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


def shm_files():
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"vllm-wt-{os.getpid()}-")}


@pytest.mark.parametrize("packed", [True, False])
def test_every_tensor_arrives_bit_exact(packed):
    tensors = model_tensors()
    events: list = []
    client = LoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=300),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights(weight_version="v1")
    assert client.init_info == {"packed": packed}
    assert client.calls[0] == "init" and client.calls[1] == "start"
    # the receipt is verified after prepare, then the commit stamps the version
    assert client.calls[-2:] == ["prepare", "finish:v1"]
    assert client.versions == ["v1"]
    assert engine.last_plan is not None
    assert client.calls.count("update") == len(engine.last_plan.chunks) > 1
    assert list(client.received) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    # a CPU packed buffer is kept for the next sync until shutdown
    assert len(shm_files()) == (1 if packed else 0)
    engine.shutdown()
    assert shm_files() == set()


def test_the_shared_memory_buffer_is_reused_across_syncs_until_shutdown():
    tensors = model_tensors()
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=300),
        client=client,
        source=RecordingSource(tensors, []),
    )
    engine.send_weights()
    kept = shm_files()
    assert len(kept) == 1
    for t in tensors.values():
        t.add_(1)
    engine.send_weights()
    assert shm_files() == kept
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    engine.shutdown()
    assert shm_files() == set()


def test_keep_packed_buffer_false_frees_the_buffer_after_each_sync():
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, keep_packed_buffer=False),
        client=LoopbackClient(),
        source=RecordingSource(model_tensors(), []),
    )
    engine.send_weights()
    assert shm_files() == set()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_a_chunk_is_sent_before_its_buffer_half_is_filled_again(overlap):
    """In turn, each chunk's update call comes before the next tensor is
    materialized. Overlapped, the call runs on a helper thread while the next
    chunk fills the other half, so the order there is only: chunk k's call
    has happened before chunk k+2 (the same half) starts to fill. Either way
    at most the tensor being copied is alive when the next one is asked for."""
    tensors = model_tensors(8)
    events: list = []
    client = LoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=400,
            overlap_chunks=overlap,
        ),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights()
    plan = engine.last_plan
    assert plan is not None
    order = [e[:2] for e in events]
    if not overlap:
        expected: list[tuple] = []
        for chunk in plan.chunks:
            expected += [("materialize", n) for n in chunk.names]
            expected.append(("update", tuple(chunk.names)))
        assert order == expected
    else:
        assert len(plan.chunks) >= 3
        assert sorted(order) == sorted(
            [("materialize", n) for c in plan.chunks for n in c.names]
            + [("update", tuple(c.names)) for c in plan.chunks]
        )
        for k in range(len(plan.chunks) - 2):
            sent = order.index(("update", tuple(plan.chunks[k].names)))
            refill = order.index(("materialize", plan.chunks[k + 2].names[0]))
            assert sent < refill, k
    assert max(e[2] for e in events if e[0] == "materialize") == 0


def test_drop_in_upstream_call_works_through_the_factory():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    client = LoopbackClient()
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(model),
    ).send_weights()
    for name, p in model.named_parameters():
        assert torch.equal(client.received[name], p.detach())
    assert client.calls == ["init", "start", "update", "prepare", "finish"]


def test_trainer_init_needs_a_source():
    with pytest.raises(ValueError, match="needs source="):
        IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=LoopbackClient()
        )


def test_init_info_rejects_bad_sizes():
    with pytest.raises(ValueError, match="packed_buffer_size_bytes must be positive"):
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        IPCTrainerInitInfo(rank=0, timeout_s=0)


def _bad_sources(tensors):
    names = list(tensors)
    items = list(tensors.items())
    t0 = tensors[names[0]]
    return {
        "name": (
            None,
            [("wrong.name", t0)] + items[1:],
            r"yielded 'wrong.name' where metadata\(\) announced 'layers.0.weight'",
        ),
        "order": (
            None,
            [items[1], items[0]] + items[2:],
            "yielded 'layers.1.weight' where metadata.. announced 'layers.0.weight'",
        ),
        "shape": (
            {names[0]: ParamMeta(names[0], t0.dtype, (4, 8))},
            None,
            r"'layers.0.weight' with shape \[8, 4\] but metadata\(\) says \[4, 8\]",
        ),
        "dtype": (
            {names[0]: ParamMeta(names[0], torch.float16, tuple(t0.shape))},
            None,
            r"'layers.0.weight' as float32 but metadata\(\) says float16",
        ),
        "too_few": (None, items[:-1], "stopped before 'norm.weight'"),
        "too_many": (None, items + [("extra", t0)], "yielded 'extra' after the"),
    }


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
    "case", ["name", "order", "shape", "dtype", "too_few", "too_many"]
)
def test_source_disagreeing_with_metadata_is_rejected_and_aborted(case, packed):
    tensors = model_tensors(3)
    meta_override, yield_override, match = _bad_sources(tensors)[case]
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=packed),
        client=client,
        source=RecordingSource(tensors, [], meta_override, yield_override),
    )
    with pytest.raises(ValueError, match=match):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()


def test_server_failure_is_raised_and_the_update_aborted():
    class FailingClient(LoopbackClient):
        def update_weights(self, update_info):
            if "abort" in update_info:
                return super().update_weights(update_info)
            raise RuntimeError("worker said no")

    client = FailingClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=client,
        source=RecordingSource(model_tensors(2), []),
    )
    with pytest.raises(RuntimeError, match="worker said no"):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()
    assert len(client.versions) == 1 and is_fenced_version(client.versions[0])
    assert "worker said no" in client.versions[0]


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


def test_resident_parameters_are_packed_with_a_fused_copy_bit_exact():
    """Parameters (and views of them) cost no memory to hold, so a chunk's copies
    from them are batched; the bytes still arrive exactly, across chunks and
    mixed dtypes, and a second send sees in-place changes."""
    module = torch.nn.Module()
    for name, t in model_tensors().items():
        module.register_parameter(
            name.replace(".", "_"), torch.nn.Parameter(t, requires_grad=False)
        )
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=300),
        client=client,
        source=ModuleSource(module),
    )
    for step in range(2):
        engine.send_weights()
        assert engine.last_plan is not None and len(engine.last_plan.chunks) > 1
        for name, p in module.named_parameters():
            assert torch.equal(client.received[name], p.detach()), (step, name)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-2)


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


class SlowLoopbackClient(LoopbackClient):
    """A loopback whose updates take a while and record when they run, and
    whether two calls ever overlapped. With ``await_materialized``, update
    ``k`` waits (up to 10 s) until the source has materialized more than
    ``await_materialized * k`` tensors (when fewer than ``total_tensors``) and
    records whether that happened."""

    def __init__(
        self, events, fail_on_update=None, await_materialized=None, total_tensors=0
    ):
        super().__init__(events)
        self.total_tensors = total_tensors
        self.active = 0
        self.max_active = 0
        self.fail_on_update = fail_on_update
        self.updates = 0
        self.await_materialized = await_materialized
        self.saw_next_chunk: list[bool] = []

    def _materialized(self):
        return sum(1 for e in list(self.events) if e[0] == "materialize")

    def update_weights(self, update_info):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if "abort" not in update_info:
                self.updates += 1
                self.events.append(("update-begin", self.updates))
                time.sleep(0.05)
                target = (self.await_materialized or 0) * self.updates
                if self.await_materialized and target < self.total_tensors:
                    deadline = time.monotonic() + 10.0
                    while (
                        self._materialized() <= target and time.monotonic() < deadline
                    ):
                        time.sleep(0.01)
                    self.saw_next_chunk.append(self._materialized() > target)
                if self.updates == self.fail_on_update:
                    raise RuntimeError(f"update {self.updates} failed")
            super().update_weights(update_info)
            if "abort" not in update_info:
                self.events.append(("update-end", self.updates))
        finally:
            self.active -= 1


def small_tensors(n=12):
    gen = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(16, 4, generator=gen) for i in range(n)}  # 256 B


def test_overlap_packs_the_next_chunk_while_the_last_one_loads():
    tensors = small_tensors()
    events: list = []
    # two tensors per chunk: update k waits for chunk k + 1's first tensor
    client = SlowLoopbackClient(events, await_materialized=2, total_tensors=12)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024),
        client=client,
        source=RecordingSource(tensors, events),
    )
    engine.send_weights()
    plan = engine.last_plan
    assert plan is not None and plan.overlapped and len(plan.chunks) == 6
    for name, t in tensors.items():
        assert torch.equal(client.received[name], t), name
    assert client.max_active == 1  # never two update calls at once
    # while update k ran, the trainer materialized chunk k + 1
    assert client.saw_next_chunk == [True] * 5
    assert len(shm_files()) == 1  # the buffer is kept for the next sync
    engine.shutdown()
    assert shm_files() == set()


def test_overlap_off_sends_one_chunk_at_a_time():
    events: list = []
    client = SlowLoopbackClient(events)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024, overlap_chunks=False),
        client=client,
        source=RecordingSource(small_tensors(), events),
    )
    engine.send_weights()
    assert engine.last_plan is not None and not engine.last_plan.overlapped
    for k in range(1, client.updates + 1):
        begin = events.index(("update-begin", k))
        end = events.index(("update-end", k))
        assert not any(e[0] == "materialize" for e in events[begin:end])
    engine.shutdown()


def test_a_failing_update_in_flight_is_raised_and_aborted_after_it_returns():
    events: list = []
    client = SlowLoopbackClient(events, fail_on_update=2)
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=1024),
        client=client,
        source=RecordingSource(small_tensors(), events),
    )
    with pytest.raises(RuntimeError, match="update 2 failed"):
        engine.send_weights()
    assert client.max_active == 1
    assert client.updates == 2  # nothing sent after the failure
    assert client.calls[-2:] == ["abort", "finish"]
    assert shm_files() == set()  # a failed sync drops the kept buffers
    assert is_fenced_version(client.versions[-1])


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


def test_upstream_wire_refuses_cpu_tensors_and_aborts():
    client = LoopbackClient()
    engine = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, wire="upstream"),
        client=client,
        source=RecordingSource(model_tensors(), []),
    )
    assert not engine.verify_publication  # upstream's worker has no receipts
    with pytest.raises(ValueError, match="wire='upstream' sends CUDA IPC handles"):
        engine.send_weights()
    assert client.calls[-2:] == ["abort", "finish"]
    engine.shutdown()


def test_upstream_wire_plans_tensors_back_to_back_one_chunk_at_a_time():
    source = RecordingSource(model_tensors(), [])  # float32 and bfloat16, odd sizes
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(),
        source=source,
        wire="upstream",
        packed_buffer_size_bytes=300,
    )
    plan = engine._plan_for(list(source.metadata()))
    assert plan.packed and not plan.overlapped and len(plan.chunks) > 1
    for fields, chunk in zip(engine._chunk_fields, plan.chunks, strict=True):
        # no field upstream 0.32's IPCWeightTransferUpdateInfo lacks
        assert set(fields) == {"names", "dtype_names", "shapes", "tensor_sizes"}
        assert chunk.slots[0].offset == 0
        ends = [s.offset + s.nbytes for s in chunk.slots]
        assert [s.offset for s in chunk.slots[1:]] == ends[:-1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"wire": "grpc"}, "wire must be 'fork' or 'upstream'"),
        ({"wire": "upstream", "verify_checksums": True}, "needs wire='fork'"),
    ],
)
def test_init_info_rejects_a_bad_wire(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IPCTrainerInitInfo(rank=0, **kwargs)


def test_engine_options_live_in_one_init_info():
    source = RecordingSource(model_tensors(), [])
    # upstream's keyword arguments
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(), source=source, packed=False
    )
    assert engine.init_info == IPCTrainerInitInfo(rank=0, packed=False)
    assert not engine.packed
    # keywords override the fields of a given init info
    base = IPCTrainerInitInfo(rank=2, overlap_chunks=False, timeout_s=5.0)
    engine = IPCTrainerWeightTransferEngine(
        client=LoopbackClient(),
        source=source,
        is_sender=False,
        init_info=base,
        packed_buffer_size_bytes=1024,
    )
    assert engine.init_info == IPCTrainerInitInfo(
        rank=2, overlap_chunks=False, timeout_s=5.0, packed_buffer_size_bytes=1024
    )
    assert engine.rank == 2
    with pytest.raises(TypeError):
        IPCTrainerWeightTransferEngine(
            client=LoopbackClient(), source=source, no_such_option=1
        )
