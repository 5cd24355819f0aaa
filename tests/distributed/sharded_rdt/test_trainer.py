# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The trainer engine with in-process producers and consumers: the worker init
payload, ownership checks, and a full send_weights round trip driven through a
fake client whose update_weights runs the consumers' pulls."""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from typing import Any

import pytest
import torch
from torch import nn

from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.sharded_rdt_chunks import build_pull_plan
from vllm.distributed.weight_transfer.sharded_rdt_common import (
    RdtRouter,
    ShardedRDTWeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.sharded_rdt_engine import choose_transport
from vllm.distributed.weight_transfer.sharded_rdt_ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.sharded_rdt_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.sharded_rdt_trainer import (
    ShardedRDTTrainerInitInfo,
    ShardedRDTTrainerWeightTransferEngine,
    ownership_table,
)
from vllm.distributed.weight_transfer.sharded_rdt_transport import (
    InProcessTransport,
)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 8, bias=False)


class Consumers:
    """A fake client: ``num_consumers`` in-process workers, each keeping the
    first row of every tensor, pulled during ``update_weights``."""

    def __init__(self, num_consumers: int) -> None:
        self.num_consumers = num_consumers
        self.calls: list[str] = []
        self.received: list[dict[str, torch.Tensor]] = []
        self.live: list[int] | None = None

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

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        # Workers pull concurrently; a group is released only when all of
        # them have read it.
        self.calls.append("update")
        self.received = [{} for _ in self.pulls]
        threads = [
            threading.Thread(target=self._pull, args=(cid,))
            for cid in range(self.num_consumers)
            if self.live is None or cid in self.live
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    def _pull(self, cid: int) -> None:
        got = self.received[cid]
        for chunk in self.pulls[cid].chunks:
            buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
            self.links[cid][chunk.producer].pull(chunk, buf)
            for p in chunk.slices:
                raw = buf[p.offset : p.offset + p.spec.nbytes]
                got[p.spec.source] = raw.view(torch.float32).view(p.spec.shape)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


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
        assert client.calls[-3:] == ["start", "update", "finish"]
        for got in client.received:
            for name, param in model.named_parameters():
                assert torch.equal(got[name], param.detach()[:1])
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
