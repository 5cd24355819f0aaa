# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker lifecycle's handler of LoRA adapter messages (those with an
``adapter`` header; ``worker.handlers``), after the lifecycle's checks (not
aborted, not prepared, fence open). A message carrying an ``adapter_pull`` (a
trainer on another machine) is pulled over NIXL (``lora.pull.AdapterPuller``),
whatever the backend; any other has its tensors read from the trainer's one
buffer by the backend (``carried_tensors``: ``ipc`` maps it; a backend that
maps no trainer's buffers refuses it). Either way the bytes are checked
against the trainer's checksum when it sent one, and the tensors are staged
apart from the model and checked on the push's last message;
``finish_weight_update`` makes the adapter the version that serves. Any
failure or abort before that drops the staging; the model is never touched,
so nothing is fenced. A verified push's publication header is the adapter's
(``lora_publication``): its version is checked against the adapter name's own
order, never bound to the fence, and the prepare message writes the
adapter's receipt. The push's staging, receipt and commit are
``lora.adapters.AdapterPushes``."""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed.weight_transfer.landing.checkpoint_structure import (
    checkpoint_shapes,
)
from vllm.distributed.weight_transfer.lora.adapters import AdapterPushes
from vllm.distributed.weight_transfer.lora.pull import (
    ADAPTER_PULL_KEY,
    AdapterPull,
    AdapterPuller,
    payload_views,
)
from vllm.distributed.weight_transfer.lora.wire import (
    ADAPTER_KEY,
    AdapterHeader,
    adapter_header,
)
from vllm.distributed.weight_transfer.worker.handlers import MessageHandler
from vllm.distributed.weight_transfer.worker.lifecycle import global_worker_rank


class AdapterMessages(MessageHandler):
    """One worker engine's LoRA adapter pushes; see the module docstring."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        # The pushes' staging and commit, made on first use.
        self._pushes: AdapterPushes | None = None
        # Pulls of adapters from a trainer on another machine.
        self._puller: AdapterPuller | None = None

    @property
    def pushes(self) -> AdapterPushes:
        """This worker's LoRA adapter pushes (staging, commit)."""
        if self._pushes is None:
            engine = self.engine
            lora_config = getattr(engine.vllm_config, "lora_config", None)
            self._pushes = AdapterPushes(
                model=engine.model,
                base_shapes=checkpoint_shapes(engine.model_config),
                max_rank=getattr(lora_config, "max_lora_rank", None),
                # Adapter receipts name workers as expected_workers(client)
                # counts them, whichever backend this is.
                worker_rank=global_worker_rank(engine.vllm_config),
                worker_device=engine.pub.worker_device,
                receipt_root=engine.pub.receipt_root,
            )
        return self._pushes

    def handle(self, update_info: dict[str, Any]) -> bool:
        header = adapter_header(update_info)
        if header is None:
            return False
        # A LoRA adapter: staged apart from the model, committed at the
        # finish; its publication is the adapter's own.
        self.engine._session_for(f"adapter {header.name!r}")
        message = self.pushes.begin(header, update_info)
        if ADAPTER_PULL_KEY in message:
            self._pull(header, message)
        else:
            self._read(header, message)
        return True

    def prepare_header(self) -> Any:
        adapter = self._pushes.publication if self._pushes else None
        return adapter.header if adapter else None

    def prepare(self) -> None:
        if self._pushes is not None:
            # An adapter push cut short is refused before anything; a
            # verified one writes its receipt unless prepared.
            self._pushes.prepare()

    def commit(self) -> None:
        if self._pushes is not None:
            self._pushes.commit()

    def discard(self, reason: str | None = None) -> None:
        if self._pushes is not None:
            self._pushes.discard(reason)

    def close(self) -> None:
        puller, self._puller = self._puller, None
        if puller is not None:
            puller.close()

    def _read(self, header: AdapterHeader, message: dict[str, Any]) -> None:
        """An adapter push from a colocated trainer: the backend reads the
        tensors from the trainer's one buffer through a mapping of their own
        (released at once, so the mappings kept for base-weight syncs stay as
        they are); their bytes are checked against the trainer's checksum
        when it sent one, then copied into the adapter staging."""
        engine = self.engine
        carried = engine.carried_tensors(
            {k: v for k, v in message.items() if k != ADAPTER_KEY}
        )
        if carried is None:
            raise ValueError(
                f"the {engine.backend_name} backend does not map a trainer's "
                f"buffers (adapter {header.name!r}); push adapters to it with "
                "LoRAPusher(transport='nixl'), which it pulls from"
            )
        if carried.upstream_wire:
            raise ValueError(
                f"adapter {header.name!r}: adapters travel on the fork's wire only"
            )
        if carried.buffer_count != 1:
            # (Its one checksum covers one buffer's bytes.)
            raise ValueError(
                f"adapter {header.name!r}: an adapter travels packed in one "
                f"buffer; this message names {carried.buffer_count}"
            )
        pushes = self.pushes
        with carried.read("adapter") as read:
            expected = pushes.expected_checksum(header)
            if expected is not None:
                # The trainer's bytes as they arrived, before anything is kept.
                self._check_checksum(header, expected, read.payloads[0])
            pushes.receive(header, read.tensors())

    def _pull(self, header: AdapterHeader, message: dict[str, Any]) -> None:
        """An adapter push from a trainer on another machine: pull the
        packed adapter over NIXL, check its bytes against the trainer's
        checksum when it sent one, and stage its tensors; receipts go back
        through the producer it came from."""
        pull = AdapterPull.from_dict(message[ADAPTER_PULL_KEY])
        pushes = self.pushes
        # Checked against the header before a byte is pulled.
        pushes.check_layout(header, message, payload_bytes=pull.nbytes)
        puller = self._puller
        if puller is None:
            puller = self._puller = AdapterPuller(self.engine.device)
        publication = pushes.publication
        if publication is not None:
            publication.producer_call = puller.deliver_receipt
        payload = puller.pull(pull)
        tensors = payload_views(payload, message)
        expected = pushes.expected_checksum(header)
        if expected is not None:
            self._check_checksum(header, expected, payload)
        pushes.receive(header, tensors)

    def _check_checksum(
        self, header: AdapterHeader, expected: str, payload: torch.Tensor
    ) -> None:
        """``payload``'s bytes (uint8) against the trainer's checksum."""
        from vllm.distributed.weight_transfer.verification.checksum import (
            payload_checksum,
        )

        self.pushes.check_checksum(header, expected, payload_checksum(payload))
