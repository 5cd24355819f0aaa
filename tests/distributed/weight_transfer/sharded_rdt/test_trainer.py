# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer engine with in-process producers and consumers: the worker init
payload, ownership checks, and a full send_weights round trip driven through a
fake client whose update_weights runs the consumers' pulls."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection
from typing import Any

import pytest
import torch
from torch import nn

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    WeightSource,
)
from vllm.distributed.weight_transfer.plan.ops import (
    SliceSpec,
    ViewOp,
    dtype_from_name,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.pull.chunks import build_pull_plan
from vllm.distributed.weight_transfer.pull.producer import Packed, Producer
from vllm.distributed.weight_transfer.pull.routing import RdtRouter
from vllm.distributed.weight_transfer.pull.transport import (
    InProcessTransport,
)
from vllm.distributed.weight_transfer.sharded_rdt.consumer import (
    choose_transport,
    planned_bytes,
)
from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
    ShardedRDTTrainerInitInfo,
    ShardedRDTTrainerWeightTransferEngine,
    ownership_table,
)
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.verification import (
    ChecksumMismatch,
    Manifest,
    ManifestMismatch,
    ReceiptTimeoutError,
    WeightState,
    WorkerPublication,
    abort_reason,
    is_fenced_version,
    is_prepare_request,
)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 8, bias=False)


def _expected(pulls: Any, header: Any, manifest: Any) -> dict[str, int]:
    return planned_bytes(pulls)


class Consumers:
    """A fake client: ``num_consumers`` in-process workers, each keeping the
    first row of every tensor, pulled during ``update_weights``. Each runs the
    worker side of verified publication (`WorkerPublication`) the way the
    sharded_rdt worker engine does, receipts to producer 0 included."""

    def __init__(self, num_consumers: int) -> None:
        self.num_consumers = num_consumers
        self.calls: list[str] = []
        self.received: list[dict[str, torch.Tensor]] = []
        self.live: list[int] | None = None
        self.versions: list[str] = []
        self.errors: list[BaseException] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = ShardedRDTWeightTransferInitInfo.from_dict(
            json.loads(json.dumps(init_info))  # the payload is JSON-safe
        )
        self.calls.append("init")
        self.info = info
        copies = []
        for name, shape in zip(info.names, info.shapes, strict=True):
            chain = (ViewOp("narrow", (0, 0, 1)),)
            out = (1, *shape[1:])
            stride = tuple(int(torch.ones(out).stride()[i]) for i in range(len(out)))
            copies.append(
                SliceCopy(
                    SliceSpec(name, chain, out, "float32"),
                    Region(name, "w", 0, out, stride, "float32"),
                )
            )
        plan = build_plan(worker="toy", names=info.names, copies=copies)
        router = RdtRouter(
            info.num_producers,
            self.num_consumers,
            info.owner_sets,
            info.name_owner_class,
            info.names,
            info.group_lens,
        )
        self.pulls = [
            build_pull_plan(plan, router, c) for c in range(self.num_consumers)
        ]
        self.links = []
        for cid, pulls in enumerate(self.pulls):
            transport = InProcessTransport()
            links = [
                transport.connect(p, e) for p, e in enumerate(info.producer_endpoints)
            ]
            for p, link in enumerate(links):
                link.register(cid, pulls.for_producer(p), pulls.digest(p))
            self.links.append(links)
        manifest = Manifest.from_params(
            ParamMeta(n, dtype_from_name(d), tuple(s))
            for n, d, s in zip(info.names, info.dtype_names, info.shapes, strict=True)
        )
        self.pubs = [
            WorkerPublication(
                backend="sharded_rdt",
                worker_rank=cid,
                worker_device=f"cpu:toy:{cid}",
                manifest_for=lambda h: manifest,
                expected_for=functools.partial(_expected, self.pulls[cid]),
                producer_call=self.links[cid][0].deliver_receipt,
            )
            for cid in range(self.num_consumers)
        ]

    def _live(self) -> list[int]:
        return [
            cid
            for cid in range(self.num_consumers)
            if self.live is None or cid in self.live
        ]

    def start_weight_update(self) -> None:
        self.calls.append("start")
        for cid in self._live():
            self.pubs[cid].start()

    def update_weights(self, update_info: Any) -> None:
        if is_prepare_request(update_info):
            self.calls.append("prepare")
            for cid in self._live():
                self.pubs[cid].prepare()
            return
        reason = abort_reason(update_info)
        if reason is not None:
            self.calls.append("abort")
            for cid in self._live():
                if self.pubs[cid].fence.state == WeightState.UPDATING:
                    self.pubs[cid].fail(f"the trainer aborted the update: {reason}")
            return
        # Workers pull concurrently; a group is released only when all of
        # them have read it.
        self.calls.append("update")
        self.received = [{} for _ in self.pulls]
        self.errors = []
        threads = [
            threading.Thread(target=self._pull, args=(cid, update_info))
            for cid in self._live()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if self.errors:
            raise self.errors[0]

    def _pull(self, cid: int, update_info: dict[str, Any]) -> None:
        pub = self.pubs[cid]
        got = self.received[cid]
        landed = False
        for link in self.links[cid]:
            # As the engine does: known before any check, so an abort names it.
            link.sync_id = update_info["sync_id"]
        try:
            pub.begin_message(dict(update_info))
            for chunk in self.pulls[cid].chunks:
                buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
                checksum = self.links[cid][chunk.producer].pull(chunk, buf).checksum
                pub.check_payload(f"chunk {chunk.seq}", checksum, buf)
                for p in chunk.slices:
                    pub.admit_slice(p.spec.source, None, p.spec.nbytes)
                pub.touch()
                landed = True
                for p in chunk.slices:
                    raw = buf[p.offset : p.offset + p.spec.nbytes]
                    got[p.spec.source] = raw.view(torch.float32).view(p.spec.shape)
                    pub.landed(p.spec.source, p.spec.nbytes)
        except BaseException as e:
            self.errors.append(e)
            for link in self.links[cid]:
                link.abort(str(e))
            pub.fail(e, weights_intact=not landed)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        for cid in self._live():
            self.pubs[cid].finish()
        if weight_version is not None:  # upstream's finish sets the version
            self.update_weight_version(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.calls.append("version")
        self.versions.append(new_version)


def _init(client: Consumers, source: WeightSource, **kw):
    return ShardedRDTTrainerWeightTransferEngine.trainer_init(
        ShardedRDTTrainerInitInfo(
            num_consumers=client.num_consumers,
            transport="inprocess",
            stall_timeout_s=5.0,
            rank=0,
            **kw,
        ),
        client=client,
        source=source,
    )


def test_send_weights_serves_every_consumer_the_live_values():
    model = Toy()
    client = Consumers(2)
    engine = _init(client, ModuleSource(model))
    for step in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step + 1.0)
        engine.send_weights()
        assert client.calls[-4:] == ["start", "update", "prepare", "finish"]
        for got in client.received:
            for name, param in model.named_parameters():
                assert torch.equal(got[name], param.detach()[:1])
        verified = engine.last_publication.verified
        assert verified is not None and verified.workers == (0, 1)
    assert client.versions == []  # no weight_version, none set
    engine.shutdown()


# -- verified publication, through producer receipts ---------------------------


def test_the_version_is_set_only_after_every_receipt_verified():
    model = Toy()
    client = Consumers(2)
    engine = _init(client, ModuleSource(model), model_version=7)
    engine.send_weights(weight_version="step-1")
    # Receipts are written at prepare and verified before the commit (finish),
    # which sets the version.
    assert client.calls[-5:] == ["start", "update", "prepare", "finish", "version"]
    assert client.versions == ["step-1"]
    pub = engine.last_publication
    assert pub.header.model_version == 7 and pub.header.backend == "sharded_rdt"
    assert pub.header.receipt_channel == "producer"
    engine.send_weights(weight_version="step-2")
    assert engine.last_publication.header.model_version == 8
    assert [p.fence.state for p in client.pubs] == [WeightState.COMMITTED] * 2
    engine.shutdown()


def test_checksums_verify_every_chunk_and_catch_a_flipped_byte(monkeypatch):
    model = Toy()
    client = Consumers(2)
    engine = _init(client, ModuleSource(model), verify_checksums=True)
    engine.send_weights(weight_version="clean")
    verified = engine.last_publication.verified
    chunks = sum(len(p.chunks) for p in client.pulls)
    assert verified.checksums_verified == chunks > 0
    assert client.versions == ["clean"]

    real_pack = Producer.pack

    def corrupting_pack(self, consumer_id, seq, sync_id=None) -> Packed:
        packed = real_pack(self, consumer_id, seq, sync_id)
        if consumer_id == 1 and seq == 2:  # after its checksum was taken
            packed.view[3] ^= 0x10
        return packed

    monkeypatch.setattr(Producer, "pack", corrupting_pack)
    with pytest.raises(Exception, match="ChecksumMismatch|checksum"):
        engine.send_weights(weight_version="corrupt")
    assert any(isinstance(e, ChecksumMismatch) for e in client.errors)
    assert is_fenced_version(client.versions[-1])
    assert client.pubs[1].fence.state == WeightState.FENCED  # chunks had landed

    monkeypatch.setattr(Producer, "pack", real_pack)
    engine.send_weights(weight_version="resynced")
    assert client.versions[-1] == "resynced"
    assert client.pubs[1].fence.state == WeightState.COMMITTED
    engine.shutdown()


class WrongShape(ModuleSource):
    """Announces ``head.weight`` with one more row than the model has."""

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, m.dtype, (m.shape[0] + 1, *m.shape[1:]))
            if m.name == "head.weight"
            else m
            for m in super().metadata()
        ]


def test_a_manifest_mismatch_is_refused_before_anything_lands():
    model = Toy()
    client = Consumers(1)
    engine = _init(client, ModuleSource(model))
    engine.send_weights(weight_version="good")
    engine.source = WrongShape(model)
    with pytest.raises(Exception, match="ManifestMismatch|manifest"):
        engine.send_weights(weight_version="bad")
    assert isinstance(client.errors[0], ManifestMismatch)
    assert "head.weight" in str(client.errors[0])
    assert client.received[0] == {}  # nothing was pulled
    pub = client.pubs[0]
    assert pub.fence.state == WeightState.COMMITTED  # intact: not fenced
    assert "head.weight" in (pub.fence.status.last_failure or "")
    assert is_fenced_version(client.versions[-1])
    engine.source = ModuleSource(model)
    engine.send_weights(weight_version="good-again")
    assert client.versions[-1] == "good-again"
    engine.shutdown()


def test_a_missing_receipt_fails_the_sync_before_the_commit_and_fences_the_version():
    client = Consumers(2)
    engine = _init(client, ModuleSource(Toy()), receipt_timeout_s=0.5)
    real_update = client.update_weights

    def prepare_without_worker_1(update_info):
        if not is_prepare_request(update_info):
            return real_update(update_info)
        client.calls.append("prepare")
        client.pubs[0].prepare()

    client.update_weights = prepare_without_worker_1  # type: ignore[method-assign]
    with pytest.raises(ReceiptTimeoutError, match=r"worker\(s\) \[1\]"):
        engine.send_weights(weight_version="v")
    # Never committed: the trainer aborted the update instead of finishing it.
    assert client.calls[-4:] == ["prepare", "abort", "finish", "version"]
    assert "v" not in client.versions
    assert is_fenced_version(client.versions[-1])
    client.update_weights = real_update  # type: ignore[method-assign]
    engine.shutdown()


def test_verification_can_be_turned_off():
    client = Consumers(1)
    engine = _init(client, ModuleSource(Toy()), verify_publication=False)
    engine.send_weights(weight_version="plain")
    assert engine.last_publication is None
    assert client.versions == ["plain"]
    assert client.pubs[0].header is None  # no header reached the worker
    with pytest.raises(ValueError, match="needs verify_publication"):
        ShardedRDTTrainerInitInfo(
            num_consumers=1, verify_publication=False, verify_checksums=True, rank=0
        )
    engine.shutdown()


def test_only_live_consumers_pull():
    client = Consumers(2)
    engine = _init(client, ModuleSource(Toy()))
    client.live = [1]
    engine.send_weights(live_consumer_ids=[1])
    assert client.received[0] == {} and client.received[1]
    with pytest.raises(ValueError, match="outside 0..1"):
        engine.send_weights(live_consumer_ids=[2])
    engine.shutdown()


def test_worker_payload_rejoins_without_a_collective():
    client = Consumers(1)
    engine = _init(client, ModuleSource(Toy()), gather_lookahead=0)
    payload = engine.get_worker_init_payload()
    assert payload["producer_endpoints"][0]["transport"] == "inprocess"
    assert payload["group_lens"] == [1, 2, 2, 2, 1]
    assert choose_transport(ShardedRDTWeightTransferInitInfo(**payload), "mp") == (
        "inprocess"
    )
    client.init_weight_transfer_engine(payload)  # a restarted engine re-registers
    engine.send_weights()
    assert client.received[0]
    engine.shutdown()


class Partial(ModuleSource):
    def __init__(self, model: nn.Module, held: Collection[str]) -> None:
        super().__init__(model)
        self._held = held

    def held_names(self) -> Collection[str] | None:
        return self._held


def test_ownership_rejects_orphans_and_unknown_names():
    names = ["a", "b"]
    assert ownership_table(names, {0: None, 1: None}) == ([], [])
    assert ownership_table(names, {0: ["a"], 1: ["a", "b"]}) == (
        [[0, 1], [1]],
        [0, 1],
    )
    with pytest.raises(ValueError, match="held by no trainer rank, first 'b'"):
        ownership_table(names, {0: ["a"]})
    with pytest.raises(Exception, match="not in metadata"):
        _init(Consumers(1), Partial(Toy(), ["nope"]))


def test_choose_transport_follows_the_executor():
    base: dict[str, Any] = dict(names=["a"], dtype_names=["float32"], shapes=[[1]])
    both = ShardedRDTWeightTransferInitInfo(
        **base,
        trainer_actor_names=["p"],
        producer_endpoints=[{"transport": "nixl"}],
    )
    assert choose_transport(both, "ray") == "rdt"
    assert choose_transport(both, "mp") == "nixl"
    with pytest.raises(ValueError, match="names no producers"):
        choose_transport(ShardedRDTWeightTransferInitInfo(**base), "mp")
