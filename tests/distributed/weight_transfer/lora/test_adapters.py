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

from vllm.distributed.weight_transfer.lora.adapters import (
    AdapterPushes,
    AdapterStaging,
)
from vllm.distributed.weight_transfer.lora.memory import (
    AdapterVersion,
    MemoryAdapters,
    install_memory_loader,
    memory_adapters,
)
from vllm.distributed.weight_transfer.lora.pusher import LoRAAdapter, push_lora_adapter
from vllm.distributed.weight_transfer.lora.wire import (
    AdapterConfig,
    AdapterHeader,
    AdapterRefused,
    adapter_header,
    check_adapter,
    memory_path,
)

from ..ipc.worker_rig import (
    EngineClient,
    TinyNet,
    make_engine,
    push,
    reload_ready,
    state,
)

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
        ({**h.to_dict(), "name": ""}, "adapter name '' must be 1-64 characters"),
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
    assert "does not have rank 16" in text  # layers.0.q_proj has rank 2
    wrong = check_adapter(
        header(), {**shapes, f"{Q}.lora_B.weight": (7, 2)}, BASE, max_rank=8
    )
    assert wrong == [
        f"{Q}.lora_B.weight is [7, 2] but the served weight layers.0.q_proj is "
        "[6, 5] (lora_B @ lora_A must have its shape)"
    ]


def test_staging_copies_and_refuses_a_second_adapter_or_a_late_message():
    staging = AdapterStaging()
    given = tensors()
    staging.add(header(), given.items())
    for t in given.values():
        t.zero_()  # the trainer reuses its buffer: the staged copy stays
    assert all(t.abs().sum() > 0 for t in staging.tensors.values())

    def errors(h: AdapterHeader, shapes: dict[str, Any]) -> str:
        return "; ".join(staging.message_errors(h, list(shapes.items()), BASE, 8))

    shapes = {n: tuple(t.shape) for n, t in tensors().items()}
    assert "two adapters" in errors(header(name="other", lora_id=2), {})
    assert "arrived twice" in errors(header(), shapes)
    staging.add(header(last=True), [])
    assert staging.complete
    assert "after the push's last one" in errors(header(last=True), {})


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
    with pytest.raises(ValueError, match="does not have rank"):
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


# -- hostile input: what a push may not carry ----------------------------------


@pytest.mark.parametrize(
    "name", ["x\nWARNING forged log line", "a b", "../etc", "é", "n" * 65, ""]
)
def test_an_adapter_name_outside_the_publication_id_characters_is_refused(name):
    with pytest.raises(ValueError, match="adapter name .* must be 1-64 characters"):
        header(name=name)
    with pytest.raises(AdapterRefused, match="malformed adapter header"):
        adapter_header({"adapter": {**header().to_dict(), "name": name}})


def oversized(rank: int = 2) -> list[tuple[str, torch.Tensor]]:
    """A message announcing a 256 MB lora_A: tensors on the meta device, so
    copying any of it would fail with another error than the refusal."""
    return [(f"{Q}.lora_A.weight", torch.empty(524288, 128, device="meta"))]


def test_a_message_is_checked_against_the_header_before_any_byte_is_copied():
    registry = MemoryAdapters()
    engine = pushes(registry)
    for message, cause in [
        (oversized(), "is \\[524288, 128\\] and does not have rank 2"),
        (
            [(f"{Q}.lora_A.weight", torch.empty(2, 4096, device="meta"))],
            "the served weight layers.0.q_proj is \\[6, 5\\]",
        ),
        (
            [("base_model.model.layers.0.k_proj.lora_A.weight", torch.empty(2, 5))],
            "not among target_modules",
        ),
        ([("not.a.lora", torch.empty(1, device="meta"))], "not a LoRA tensor name"),
    ]:
        with pytest.raises(AdapterRefused, match=cause):
            engine.receive(header(), message)
        assert engine.staging is None
    with pytest.raises(AdapterRefused, match="above the engine's max_lora_rank 8"):
        engine.receive(
            header(config=AdapterConfig(9, 1.0, ("q_proj",))),
            [(f"{Q}.lora_A.weight", torch.empty(9, 5, device="meta"))],
        )
    assert registry.versions() == {}


def test_a_tensor_name_sent_again_in_a_later_message_is_refused():
    engine = pushes(MemoryAdapters())
    first = tensors()
    engine.receive(header(), [(f"{Q}.lora_A.weight", first[f"{Q}.lora_A.weight"])])
    with pytest.raises(AdapterRefused, match="lora_A.weight arrived twice"):
        engine.receive(header(last=True), first.items())
    assert engine.staging is None and engine.commit() is None
    # Within one message too.
    a = (f"{Q}.lora_A.weight", first[f"{Q}.lora_A.weight"])
    with pytest.raises(AdapterRefused, match="arrived twice"):
        engine.receive(header(last=True), [a, a])


class HoldingLoRAManager(FakeLoRAManager):
    def __init__(self, held: set[int]) -> None:
        super().__init__()
        self.held = held

    def list_adapters(self) -> dict[int, Any]:
        return dict.fromkeys(self.held)


def test_an_id_another_adapter_holds_is_refused_at_the_first_message():
    """Whatever loaded it: a path load the loader saw, or an id the LoRA
    manager holds that no push filled."""
    registry = MemoryAdapters()
    engine = pushes(registry)
    engine.model.lora_manager = HoldingLoRAManager({5})  # type: ignore[assignment]
    registry.note_loaded_from_path("sft", 1)
    with pytest.raises(AdapterRefused, match="lora_id 1 already serves adapter 'sft'"):
        engine.receive(header(), tensors().items())
    with pytest.raises(AdapterRefused, match="lora_id 5 already serves an adapter"):
        engine.receive(header(lora_id=5), tensors().items())
    # The same name from a path may be replaced by its push.
    engine.receive(header(name="sft", last=True), tensors().items())
    assert engine.commit() is not None and registry.get(1) is not None
    # A server's id for a pushed adapter's memory path is that adapter's.
    registry.note_built("sft", 2)
    with pytest.raises(AdapterRefused, match="lora_id 2 already serves the pushed"):
        engine.receive(header(lora_id=2), tensors().items())


def test_a_clash_inside_an_engine_step_serves_the_pushed_adapter_without_raising():
    """A raise while a step activates its adapters stops the engine: a
    preload of a clashing id is refused, the same load inside a step is
    served the pushed adapter and logged."""
    from vllm.distributed.weight_transfer.lora import memory as lora_adapters
    from vllm.lora.worker_manager import WorkerLoRAManager

    install_memory_loader()
    memory_adapters().commit(AdapterVersion(header(lora_id=88, name="evil"), tensors()))

    class LoRAModelStandIn:
        @staticmethod
        def from_lora_tensors(**kwargs: Any) -> str:
            return f"built {kwargs['lora_model_id']}"

    manager = SimpleNamespace(
        max_position_embeddings=None,
        lora_config=SimpleNamespace(max_lora_rank=8, lora_dtype=torch.float32),
        _adapter_manager=SimpleNamespace(model=torch.nn.Module()),
        _lora_model_cls=LoRAModelStandIn,
        vocab_size=32,
    )
    sft = SimpleNamespace(lora_int_id=88, lora_name="sft", lora_path="/peft/dir")
    load: Any = WorkerLoRAManager._load_adapter
    try:
        with pytest.raises(AdapterRefused, match="lora_id 88 serves the adapter"):
            load(manager, sft)
        with lora_adapters.engine_step():
            assert load(manager, sft) == "built 88"
        # vLLM's step activates its adapters through set_active_adapters,
        # which marks the step.
        seen: list[bool] = []
        stand_in = SimpleNamespace(
            _apply_adapters=lambda requests: seen.append(lora_adapters.in_engine_step())
        )
        WorkerLoRAManager.set_active_adapters(stand_in, set(), None)  # type: ignore[arg-type]
        assert seen == [True] and not lora_adapters.in_engine_step()
    finally:
        memory_adapters().remove(88)


class RefusingClient:
    """An engine in another process: the worker's refusal comes back as a
    plain ``Exception`` carrying its text."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        if "abort" in update_info:
            self.calls.append("abort")
            return
        raise Exception(  # noqa: TRY002 - what an engine core answers
            "Worker failed with error 'LoRA adapter refused: adapter 'policy' "
            "(lora_id 1), nothing changed: rank 16 is above the engine's "
            "max_lora_rank 8'"
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


def test_a_refusal_from_another_process_reaches_the_caller_as_adapter_refused():
    client = RefusingClient()
    with pytest.raises(AdapterRefused, match="max_lora_rank 8") as refused:
        push_lora_adapter(client, tiny_net_adapter(), verify_publication=False)
    assert isinstance(refused.value, ValueError)
    assert client.calls == ["start", "abort", "finish"]


def test_a_pull_is_checked_against_the_header_before_a_byte_is_pulled():
    engine = pushes(MemoryAdapters())
    good = {
        "names": [f"{Q}.lora_A.weight"],
        "shapes": [[2, 5]],
        "offsets": [0],
        "tensor_sizes": [40],
    }
    engine.check_layout(header(), good, payload_bytes=40)
    for message, payload, cause in [
        ({**good, "shapes": [[524288, 128]]}, 40, "does not have rank 2"),
        (good, 256 << 20, "the payload is 268435456 B but its tensors end at 40"),
        ({**good, "offsets": []}, 40, "must be lists of one length"),
    ]:
        with pytest.raises(AdapterRefused, match=cause):
            engine.check_layout(header(), message, payload_bytes=payload)
        assert engine.staging is None


class BusyEngine(RefusingClient):
    """A base-weight sync of a live trainer holds the engine's update open."""

    def start_weight_update(self) -> None:
        self.calls.append("start")
        raise RuntimeError("a weight update is already active (publication p)")


def test_a_push_never_abandons_an_update_another_trainer_holds_open():
    from vllm.distributed.weight_transfer.trainer.start_update import UpdateStillOpen

    client = BusyEngine()
    with pytest.raises(UpdateStillOpen, match="wait_s=0.3"):
        push_lora_adapter(
            client, tiny_net_adapter(), verify_publication=False, start_wait_s=0.3
        )
    # Asked again within the wait; never aborted or finished.
    assert set(client.calls) == {"start"} and len(client.calls) >= 2


def test_an_adapter_vllm_cannot_build_is_refused_at_the_push(monkeypatch):
    """vLLM's own build of the adapter runs at the push's last message, not
    first in the engine step that would load it (where a raise stops the
    engine)."""

    def refuse(self: AdapterVersion, manager: Any, lora_id: Any = None) -> None:
        assert manager._adapter_manager is engine.model.lora_manager
        raise ValueError("vLLM does not support this PEFT feature")

    engine = pushes(MemoryAdapters())
    lora = engine.model.lora_manager
    lora.lora_config = SimpleNamespace(max_lora_rank=8)  # type: ignore[union-attr]
    lora.vocab_size = 32  # type: ignore[union-attr]
    monkeypatch.setattr(AdapterVersion, "build", refuse)
    with pytest.raises(AdapterRefused, match="vLLM cannot build it: vLLM does not"):
        engine.receive(header(last=True), tensors().items())
    assert engine.staging is None and engine.registry.versions() == {}
