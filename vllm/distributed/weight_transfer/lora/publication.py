# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of a verified LoRA adapter push: the receipt it writes.

A trainer that verifies adapter pushes (``LoRAPusher``, on by default) sends a
``PublicationHeader`` in the push's message, next to its ``adapter`` header;
the manifest lists the adapter's tensors (PEFT names, dtypes, shapes). The
format is that of base-weight publications (``verification``); what differs
is what is attested and how versions are ordered:

* Every worker admits each tensor against the manifest before it copies it
  into the adapter staging, counts what it staged and, at the trainer's
  prepare message, writes a ``Receipt``: the names and bytes it staged (the
  coverage digest), the payload checksums it verified. The trainer commits
  the push only once the receipt of every worker of every engine verified.
* The model version orders one adapter's versions, by name
  (``MemoryAdapters.model_version``): a push older than the version its name
  serves (or beyond the wall-clock ceiling, ``check_model_version``) is
  refused at its first message, before anything is staged. The engine's
  ``WeightFence`` never sees an adapter's publication, so an adapter push
  neither moves the base weights' committed version nor fences them.
* A push that fails or is aborted before its commit sends a failure receipt
  saying the weights are intact: the version before keeps serving, and the
  base weights were never touched.

``AdapterPublication`` is one push's side of that on one worker;
``lora_adapters.AdapterPushes`` owns it from the first message to the commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.verification import (
    ChecksumMismatch,
    ManifestChecker,
    ManifestMismatch,
    PublicationHeader,
    Receipt,
    describe_error,
)
from vllm.distributed.weight_transfer.verification.receipts import sink_for
from vllm.logger import init_logger

logger = init_logger(__name__)


class AdapterPublication:
    """One verified adapter push on one worker: the checker that admits each
    tensor before it is staged, the checksums of the message at hand, and the
    receipt, written once (``prepare``)."""

    def __init__(
        self,
        header: PublicationHeader,
        adapter: str,
        *,
        worker_rank: int,
        worker_device: str,
        receipt_root: str | Path | None = None,
    ) -> None:
        if header.manifest is None:
            raise ManifestMismatch(
                f"adapter {adapter!r}: the first message of publication "
                f"{header.publication_id} carries no manifest"
            )
        self.header = header
        self.adapter = adapter
        self.worker_rank = worker_rank
        self.worker_device = worker_device
        self.receipt_root = receipt_root
        self.checker = ManifestChecker(header, header.manifest)
        # The payload checksums of the message being received, by buffer.
        self.message_checksums: list[str] | None = None
        self.receipt: Receipt | None = None
        # Delivers receipts on the ``"producer"`` channel: set by the worker
        # when the adapter was pulled from a producer (``lora_pull``).
        self.producer_call: Callable[[dict[str, Any]], object] | None = None

    def _sink(self) -> Any:
        return sink_for(
            self.header,
            producer_call=self.producer_call,
            receipt_root=self.receipt_root,
        )

    def next_message(
        self, header: PublicationHeader | None, checksums: list[str] | None
    ) -> None:
        """A later message of the push: it must belong to this publication."""
        if header is None or header.publication_id != self.header.publication_id:
            got = header.publication_id if header is not None else "none"
            raise ValueError(
                f"adapter {self.adapter!r}: a message of publication {got} in "
                f"the push of publication {self.header.publication_id}; every "
                "message of a verified push carries its publication"
            )
        self.message_checksums = checksums

    def expected_checksum(self) -> str | None:
        """The trainer's checksum of the message's buffer (None when the
        publication sends none); ``ChecksumMismatch`` when it promised one
        and the message has none."""
        if self.header.checksum is None:
            return None
        sums = self.message_checksums
        if not sums:
            raise ChecksumMismatch(
                f"adapter {self.adapter!r}: publication "
                f"{self.header.publication_id} promises checksums but the "
                "message carries none"
            )
        return sums[0]

    def checksum_verified(self, expected: str, actual: str) -> None:
        self.checker.verify_checksum(
            f"adapter {self.adapter!r}'s buffer", expected, actual
        )

    def admit(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Check each tensor against the manifest before it is staged."""
        for name, tensor in tensors:
            self.checker.admit(name, tensor.dtype, tuple(tensor.shape))

    def staged(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.checker.landed(name, tensor.numel() * tensor.element_size())

    def prepare(self) -> Receipt:
        """Write this worker's receipt (once): ``IncompleteUpdate`` when a
        tensor of the manifest was not staged; a receipt that cannot be
        delivered raises."""
        if self.receipt is None:
            receipt = self.checker.receipt(self.worker_rank, self.worker_device)
            sink = self._sink()
            if sink is not None:
                sink.deliver(receipt)
            self.receipt = receipt
        return self.receipt

    def fail(self, reason: str) -> None:
        """Tell the trainer this worker refused the push, best effort; the
        adapter serving before and the base weights are untouched."""
        receipt = Receipt.failure(
            self.header,
            self.worker_rank,
            self.worker_device,
            f"adapter {self.adapter!r}: {describe_error(reason)}",
            weights_intact=True,
        )
        try:
            sink = self._sink()
            if sink is not None:
                sink.deliver(receipt)
        except Exception as e:
            logger.warning(
                "could not deliver the failure receipt of adapter %r: %s",
                self.adapter,
                e,
            )
