# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapter pushes without a vLLM engine: the header and its checks, the
staging, the commit into the process's registry, the memory loader that
vLLM's worker LoRA manager calls, and a push into the ipc worker engine of a
model served without LoRA (refused, nothing changes). The engine path is
``tests/entrypoints/rl/weight_transfer/test_lora_llm.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_ipc_worker import (
    EngineClient,
    TinyNet,
    make_engine,
    push,
    reload_ready,
    state,
)

from vllm.distributed.weight_transfer.lora_adapters import (
    AdapterConfig,
    AdapterHeader,
    AdapterPushes,
    AdapterStaging,
    AdapterVersion,
    MemoryAdapters,
    adapter_header,
    check_adapter,
    install_memory_loader,
    memory_adapters,
    memory_path,
)
from vllm.distributed.weight_transfer.lora_trainer import LoRAAdapter, push_lora_adapter

CONFIG = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
Q = "base_model.model.layers.0.q_proj"
BASE = {"layers.0.q_proj.weight": (6, 5), "layers.0.v_proj.weight": (3, 5)}


def header(**changes: Any) -> AdapterHeader:
    fields: dict[str, Any] = {"name": "policy", "lora_id": 1, "config": CONFIG}
    fields.update(changes)
    return AdapterHeader(**fields)


def tensors(rank: int = 2) -> dict[str, torch.Tensor]:
    return {
        f"{Q}.lora_A.weight": torch.randn(rank, 5),
        f"{Q}.lora_B.weight": torch.randn(6, rank),
    }


def test_the_header_round_trips_and_refuses_what_it_cannot_mean():
    h = header(version="v3", last=True)
    assert adapter_header({"adapter": h.to_dict()}) == h
    assert adapter_header({"names": []}) is None
    assert h.config.scaling == 2.0
    assert AdapterConfig(4, 8.0, ("q_proj",), use_rslora=True).scaling == 4.0
    for bad, match in [
        ({**h.to_dict(), "lora_id": 0}, "lora_id must be >= 1"),
        ({**h.to_dict(), "lora_id": True}, "lora_id must be an int"),
        ({**h.to_dict(), "name": ""}, "name must be a non-empty string"),
        ({**h.to_dict(), "extra": 1}, "unknown fields"),
        ({**h.to_dict(), "config": {**CONFIG.to_dict(), "rank": 0}}, "rank"),
        (
            {**h.to_dict(), "config": {**CONFIG.to_dict(), "target_modules": "q"}},
            "list of names",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            adapter_header({"adapter": bad})


def test_check_adapter_names_every_cause():
    shapes = {n: tuple(t.shape) for n, t in tensors().items()}
    assert check_adapter(header(), shapes, BASE, max_rank=8) == []
    errors = check_adapter(
        header(config=AdapterConfig(16, 16.0, ("q_proj", "v_proj"))),
        {
            **shapes,
            "base_model.model.layers.0.k_proj.lora_A.weight": (2, 5),
            "base_model.model.layers.0.v_proj.lora_A.weight": (2, 5),
            "base_model.model.layers.9.q_proj.lora_A.weight": (16, 5),
            "base_model.model.layers.9.q_proj.lora_B.weight": (6, 16),
            "not.a.lora": (1,),
        },
        BASE,
        max_rank=8,
    )
    text = "\n".join(errors)
    assert "rank 16 is above the engine's max_lora_rank 8" in text
    assert "layers.0.k_proj is not among target_modules" in text
    assert "layers.0.v_proj has no lora_B" in text
    assert "layers.9.q_proj is not a module of the served model" in text
    assert "'not.a.lora' is not a LoRA tensor name" in text
    assert "do not have rank 16" in text  # layers.0.q_proj has rank 2
    wrong = check_adapter(
        header(), {**shapes, f"{Q}.lora_B.weight": (7, 2)}, BASE, max_rank=8
    )
    assert wrong == [
        "layers.0.q_proj: lora_B @ lora_A is [7, 5] but the served weight is [6, 5]"
    ]


def test_staging_copies_and_refuses_a_second_adapter_or_a_late_message():
    staging = AdapterStaging()
    given = tensors()
    staging.add(header(), given.items())
    for t in given.values():
        t.zero_()  # the trainer reuses its buffer: the staged copy stays
    assert all(t.abs().sum() > 0 for t in staging.tensors.values())
    with pytest.raises(ValueError, match="two adapters"):
        staging.add(header(name="other", lora_id=2), [])
    with pytest.raises(ValueError, match="arrived twice"):
        staging.add(header(), tensors().items())
    staging.add(header(last=True), [])
    assert staging.complete
    with pytest.raises(ValueError, match="after the push's last one"):
        staging.add(header(last=True), [])


class FakeLoRAManager:
    def __init__(self) -> None:
        self.removed: list[int] = []

    def remove_adapter(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


def pushes(registry: MemoryAdapters) -> AdapterPushes:
    model = torch.nn.Module()
    model.lora_manager = FakeLoRAManager()  # type: ignore[assignment]
    return AdapterPushes(model, BASE, max_rank=8, registry=registry)


def test_a_checked_push_commits_and_a_refused_one_changes_nothing():
    registry = MemoryAdapters()
    engine = pushes(registry)
    engine.receive(header(version="v1", last=True), tensors().items())
    version = engine.commit()
    assert version is not None and registry.get(1) is version
    assert registry.versions() == {"policy": "v1"}
    assert engine.model.lora_manager.removed == [1]  # type: ignore[union-attr]
    # An id serving another name, a name under another id, a wrong shape:
    # refused at the last message, before any commit.
    for bad, match in [
        (header(name="other", last=True), "lora_id 1 already serves"),
        (header(lora_id=2, last=True), "already serves under lora_id 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.receive(bad, tensors().items())
        assert engine.staging is None and registry.get(1) is version
    with pytest.raises(ValueError, match="do not have rank"):
        engine.receive(header(last=True), tensors(rank=3).items())
    # A push whose last message never came is refused at the finish.
    engine.receive(header(version="v2"), tensors().items())
    with pytest.raises(ValueError, match="before the push's last message"):
        engine.check_complete()
    assert engine.commit() is None and registry.get(1) is version


def test_the_memory_loader_builds_from_copies_and_checks_the_name():
    """vLLM's LoRA manager folds the scaling into lora_B in place when it
    loads an adapter, and loads a pushed one again after every base-weight
    update: each build must start from copies of what was pushed."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    install_memory_loader()
    pushed = tensors()
    version = AdapterVersion(header(lora_id=77, name="loaded"), pushed)
    memory_adapters().commit(version)
    built: list[dict[str, torch.Tensor]] = []

    class LoRAModelStandIn:
        @staticmethod
        def from_lora_tensors(**kwargs: Any) -> str:
            built.append(kwargs["tensors"])
            return "built"

    manager = SimpleNamespace(
        max_position_embeddings=None,
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32),
        _adapter_manager=SimpleNamespace(model=torch.nn.Module()),
        _lora_model_cls=LoRAModelStandIn,
        vocab_size=32,
    )
    load: Any = WorkerLoRAManager._load_adapter
    try:
        request = SimpleNamespace(lora_int_id=77, lora_name="loaded")
        assert load(manager, request) == "built"
        for name, tensor in built[0].items():
            assert torch.equal(tensor, pushed[name])
            assert tensor.data_ptr() != pushed[name].data_ptr()
        with pytest.raises(ValueError, match="serves the adapter 'loaded'"):
            load(manager, SimpleNamespace(lora_int_id=77, lora_name="other"))
        # By memory path, under an id of the request's own: the pushed
        # adapter, built under that id, which the next commit also drops.
        built.clear()
        by_path = SimpleNamespace(
            lora_int_id=78, lora_name="loaded", lora_path=memory_path("loaded")
        )
        assert load(manager, by_path) == "built" and built
        assert memory_adapters().ids_of("loaded", 77) == {77, 78}
        from vllm.exceptions import LoRAAdapterNotFoundError

        # Upstream's not-found error (the server's 404), saying why.
        with pytest.raises(
            LoRAAdapterNotFoundError,
            match="No adapter found for memory://absent; no LoRA adapter was pushed",
        ):
            load(
                manager,
                SimpleNamespace(
                    lora_int_id=79, lora_name="x", lora_path=memory_path("absent")
                ),
            )
    finally:
        memory_adapters().remove(77)


def tiny_net_adapter() -> LoRAAdapter:
    """A rank-2 adapter of ``TinyNet``'s layer ``a`` (8 -> 8)."""
    return LoRAAdapter(
        name="policy",
        lora_id=1,
        config=CONFIG,
        tensors={
            "base_model.model.a.lora_A.weight": torch.randn(2, 8),
            "base_model.model.a.lora_B.weight": torch.randn(8, 2),
        },
    )


def test_a_push_into_an_engine_without_lora_is_refused_and_changes_nothing():
    target = reload_ready(0)
    before = state(target)
    engine = make_engine(target)
    adapter = tiny_net_adapter()
    with pytest.raises(Exception, match="runs without LoRA"):
        push_lora_adapter(EngineClient(engine), adapter)
    for name, want in before.items():
        assert torch.equal(dict(target.named_parameters())[name], want), name
    assert engine.fence_status["state"] != "fenced"
    # The engine takes the next base-weight sync as usual.
    trainer = TinyNet(1)
    push(engine, trainer)
    for name, want in state(trainer).items():
        assert torch.equal(dict(target.named_parameters())[name], want), name


def test_a_byte_flipped_in_transit_is_caught_by_the_checksum():
    """With ``verify_checksums``, every worker checks the bytes it read
    against the trainer's checksum before keeping any (here before the
    engine would refuse the push for running without LoRA)."""
    from vllm.distributed.weight_transfer.testing.ipc_faults import ByteFlippingClient

    engine = make_engine(reload_ready(0))
    adapter = tiny_net_adapter()
    flipping = ByteFlippingClient(EngineClient(engine))
    with pytest.raises(Exception, match="checksum mismatch"):
        push_lora_adapter(flipping, adapter, verify_checksums=True)
    assert flipping.flipped is not None
    with pytest.raises(Exception, match="runs without LoRA"):
        push_lora_adapter(EngineClient(engine), adapter, verify_checksums=True)
    assert engine.fence_status["state"] != "fenced"
