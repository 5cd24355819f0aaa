# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verified publication: every piece of it, and the names engines import.

A weight update is a *publication*: the trainer announces what it sends, each
worker checks what arrives before it lands and attests what landed, and the
trainer makes the new version visible only once every worker attested all of
it. The modules:

* ``wire``: the plain data that travels: ``PublicationHeader``, ``Manifest``,
  ``Receipt``, the errors, ``attach_publication`` / ``pop_publication``.
* ``checks``: ``ManifestChecker`` (worker, before landing) and
  ``verify_receipts`` (trainer, after finish).
* ``checksum``: ``payload_checksum``, the ``ws1`` checksum computed on the
  device that holds the bytes.
* ``receipts``: how receipts get back to the trainer (a shared-memory
  directory, or the producers of ``sharded_rdt``).
* ``fence``: the worker's ``WeightFence`` after a failed update, the abort
  message, and the trainer's fenced served version.
* ``publication``: ``TrainerPublication`` and ``WorkerPublication``, which
  drive all of the above around one sync, one object per side.

Engines import from this package; the modules import each other directly.
``docs/training/weight_transfer/verification.md`` describes the protocol.
"""

from vllm.distributed.weight_transfer.verification.checks import (
    ManifestChecker,
    VerifiedPublication,
    WholeTensors,
    verify_receipts,
)
from vllm.distributed.weight_transfer.verification.checksum import payload_checksum
from vllm.distributed.weight_transfer.verification.fence import (
    ABORT_FIELD,
    PREPARE_FIELD,
    WeightsFencedError,
    WeightState,
    abort_reason,
    check_model_version,
    fenced_message,
    fenced_version,
    is_fenced_version,
    is_prepare_request,
    set_served_version,
)
from vllm.distributed.weight_transfer.verification.publication import (
    TrainerPublication,
    WorkerPublication,
    device_identity,
    expected_workers,
    served_world_size,
)
from vllm.distributed.weight_transfer.verification.receipts import (
    DEFAULT_RECEIPT_TIMEOUT_S,
    ReceiptInbox,
    ReceiptTimeoutError,
)
from vllm.distributed.weight_transfer.verification.wire import (
    ChecksumMismatch,
    IncompleteUpdate,
    Manifest,
    ManifestMismatch,
    PublicationHeader,
    Receipt,
    ReceiptError,
    attach_publication,
    coverage_digest,
    describe_error,
    pop_publication,
)

__all__ = [
    # wire
    "ChecksumMismatch",
    "IncompleteUpdate",
    "Manifest",
    "ManifestMismatch",
    "PublicationHeader",
    "Receipt",
    "ReceiptError",
    "attach_publication",
    "coverage_digest",
    "describe_error",
    "pop_publication",
    # checks
    "ManifestChecker",
    "WholeTensors",
    "VerifiedPublication",
    "verify_receipts",
    # checksum
    "payload_checksum",
    # receipts
    "DEFAULT_RECEIPT_TIMEOUT_S",
    "ReceiptInbox",
    "ReceiptTimeoutError",
    # fence
    "ABORT_FIELD",
    "PREPARE_FIELD",
    "WeightState",
    "WeightsFencedError",
    "abort_reason",
    "check_model_version",
    "is_prepare_request",
    "fenced_message",
    "fenced_version",
    "is_fenced_version",
    "set_served_version",
    # publication
    "TrainerPublication",
    "WorkerPublication",
    "device_identity",
    "expected_workers",
    "served_world_size",
]
