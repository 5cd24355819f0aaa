# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA pushes in the trainer-engine shape (``lora_trainer_engine``) against
a client that records the calls (``test_lora_llm.py`` runs the same against
real engines)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.lora.pusher import LoRAAdapter
from vllm.distributed.weight_transfer.lora.trainer import (
    LoRASource,
    LoRATrainerInitInfo,
    LoRATrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.lora.wire import AdapterConfig

CONFIG = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj",))
Q = "base_model.model.layers.0.q_proj"


def adapter(name: str, lora_id: int) -> LoRAAdapter:
    return LoRAAdapter(
        name,
        lora_id,
        CONFIG,
        {
            f"{Q}.lora_A.weight": torch.ones(2, 5),
            f"{Q}.lora_B.weight": torch.ones(6, 2),
        },
    )


class RecordingClient:
    """The four sync calls, recorded (no ``get_world_size``: the pushes go
    unverified, with a warning)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        adapter = update_info.get("adapter", {})
        self.calls.append(("update", (adapter.get("name"), adapter.get("version"))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def test_the_factory_builds_an_engine_that_pushes_every_adapter_each_round():
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(
        LoRATrainerInitInfo(rank=0),
        client=client,  # type: ignore[arg-type]
        source=LoRASource([adapter("a", 1), adapter("b", 2)]),
    )
    assert isinstance(engine, LoRATrainerWeightTransferEngine)
    try:
        engine.send_weights(weight_version="v1")
        engine.send_weights(weight_version="v2")
    finally:
        engine.shutdown()
    updates = [c[1] for c in client.calls if c[0] == "update"]
    assert updates == [("a", "v1"), ("b", "v1"), ("a", "v2"), ("b", "v2")]
    # Each adapter is its own update; the base weights' label is left alone.
    assert [c[0] for c in client.calls] == ["start", "update", "finish"] * 4
    assert {c[1] for c in client.calls if c[0] == "finish"} == {None}
    assert engine.last_publications == [None, None]


def test_other_ranks_send_nothing():
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(
        LoRATrainerInitInfo(rank=1),
        client=client,  # type: ignore[arg-type]
        source=LoRASource([adapter("a", 1)]),
    )
    assert isinstance(engine, LoRATrainerWeightTransferEngine)
    engine.send_weights(weight_version="v1")
    engine.shutdown()
    assert client.calls == []


def test_a_source_function_is_read_each_round_and_lists_its_tensors():
    rounds = iter([[adapter("a", 1)], [adapter("a", 1), adapter("b", 2)]])
    source = LoRASource(lambda: next(rounds))
    assert [m.name for m in source.metadata()] == [
        f"{Q}.lora_A.weight",
        f"{Q}.lora_B.weight",
    ]
    assert len(list(source)) == 4  # the second round: two adapters


@pytest.mark.parametrize(
    "source, match",
    [
        (None, "pass source=LoRASource"),
        (ModuleSource(torch.nn.Linear(2, 2)), "got ModuleSource"),
    ],
)
def test_anything_but_a_lora_source_is_refused(source, match):
    with pytest.raises(TypeError, match=match):
        WeightTransferTrainerFactory.trainer_init(
            LoRATrainerInitInfo(rank=0),
            client=RecordingClient(),  # type: ignore[arg-type]
            source=source,
        )


def test_a_round_names_each_adapter_once():
    source = LoRASource([adapter("a", 1), adapter("a", 2)])
    with pytest.raises(ValueError, match="each adapter name once"):
        source.adapters()
    with pytest.raises(ValueError, match="no adapter"):
        LoRASource([]).adapters()
