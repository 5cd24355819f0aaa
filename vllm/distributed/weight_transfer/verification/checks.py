# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks on both ends of a publication.

Worker side: ``ManifestChecker`` admits every arriving tensor or slice against
the publication's manifest before it touches a weight, counts what landed and
writes the ``Receipt`` at finish. Trainer side: ``verify_receipts`` accepts a
publication only when every expected worker attests all of it. The data types
live in ``wire``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vllm.distributed.weight_transfer.common.wire_fields import check_int, dtype_name
from vllm.distributed.weight_transfer.verification.wire import (
    ChecksumMismatch,
    IncompleteUpdate,
    Manifest,
    ManifestEntry,
    ManifestMismatch,
    PublicationHeader,
    Receipt,
    ReceiptError,
    coverage_digest,
    some_names,
)

Delivery = Literal["full", "sliced"]


@dataclass(frozen=True)
class WholeTensors:
    """Whole tensors of one message, checked against ``manifest``
    (``ManifestChecker.whole_tensors``)."""

    manifest: Manifest
    # (name, dtype, shape, bytes) of each tensor, as listed
    items: tuple[tuple[str, Any, tuple[int, ...], int], ...]
    sizes: dict[str, int]  # bytes by name
    nbytes: int


# ---------------------------------------------------------------------------
# worker side: check before landing


class ManifestChecker:
    """Checks every arriving tensor or slice of one publication on one worker.

    Call ``admit`` (whole tensors) or ``admit_slice`` (part of a tensor) before
    the bytes touch a weight; both raise ``ManifestMismatch`` naming the tensor
    and the disagreement. Call ``landed`` once the bytes are in place. At
    finish, ``receipt`` attests what landed; it raises ``IncompleteUpdate`` if
    anything promised is missing.

    ``expected`` maps each tensor name this worker must receive to the bytes it
    receives of it (slice bytes as planned: a plan may read a tensor more than
    once or change its dtype, so they are not bounded by the manifest's). The
    default is every manifest entry in full, which is what a worker receives
    from a backend that ships whole tensors (``ipc``); a backend that ships
    slices (``sharded_rdt``) passes its plan's per-name bytes.
    """

    def __init__(
        self,
        header: PublicationHeader,
        manifest: Manifest,
        *,
        expected: Mapping[str, int] | None = None,
    ) -> None:
        header.check_manifest(manifest)
        self.header = header
        self.manifest = manifest
        # Whether this worker expects every entry in full (``admit_whole``'s
        # fast path relies on it).
        self._expects_manifest = expected is None
        if expected is None:
            expected = manifest.sizes
        else:
            unknown = [n for n in expected if n not in manifest.by_name]
            if unknown:
                raise ManifestMismatch(
                    f"this worker's plan expects tensor(s) {some_names(unknown)} that "
                    f"are not in publication {header.publication_id}'s manifest"
                )
        self.expected: dict[str, int] = dict(expected)
        self.expected_bytes = sum(self.expected.values())
        self._admitted: dict[str, int] = {}
        self._landed: dict[str, int] = {}
        self.bytes_landed = 0
        self.checksums_verified = 0

    def _entry(self, name: str) -> ManifestEntry:
        entry = self.manifest.by_name.get(name)
        if entry is None:
            raise ManifestMismatch(
                f"tensor {name!r} is not in publication "
                f"{self.header.publication_id}'s manifest "
                f"({self.manifest.count} tensors, digest "
                f"{self.manifest.digest[:16]}…); the update and the announced "
                "structure disagree"
            )
        if name not in self.expected:
            raise ManifestMismatch(
                f"tensor {name!r} arrived at this worker, whose plan does not "
                "include it"
            )
        return entry

    def admit(
        self,
        name: str,
        dtype: torch.dtype | str,
        shape: Sequence[int],
        nbytes: int | None = None,
    ) -> ManifestEntry:
        """Check a whole tensor before landing it; returns its manifest entry."""
        entry = self._entry(name)
        self._check_whole(entry, dtype, shape, nbytes)
        if self._admitted.get(name, 0):
            raise self._second_arrival(name)
        self._admitted[name] = self.expected[name]
        return entry

    def whole_tensors(self, views: Iterable[Any]) -> WholeTensors:
        """``views`` (objects with ``name``, ``dtype``, ``shape``, ``nbytes``:
        whole tensors of one message) checked against the manifest as
        ``admit`` checks each, without admitting them yet: what
        ``admit_whole`` and ``landed_whole`` take, for this manifest. A
        worker keeps it for a message layout that comes back sync after
        sync, so the per-tensor checks run once per layout."""
        items = []
        for v in views:
            entry = self._entry(v.name)
            self._check_whole(entry, v.dtype, v.shape, v.nbytes)
            items.append((v.name, v.dtype, tuple(v.shape), entry.nbytes))
        sizes = {name: nbytes for name, _, _, nbytes in items}
        if len(sizes) != len(items):
            counts = Counter(name for name, *_ in items)
            raise self._second_arrival(
                next(name for name, n in counts.items() if n > 1)
            )
        return WholeTensors(self.manifest, tuple(items), sizes, sum(sizes.values()))

    def admit_whole(self, tensors: WholeTensors) -> None:
        """``admit`` for each of ``tensors``, as one step when nothing of them
        was admitted before in this publication."""
        if tensors.manifest is not self.manifest:
            raise ValueError(
                "admit_whole: these tensors were checked against another manifest"
            )
        sizes = tensors.sizes
        if self._expects_manifest and self._admitted.keys().isdisjoint(sizes):
            self._admitted.update(sizes)
            return
        for name, dtype, shape, nbytes in tensors.items:
            self.admit(name, dtype, shape, nbytes)

    def landed_whole(self, tensors: WholeTensors) -> None:
        """``landed`` for each of ``tensors`` in full (after ``admit_whole``)."""
        sizes = tensors.sizes
        if (
            tensors.manifest is self.manifest
            and self._expects_manifest
            and self._landed.keys().isdisjoint(sizes)
            and sizes.items() <= self._admitted.items()
        ):
            # Each was admitted in full and none landed yet.
            self._landed.update(sizes)
            self.bytes_landed += tensors.nbytes
            return
        for name, nbytes in sizes.items():
            self.landed(name, nbytes)

    def _second_arrival(self, name: str) -> ManifestMismatch:
        return ManifestMismatch(
            f"tensor {name!r} arrives a second time in publication "
            f"{self.header.publication_id}"
        )

    def _check_whole(
        self,
        entry: ManifestEntry,
        dtype: torch.dtype | str,
        shape: Sequence[int],
        nbytes: int | None,
    ) -> None:
        """``ManifestMismatch`` unless a whole tensor of ``dtype``, ``shape``
        and ``nbytes`` is what ``entry`` lists."""
        name = entry.name
        dname = dtype_name(dtype)
        if dname != entry.dtype:
            raise ManifestMismatch(
                f"tensor {name!r} arrives as {dname} but the manifest says "
                f"{entry.dtype}"
            )
        if tuple(shape) != entry.shape:
            raise ManifestMismatch(
                f"tensor {name!r} arrives with shape {list(shape)} but the manifest "
                f"says {list(entry.shape)}"
            )
        if nbytes is not None and nbytes != entry.nbytes:
            raise ManifestMismatch(
                f"tensor {name!r} arrives as {nbytes} bytes but the manifest says "
                f"{entry.nbytes}"
            )

    def admit_slice(
        self, name: str, dtype: torch.dtype | str | None, nbytes: int
    ) -> None:
        """Check part of a tensor (``nbytes`` of it) before landing it.

        ``dtype`` is the slice's wire dtype, checked against the manifest;
        pass None when the plan transforms the dtype on the way.
        """
        entry = self._entry(name)
        if dtype is not None and dtype_name(dtype) != entry.dtype:
            raise ManifestMismatch(
                f"a slice of tensor {name!r} arrives as {dtype_name(dtype)} but the "
                f"manifest says {entry.dtype}"
            )
        check_int(nbytes, f"slice of {name!r} nbytes", 1)
        total = self._admitted.get(name, 0) + nbytes
        if total > self.expected[name]:
            raise ManifestMismatch(
                f"slices of tensor {name!r} add up to {total} bytes on this worker, "
                f"more than the {self.expected[name]} its plan expects"
            )
        self._admitted[name] = total

    def landed(self, name: str, nbytes: int) -> None:
        """Record that ``nbytes`` of an admitted tensor are in place."""
        total = self._landed.get(name, 0) + nbytes
        if total > self._admitted.get(name, 0):
            raise ManifestMismatch(
                f"{total} bytes of tensor {name!r} landed but only "
                f"{self._admitted.get(name, 0)} were admitted; call admit first"
            )
        self._landed[name] = total
        self.bytes_landed += nbytes

    def verify_checksum(self, what: str, expected: str, actual: str) -> None:
        """Compare a landed chunk's checksum with the trainer's."""
        if expected != actual:
            raise ChecksumMismatch(
                f"{what} of publication {self.header.publication_id} has checksum "
                f"{actual} on this worker but the trainer sent {expected}; the "
                "bytes changed in transit"
            )
        self.checksums_verified += 1

    @property
    def tensors_landed(self) -> int:
        if self._landed == self.expected:
            return len(self.expected)
        return sum(1 for n, b in self._landed.items() if b == self.expected[n])

    def missing(self) -> list[str]:
        """Names whose promised bytes have not all landed, in manifest order."""
        if self._landed == self.expected:
            return []
        return [
            e.name
            for e in self.manifest.entries
            if e.name in self.expected
            and self._landed.get(e.name, 0) != self.expected[e.name]
        ]

    def receipt(
        self,
        worker_rank: int,
        worker_device: str,
        timings: Mapping[str, float] | None = None,
    ) -> Receipt:
        """Attest what landed; ``IncompleteUpdate`` if anything is missing."""
        missing = self.missing()
        if missing:
            raise IncompleteUpdate(
                f"publication {self.header.publication_id} finished on worker "
                f"{worker_rank} with {len(missing)} of {len(self.expected)} "
                f"tensors incomplete ({some_names(missing)}); "
                f"{self.bytes_landed} of {self.expected_bytes} bytes landed"
            )
        return Receipt(
            publication_id=self.header.publication_id,
            model_version=self.header.model_version,
            worker_rank=worker_rank,
            worker_device=worker_device,
            manifest_digest=self.manifest.digest,
            scope=self.header.scope,
            tensors_landed=self.tensors_landed,
            bytes_landed=self.bytes_landed,
            expected_bytes=self.expected_bytes,
            complete=not missing,
            coverage=(
                self.manifest.full_coverage_digest()
                if self._landed == self.manifest.sizes
                else coverage_digest(self._landed.items())
            ),
            checksums_verified=self.checksums_verified,
            timings=dict(timings or {}),
        )


# ---------------------------------------------------------------------------
# trainer side: verify receipts


@dataclass(frozen=True)
class VerifiedPublication:
    """What ``verify_receipts`` established."""

    publication_id: str
    model_version: int
    workers: tuple[int, ...]
    bytes_landed: int
    checksums_verified: int


def verify_receipts(
    header: PublicationHeader,
    receipts: Iterable[Receipt],
    expected_workers: Collection[int] | int,
    *,
    delivery: Delivery = "full",
    expected_coverage: str | Mapping[int, str] | None = None,
) -> VerifiedPublication:
    """Check that every expected worker attests the whole publication.

    ``delivery="full"``: every worker received every manifest tensor whole, so
    each receipt must show the manifest's count, bytes and coverage.
    ``delivery="sliced"``: each worker received its planned share, so each
    receipt must be ``complete`` against its own plan; pass
    ``expected_coverage`` (one digest for all, or per rank) to also pin which
    tensors and byte counts landed. ``expected_workers`` is the set of worker
    ranks (one engine), or the number of distinct workers (several engines,
    whose ranks repeat; workers are then told apart by ``(rank, device)``).
    Raises ``ReceiptError`` listing every problem found.
    """
    problems: list[str] = []
    by_key, checked, workers = _match_workers(receipts, expected_workers, problems)
    for rank, device in checked:
        want = (
            expected_coverage.get(rank)
            if isinstance(expected_coverage, Mapping)
            else expected_coverage
        )
        problems += _receipt_problems(
            header, by_key[(rank, device)], delivery=delivery, coverage=want
        )
    checksums = sum(by_key[k].checksums_verified for k in checked)
    if problems:
        raise ReceiptError(
            f"publication {header.publication_id} (version {header.model_version}, "
            f"backend {header.backend}) is not verified: " + "; ".join(problems)
        )
    return VerifiedPublication(
        publication_id=header.publication_id,
        model_version=header.model_version,
        workers=workers,
        bytes_landed=sum(by_key[k].bytes_landed for k in checked),
        checksums_verified=checksums,
    )


def _match_workers(
    receipts: Iterable[Receipt],
    expected_workers: Collection[int] | int,
    problems: list[str],
) -> tuple[dict[tuple[int, str], Receipt], list[tuple[int, str]], tuple[int, ...]]:
    """Receipts by ``(rank, device)``, the keys to check, and the workers the
    publication counts as verified; a duplicate, missing or unexpected worker
    is added to ``problems``."""
    by_key: dict[tuple[int, str], Receipt] = {}
    for receipt in receipts:
        key = (receipt.worker_rank, receipt.worker_device)
        if key in by_key:
            problems.append(
                f"worker {receipt.worker_rank} ({receipt.worker_device}) sent two "
                "receipts"
            )
        by_key[key] = receipt
    if isinstance(expected_workers, int):
        # Several engines: ranks repeat, so count distinct workers.
        checked = sorted(by_key)
        if len(checked) != expected_workers:
            problems.append(
                f"receipts from {len(checked)} worker(s) "
                f"{[f'{rank} ({dev})' for rank, dev in checked]}, expected "
                f"{expected_workers}"
            )
        return by_key, checked, tuple(rank for rank, _ in checked)
    by_rank: dict[int, Receipt] = {}
    for (rank, _), receipt in sorted(by_key.items()):
        if rank in by_rank:
            problems.append(f"worker {rank} sent two receipts")
        by_rank[rank] = receipt
    expected = sorted(set(expected_workers))
    missing = [w for w in expected if w not in by_rank]
    if missing:
        problems.append(f"no receipt from worker(s) {missing}")
    unexpected = sorted(set(by_rank) - set(expected))
    if unexpected:
        problems.append(f"receipts from unexpected worker(s) {unexpected}")
    checked = [(w, by_rank[w].worker_device) for w in expected if w in by_rank]
    return by_key, checked, tuple(expected)


def _receipt_problems(
    header: PublicationHeader,
    r: Receipt,
    *,
    delivery: Delivery,
    coverage: str | None,
) -> list[str]:
    """What is wrong with one worker's receipt of ``header``'s publication."""
    who = f"worker {r.worker_rank} ({r.worker_device})"
    if r.error is not None:
        return [f"{who} failed: {r.error}"]
    problems = []
    if r.publication_id != header.publication_id:
        problems.append(
            f"{who} attests publication {r.publication_id}, not {header.publication_id}"
        )
    if r.model_version != header.model_version:
        problems.append(
            f"{who} attests version {r.model_version}, not {header.model_version}"
        )
    if r.manifest_digest != header.manifest_digest:
        problems.append(
            f"{who} checked against manifest {r.manifest_digest[:16]}…, not "
            f"{header.manifest_digest[:16]}…"
        )
    if header.checksum is not None and r.checksums_verified == 0:
        problems.append(f"{who} verified no checksums though they were sent")
    if delivery == "full":
        if (
            r.tensors_landed != header.manifest_count
            or r.bytes_landed != header.manifest_bytes
        ):
            problems.append(
                f"{who} landed {r.tensors_landed} tensors / {r.bytes_landed} "
                f"bytes; the manifest has {header.manifest_count} / "
                f"{header.manifest_bytes}"
            )
        if coverage is None and header.manifest is not None:
            coverage = header.manifest.full_coverage_digest()
    elif not r.complete:
        problems.append(
            f"{who} is incomplete: {r.bytes_landed} of {r.expected_bytes} "
            "planned bytes landed"
        )
    if coverage is not None and r.coverage != coverage:
        problems.append(
            f"{who} landed a different set of tensors or byte counts than "
            "was sent (coverage digest differs)"
        )
    return problems
