# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verified-sync settings every fork trainer takes (``VerifiedSyncSettings``)
and their checks (``check_verified_sync``), worded once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.verification import DEFAULT_RECEIPT_TIMEOUT_S

__all__ = ["VerifiedSyncSettings", "check_verified_sync"]


def check_verified_sync(
    owner: str,
    *,
    verify_publication: bool,
    verify_checksums: bool,
    model_version: int | None,
    receipt_timeout_s: float,
    checksums_need_publication: bool = True,
) -> None:
    """Raise ``ValueError`` naming ``owner`` when the settings disagree."""
    if checksums_need_publication and verify_checksums and not verify_publication:
        raise ValueError(
            f"{owner}.verify_checksums needs verify_publication=True: "
            "checksums travel in the publication header"
        )
    if model_version is not None and model_version < 0:
        raise ValueError(f"{owner}.model_version must be >= 0, got {model_version}")
    if receipt_timeout_s <= 0:
        raise ValueError(
            f"{owner}.receipt_timeout_s must be positive, got {receipt_timeout_s}"
        )


@dataclass(kw_only=True)
class VerifiedSyncSettings:
    """Verified publication settings, keyword-only fields of a trainer's init
    info.

    ``verify_publication`` (default on) sends a publication header and waits
    for every expected worker's receipt; turn it off only for a server whose
    workers do not understand the header. ``verify_checksums`` adds payload
    checksums (in the publication header, unless the class says
    ``checksums_need_publication = False``). ``model_version`` is the first
    publication's model version (then one more per send); without it, the
    version is the wall clock in microseconds (at least one more than the
    last), so a new trainer engine, or one resumed from an older checkpoint,
    still publishes a version the workers accept. ``weight_version`` stays a
    label: RL steps can repeat after a resume, and workers refuse versions
    that go backwards. ``receipt_timeout_s`` bounds the wait for receipts
    after ``finish_weight_update`` returned.

    ``__post_init__`` checks them (``check_verified_sync``); a subclass with
    its own ``__post_init__`` calls ``super().__post_init__()``."""

    checksums_need_publication: ClassVar[bool] = True

    verify_publication: bool = True
    verify_checksums: bool = False
    model_version: int | None = None
    receipt_timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S

    def __post_init__(self) -> None:
        check_verified_sync(
            type(self).__name__,
            verify_publication=self.verify_publication,
            verify_checksums=self.verify_checksums,
            model_version=self.model_version,
            receipt_timeout_s=self.receipt_timeout_s,
            checksums_need_publication=self.checksums_need_publication,
        )
