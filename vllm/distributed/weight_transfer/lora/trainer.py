# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapter pushes in the trainer-engine shape of base-weight syncs:
``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``
once, then ``send_weights(weight_version=...)`` after every optimizer step.

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.lora.trainer import (
        LoRASource, LoRATrainerInitInfo,
    )

    engine = WeightTransferTrainerFactory.trainer_init(
        LoRATrainerInitInfo(rank=rank),
        client=client,
        source=LoRASource.from_peft_model(peft_model, name="policy", lora_id=1),
    )
    for step in ...:
        ...  # optimizer step
        engine.send_weights(weight_version=f"step-{step}")
    engine.shutdown()

``LoRATrainerInitInfo`` (backend ``"lora"``) carries what a ``LoRAPusher``
takes (transport, verification, versions, ``label_outputs``); the engine is a
pusher kept from one round to the next, so the buffer the adapter travels in
(and, over NIXL, the producer) is reused. A ``LoRASource`` says which adapters
a round sends: read from a PEFT model at each round (``from_peft_model``, the
model's tensors as they are then), or given (``LoRASource([LoRAAdapter(name,
lora_id, config, tensors), ...])``: tensors under PEFT's names). Each adapter
of a round is its own update, committed when its receipts verified; a round
stops at the first adapter refused, the ones before it committed.

The engine side needs nothing set up for it: any ``ipc`` or ``sharded_rdt``
engine started with ``enable_lora`` takes these pushes, so there is no init
handshake. Rank 0 holds the whole adapter and pushes it; other ranks do
nothing (an adapter is megabytes; gather it on rank 0 first if a trainer
shards it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.lora.pusher import (
    DEFAULT_PULL_STALL_TIMEOUT_S,
    DEFAULT_START_WAIT_S,
    LoRAAdapter,
    LoRAPusher,
)
from vllm.distributed.weight_transfer.trainer.settings import VerifiedSyncSettings
from vllm.distributed.weight_transfer.verification import (
    VerifiedPublication,
)


@dataclass
class LoRATrainerInitInfo(TrainerInitInfo, VerifiedSyncSettings):
    """Trainer-side settings of LoRA adapter pushes (``LoRAPusher``'s); the
    verified publication ones are ``VerifiedSyncSettings``' (keyword-only),
    and checksums here travel apart from the publication, so they do not need
    it."""

    checksums_need_publication: ClassVar[bool] = False

    backend: ClassVar[str] = "lora"

    transport: Literal["ipc", "nixl"] = "ipc"
    producer_host: str = "127.0.0.1"
    stall_timeout_s: float = DEFAULT_PULL_STALL_TIMEOUT_S
    label_outputs: bool = False
    start_wait_s: float = DEFAULT_START_WAIT_S


class LoRASource(WeightSource):
    """The adapters a LoRA trainer engine sends each round: ``adapters``, or
    a function returning them, called once per round. As a ``WeightSource``
    it yields every adapter's tensors under PEFT's names."""

    def __init__(
        self, adapters: Sequence[LoRAAdapter] | Callable[[], Sequence[LoRAAdapter]]
    ) -> None:
        self._adapters = adapters

    @classmethod
    def from_peft_model(
        cls, model: Any, name: str, lora_id: int, adapter_name: str = "default"
    ) -> Self:
        """Adapter ``adapter_name`` of a PEFT model, read anew each round
        (``LoRAAdapter.from_peft_model``), pushed as ``name`` / ``lora_id``."""
        return cls(
            lambda: [LoRAAdapter.from_peft_model(model, name, lora_id, adapter_name)]
        )

    def adapters(self) -> list[LoRAAdapter]:
        adapters = list(
            self._adapters() if callable(self._adapters) else self._adapters
        )
        if not adapters:
            raise ValueError("this LoRASource has no adapter to send")
        names = [a.name for a in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"a round sends each adapter name once, got {names}")
        return adapters

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors())

    def _tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [(n, t) for a in self.adapters() for n, t in a.tensors.items()]


class LoRATrainerWeightTransferEngine(TrainerWeightTransferEngine[LoRATrainerInitInfo]):
    """Pushes a ``LoRASource``'s adapters every round; see the module
    docstring."""

    init_info_cls = LoRATrainerInitInfo

    def __init__(
        self,
        init_info: LoRATrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: LoRASource,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.rank == 0)
        self.init_info = init_info
        self._source = source
        self.pusher: LoRAPusher | None = None
        # What the last round's receipts verified, one entry per adapter.
        self.last_publications: list[VerifiedPublication | None] = []
        if self.is_sender:
            self.pusher = LoRAPusher(client, **_pusher_options(init_info))

    @classmethod
    def trainer_init(
        cls,
        init_info: LoRATrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if not isinstance(init_info, LoRATrainerInitInfo):
            raise TypeError(
                f"the lora trainer engine takes a LoRATrainerInitInfo, got "
                f"{type(init_info).__name__}"
            )
        if not isinstance(source, LoRASource):
            raise TypeError(
                "the lora trainer engine sends adapters: pass source=LoRASource"
                "(...) (LoRASource.from_peft_model(model, name, lora_id), or "
                f"LoRASource([LoRAAdapter, ...])), got {type(source).__name__}"
            )
        return cls(init_info, client=client, source=source)

    def send_weights(self, weight_version: str | None = None) -> None:
        """Push every adapter of the source, each as its own update labelled
        ``weight_version``. ``last_publications`` then holds what each push's
        receipts verified (None where unverified); on non-sender ranks it
        stays empty."""
        self.last_publications = []
        if self.pusher is None:
            return
        for adapter in self._source.adapters():
            verified = self.pusher.push(adapter, version=weight_version)
            self.last_publications.append(verified)

    def shutdown(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None


def _pusher_options(info: LoRATrainerInitInfo) -> dict[str, Any]:
    """``info``'s fields as ``LoRAPusher``'s keywords: every field is one of
    them, under the same name."""
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
