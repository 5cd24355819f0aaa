# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verified LoRA adapter pushes (``lora_publication``) into the ipc worker
engine of a plain module, without a vLLM engine: every worker's receipt of
what it staged, checked by the pusher before the commit; the adapter's own
version order, per adapter name and apart from the base weights'; a receipt
missing or different fails the push and the version before keeps serving.
The real engine at TP 1 and 2 is
``tests/entrypoints/rl/weight_transfer/test_lora_llm.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.lora.adapters import AdapterStaging
from vllm.distributed.weight_transfer.lora.memory import memory_adapters
from vllm.distributed.weight_transfer.lora.pusher import (
    LoRAAdapter,
    LoRAPusher,
    push_lora_adapter,
)
from vllm.distributed.weight_transfer.lora.wire import AdapterConfig
from vllm.distributed.weight_transfer.testing.ipc_faults import ByteFlippingClient
from vllm.distributed.weight_transfer.verification import (
    ReceiptError,
    ReceiptTimeoutError,
    coverage_digest,
)

from ..ipc.worker_rig import EngineClient, TinyNet, make_engine, push, reload_ready

CONFIG = AdapterConfig(rank=2, alpha=4.0, target_modules=("a",))
PREFIX = "receipts-"


class FakeLoRAManager:
    def remove_adapter(self, lora_id: int) -> bool:
        return True


@pytest.fixture
def engine() -> Iterator[IPCWeightTransferEngine]:
    """The ipc worker engine of ``TinyNet`` served with LoRA; the adapters
    pushed by a test (names starting with ``PREFIX``) are forgotten after it,
    with their version order."""
    target = reload_ready(0)
    target.lora_manager = FakeLoRAManager()  # type: ignore[assignment]
    yield make_engine(target)
    for name, lora_id in memory_adapters().names().items():
        if name.startswith(PREFIX):
            memory_adapters().remove(lora_id)


def adapter(name: str, lora_id: int, seed: int = 0) -> LoRAAdapter:
    """A rank-2 adapter of ``TinyNet``'s layer ``a`` (4 -> 6)."""
    gen = torch.Generator().manual_seed(seed)
    return LoRAAdapter(
        name=PREFIX + name,
        lora_id=lora_id,
        config=CONFIG,
        tensors={
            "base_model.model.a.lora_A.weight": torch.randn(2, 4, generator=gen),
            "base_model.model.a.lora_B.weight": torch.randn(6, 2, generator=gen),
        },
    )


def serving(pushed: LoRAAdapter) -> Any:
    """The version of ``pushed``'s name this process serves."""
    version = memory_adapters().by_name(pushed.name)
    assert version is not None, pushed.name
    return version


def assert_serves(pushed: LoRAAdapter) -> None:
    held = serving(pushed).tensors
    assert set(held) == set(pushed.tensors)
    for name, tensor in pushed.tensors.items():
        assert torch.equal(held[name], tensor), name


def test_a_push_is_verified_by_default_from_what_every_worker_staged(engine):
    pushed = adapter("policy", 61)
    nbytes = sum(t.numel() * t.element_size() for t in pushed.tensors.values())
    pusher = LoRAPusher(EngineClient(engine), verify_checksums=True)
    try:
        verified = pusher.push(pushed, version="step-1")
    finally:
        pusher.close()
    assert verified is not None and pusher.last_publication is not None
    assert pusher.last_publication.verified is verified
    assert verified.workers == (0,)
    assert verified.bytes_landed == nbytes
    assert verified.checksums_verified == 1
    assert_serves(pushed)
    assert serving(pushed).model_version == verified.model_version
    assert serving(pushed).header.version == "step-1"
    # Unverified on request, or through a client that cannot say whose
    # receipts to wait for: no receipts, nothing to report.
    assert (
        push_lora_adapter(
            EngineClient(engine),
            adapter("policy", 61, seed=1),
            verify_publication=False,
        )
        is None
    )
    assert_serves(adapter("policy", 61, seed=1))
    assert push_lora_adapter(WorldSizeUnknown(engine), adapter("policy", 61)) is None
    assert_serves(adapter("policy", 61))


class WorldSizeUnknown:
    """A client with upstream's calls only (no ``get_world_size``)."""

    def __init__(self, engine: IPCWeightTransferEngine) -> None:
        self.inner = EngineClient(engine)

    def __getattr__(self, name: str) -> Any:
        if name == "get_world_size":
            raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("verify_publication", [True, False])
def test_a_byte_flipped_in_transit_is_refused_with_or_without_receipts(
    engine, verify_publication
):
    """The checksum travels in the publication of a verified push (and the
    receipt counts it), in the adapter header of an unverified one; either
    way the worker refuses bytes that changed and the version before
    serves."""
    old = adapter("flip", 66)
    push_lora_adapter(EngineClient(engine), old)
    flipping = ByteFlippingClient(EngineClient(engine))
    with pytest.raises(Exception, match="checksum mismatch"):
        push_lora_adapter(
            flipping,
            adapter("flip", 66, seed=1),
            verify_checksums=True,
            verify_publication=verify_publication,
        )
    assert flipping.flipped is not None
    assert_serves(old)


def test_adapter_versions_are_ordered_per_adapter_name(engine, monkeypatch):
    client = EngineClient(engine)
    a10 = adapter("a", 62, seed=1)
    push_lora_adapter(client, a10, model_version=10)
    # Another adapter has its own order: 5 after a's 10 is its first.
    push_lora_adapter(client, adapter("b", 63), model_version=5)
    staged: list[str] = []
    add = AdapterStaging.add

    def spy(self: AdapterStaging, header: Any, tensors: Any) -> None:
        staged.append(header.name)
        add(self, header, tensors)

    monkeypatch.setattr(AdapterStaging, "add", spy)
    with pytest.raises(ValueError, match="older than the committed version 10"):
        push_lora_adapter(client, adapter("a", 62, seed=2), model_version=9)
    assert staged == [], "refused before anything was staged"
    assert_serves(a10)
    assert serving(a10).model_version == 10
    assert engine.fence_status["state"] != "fenced"
    # The same version again (a retry) is accepted, as for base weights.
    a10_again = adapter("a", 62, seed=3)
    push_lora_adapter(client, a10_again, model_version=10)
    assert staged == [a10_again.name]
    assert_serves(a10_again)


def test_base_versions_go_on_after_adapter_pushes_by_the_wall_clock(engine):
    """An adapter push's version (the wall clock in microseconds by default)
    never reaches the base weights' order: a base trainer counting 1, 2, 3
    is accepted after it, and the adapter push leaves the base weights'
    committed publication and version as they were."""
    client = EngineClient(engine)
    verified = push_lora_adapter(client, adapter("clock", 64))
    assert verified is not None and verified.model_version > 10**15
    for version in (1, 2):
        push(engine, TinyNet(version), model_version=version)
    base = dict(engine.fence_status)
    assert base["model_version"] == 2 and base["state"] == "committed"
    push_lora_adapter(client, adapter("clock", 64, seed=1))
    status = engine.fence_status
    assert (status["publication_id"], status["model_version"]) == (
        base["publication_id"],
        2,
    )
    push(engine, TinyNet(3), model_version=3)
    assert engine.fence_status["model_version"] == 3
    assert_serves(adapter("clock", 64, seed=1))


class TwoWorkersClient(EngineClient):
    """Says the server runs two workers; only one engine answers."""

    def get_world_size(self) -> int:
        return 2


class TamperingClient(EngineClient):
    """Rewrites every receipt once the workers wrote them (after the prepare
    message), as a worker attesting something else than was sent would."""

    def __init__(self, engine: IPCWeightTransferEngine, change: dict) -> None:
        super().__init__(engine)
        self.change = change
        self.receipt_dir: Path | None = None

    def update_weights(self, update_info: Any) -> None:
        if "publication" in update_info:
            self.receipt_dir = Path(update_info["publication"]["receipt_dir"])
        super().update_weights(update_info)
        if "prepare" in update_info:
            assert self.receipt_dir is not None
            for file in self.receipt_dir.glob("worker-*.json"):
                receipt = {**json.loads(file.read_text()), **self.change}
                file.write_text(json.dumps(receipt))


@pytest.mark.parametrize(
    ("make_client", "match"),
    [
        (TwoWorkersClient, r"no receipt from worker\(s\) \[1\]"),
        (
            lambda e: TamperingClient(e, {"bytes_landed": 4}),
            "landed 2 tensors / 4 bytes",
        ),
        (
            lambda e: TamperingClient(e, {"coverage": coverage_digest([("x", 4)])}),
            "coverage digest differs",
        ),
    ],
    ids=["missing", "other-bytes", "other-tensors"],
)
def test_a_missing_or_different_receipt_fails_the_push_and_the_old_serves(
    engine, make_client, match
):
    client = EngineClient(engine)
    old = adapter("steady", 65)
    push_lora_adapter(client, old)
    pusher = LoRAPusher(make_client(engine), receipt_timeout_s=0.2)
    with pytest.raises((ReceiptError, ReceiptTimeoutError), match=match):
        pusher.push(adapter("steady", 65, seed=1))
    assert pusher.last_publication is None
    assert_serves(old)
    assert engine.fence_status["state"] != "fenced"
    # The next push goes through.
    new = adapter("steady", 65, seed=2)
    push_lora_adapter(client, new)
    assert_serves(new)
