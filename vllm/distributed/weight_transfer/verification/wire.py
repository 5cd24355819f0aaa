# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The wire data of a publication: what an update claims, what workers attest.

A *publication* is one weight update (one ``start -> update* -> finish``). The
trainer describes it with a ``PublicationHeader`` that travels in every update
message under the key ``"publication"``; each worker checks what it receives
against the header's ``Manifest`` with a ``ManifestChecker`` before any weight
is touched, and attests at finish with a ``Receipt``. The trainer accepts the
update, and only then makes its version visible, when ``verify_receipts``
passes for every worker. The checker and ``verify_receipts`` live in
``checks``; fencing after a failure in ``fence``.

Everything here is plain data: frozen dataclasses validated in
``__post_init__``, with ``to_dict``/``from_dict`` to plain JSON. Backends
decide how headers and receipts travel (see ``receipts``).

Lifecycle (the building blocks; ``publication`` bundles them per side, and
``docs/training/weight_transfer/verification.md`` wires them per backend)::

    trainer                                 worker
    -------                                 ------
    manifest = Manifest.from_params(metas)
    header = PublicationHeader.create(...)
    client.start_weight_update()            fence.start()
    msg = attach_publication(               h, sums, info = pop_publication(msg)
        info, header, checksums)            checker = ManifestChecker(h, manifest)
    client.update_weights(msg)              checker.admit(name, dtype, shape)
                                            ... land the tensor ...
                                            checker.landed(name, nbytes)
    client.finish_weight_update()           receipt = checker.receipt(rank, dev)
                                            deliver(receipt); fence.finish()
    verify_receipts(header, receipts, ranks)
    set the served version
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, Literal, Protocol

import torch

from vllm.distributed.weight_transfer.common.wire_fields import (
    check_fields,
    check_int,
    dtype_from_name,
    dtype_name,
    remember_newest,
)

PUBLICATION_FIELD = "publication"
CHECKSUMS_FIELD = "payload_checksums"
MANIFEST_FORMAT = 1
# Manifests this process parsed and checked, by digest, newest last: a
# message whose entries equal one of them (compared entry by entry, not
# trusted by digest) reuses it instead of parsing and hashing them again.
_PARSED_MANIFESTS: dict[str, Manifest] = {}
_PARSED_MANIFESTS_KEPT = 4
# Every publication sends every manifest tensor. The field stays on the wire
# and is checked, so a sender that announces anything else is refused.
Scope = Literal["full"]
ReceiptChannelKind = Literal["shm", "producer", "none"]

# Matched with fullmatch: ``$`` would accept a trailing newline.
_PUBLICATION_ID_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
# How many names an error message lists before summarizing.
_LIST_LIMIT = 8


class ManifestMismatch(ValueError):
    """A tensor (or the manifest itself) disagrees with the publication."""


class ChecksumMismatch(RuntimeError):
    """Bytes that landed differ from the bytes the trainer checksummed."""


class IncompleteUpdate(RuntimeError):
    """A worker reached finish without every tensor it was promised."""


class ReceiptError(RuntimeError):
    """The receipts of a publication do not prove it landed everywhere."""


class ParamLike(Protocol):
    """Anything with the fields of ``ParamMeta``."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> Sequence[int]: ...


# ---------------------------------------------------------------------------
# helpers


def describe_error(error: BaseException | str) -> str:
    """The text a fence reason, receipt or log line shows for ``error``: its
    message, or its type name when the message is empty (``AssertionError()``,
    ``TimeoutError()``), so a rejection never reads as blank."""
    text = str(error).strip()
    if text:
        return text
    if isinstance(error, BaseException):
        return f"{type(error).__name__} (raised without a message)"
    return "unknown failure (no reason given)"


def _check_str(value: object, where: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")


def _check_digest(value: object, where: str) -> None:
    if not isinstance(value, str) or not _DIGEST_RE.fullmatch(value):
        raise ValueError(f"{where} must be 64 lowercase hex digits, got {value!r}")


def _sha256_json(tag: str, payload: object) -> str:
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(f"{tag}\n{text}".encode("ascii")).hexdigest()


def some_names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_LIST_LIMIT])
    more = len(names) - _LIST_LIMIT
    return shown + (f" and {more} more" if more > 0 else "")


def coverage_digest(landed: Iterable[tuple[str, int]]) -> str:
    """Digest of a set of ``(tensor name, bytes landed)``, order-insensitive.

    A worker reports it in its receipt; the trainer recomputes it from what it
    sent to check that exactly those tensors landed, each in full.
    """
    return _sha256_json("vllm-wt-coverage-v1", sorted(landed))


# ---------------------------------------------------------------------------
# manifest


@dataclass(frozen=True)
class ManifestEntry:
    """One tensor of a publication: checkpoint name, wire dtype, full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        _check_str(self.name, "manifest entry name")
        where = f"manifest entry {self.name!r}"
        itemsize = dtype_from_name(self.dtype, f"{where} dtype").itemsize
        if not isinstance(self.shape, tuple):
            raise ValueError(f"{where} shape must be a tuple, got {self.shape!r}")
        for d in self.shape:
            check_int(d, f"{where} shape {self.shape}")
        expected = math.prod(self.shape) * itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"{where} has nbytes {self.nbytes!r} but {self.dtype} "
                f"{list(self.shape)} is {expected} bytes"
            )

    @classmethod
    def of(
        cls, name: str, dtype: torch.dtype | str, shape: Sequence[int]
    ) -> ManifestEntry:
        dname = dtype_name(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = (
            math.prod(shape) * dtype_from_name(dname, f"dtype of {name!r}").itemsize
        )
        return cls(name, dname, shape, nbytes)

    def to_list(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nbytes]

    @classmethod
    def from_list(cls, item: object, where: str) -> ManifestEntry:
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(f"{where} must be [name, dtype, shape, nbytes]")
        name, dtype, shape, nbytes = item
        if not isinstance(shape, list):
            raise ValueError(f"{where} shape must be a list, got {shape!r}")
        return cls(name, dtype, tuple(shape), nbytes)


@dataclass(frozen=True)
class Manifest:
    """The ordered structure of a publication; its digest names it."""

    entries: tuple[ManifestEntry, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple):
            raise ValueError("Manifest.entries must be a tuple of ManifestEntry")
        seen: set[str] = set()
        dups = []
        for e in self.entries:
            if not isinstance(e, ManifestEntry):
                raise ValueError(f"Manifest entry {e!r} is not a ManifestEntry")
            if e.name in seen:
                dups.append(e.name)
            seen.add(e.name)
        if dups:
            raise ValueError(f"manifest names are not unique: {some_names(dups)}")

    @classmethod
    def from_params(cls, params: Iterable[ParamLike]) -> Manifest:
        """Build from ``ParamMeta``-like objects (``WeightSource.metadata()``)."""
        return cls(tuple(ManifestEntry.of(p.name, p.dtype, p.shape) for p in params))

    @cached_property
    def digest(self) -> str:
        """sha256 over the ordered ``[name, dtype, shape, nbytes]`` of every entry."""
        return _sha256_json(f"vllm-wt-manifest-v{MANIFEST_FORMAT}", self._entry_lists)

    @cached_property
    def _entry_lists(self) -> list[list[Any]]:
        # Built once: the digest and every message carrying the manifest use
        # it (tens of milliseconds for ten thousand entries). Read only.
        return [e.to_list() for e in self.entries]

    @cached_property
    def by_name(self) -> dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}

    @property
    def count(self) -> int:
        return len(self.entries)

    @cached_property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def difference(self, other: Manifest) -> str | None:
        """The first way ``other`` differs from this manifest, in words; None
        when they are equal."""
        if other.digest == self.digest:
            return None
        theirs = other.by_name
        for e in self.entries:
            o = theirs.get(e.name)
            if o is None:
                return f"tensor {e.name!r} is missing"
            if (o.dtype, o.shape) != (e.dtype, e.shape):
                return (
                    f"tensor {e.name!r} is {o.dtype} {list(o.shape)} instead of "
                    f"{e.dtype} {list(e.shape)}"
                )
        extra = [e.name for e in other.entries if e.name not in self.by_name]
        if extra:
            return f"it has extra tensor(s) {some_names(extra)}"
        return "the tensors come in a different order"

    @cached_property
    def sizes(self) -> dict[str, int]:
        """Bytes of each entry, by name (read only)."""
        return {e.name: e.nbytes for e in self.entries}

    @cached_property
    def _full_coverage(self) -> str:
        return coverage_digest(self.sizes.items())

    def full_coverage_digest(self) -> str:
        """``coverage_digest`` of every entry landed in full (computed once
        per manifest object)."""
        return self._full_coverage

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "digest": self.digest,
            # A copy: whoever holds the message may change it.
            "entries": [[n, d, list(shape), b] for n, d, shape, b in self._entry_lists],
        }

    @classmethod
    def from_dict(cls, d: object) -> Manifest:
        d = check_fields(
            d, {"format", "digest", "entries"}, {"format", "entries"}, "manifest"
        )
        if d["format"] != MANIFEST_FORMAT:
            raise ValueError(
                f"manifest format is {d['format']!r}; this vLLM reads format "
                f"{MANIFEST_FORMAT}. Use the same fork version on trainer and server"
            )
        if not isinstance(d["entries"], list):
            raise ValueError("manifest.entries must be a list")
        claimed = d.get("digest")
        known = _PARSED_MANIFESTS.get(claimed) if isinstance(claimed, str) else None
        if known is not None and known._entry_lists == d["entries"]:
            # The same entries as a manifest parsed and checked before (a
            # trainer publishes the same structure at every sync).
            return known
        manifest = cls(
            tuple(
                ManifestEntry.from_list(item, f"manifest.entries[{i}]")
                for i, item in enumerate(d["entries"])
            )
        )
        if "digest" in d and d["digest"] != manifest.digest:
            raise ManifestMismatch(
                f"manifest digest field is {d['digest']!r} but its entries hash to "
                f"{manifest.digest!r}; the manifest was altered in transit"
            )
        remember_newest(
            _PARSED_MANIFESTS, manifest.digest, manifest, _PARSED_MANIFESTS_KEPT
        )
        return manifest


# ---------------------------------------------------------------------------
# header


@dataclass(frozen=True)
class PublicationHeader:
    """Travels with every update message of one publication.

    ``manifest`` (the entries) rides at least on the first message; later
    messages may carry only the digest, counts and bytes. ``payload_bytes`` is
    the tensor bytes the publication carries, each tensor counted once: the
    manifest's bytes, as every publication is full. ``receipt_dir`` is set iff
    ``receipt_channel == "shm"``.
    """

    publication_id: str
    backend: str
    model_version: int
    manifest_digest: str
    manifest_count: int
    manifest_bytes: int
    payload_bytes: int
    trainer_world_size: int
    trainer_devices: tuple[str, ...]
    scope: Scope = "full"
    checksum: str | None = None
    receipt_channel: ReceiptChannelKind = "none"
    receipt_dir: str | None = None
    manifest: Manifest | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.publication_id, str) or not _PUBLICATION_ID_RE.fullmatch(
            self.publication_id
        ):
            raise ValueError(
                f"publication_id {self.publication_id!r} must be 8-64 characters "
                "of letters, digits, '_' or '-'"
            )
        _check_str(self.backend, "publication.backend")
        check_int(self.model_version, "publication.model_version")
        _check_digest(self.manifest_digest, "publication.manifest_digest")
        check_int(self.manifest_count, "publication.manifest_count")
        check_int(self.manifest_bytes, "publication.manifest_bytes")
        check_int(self.payload_bytes, "publication.payload_bytes")
        check_int(self.trainer_world_size, "publication.trainer_world_size", 1)
        if not isinstance(self.trainer_devices, tuple) or not all(
            isinstance(d, str) and d for d in self.trainer_devices
        ):
            raise ValueError(
                "publication.trainer_devices must be a list of device identities, "
                f"got {self.trainer_devices!r}"
            )
        if len(self.trainer_devices) != self.trainer_world_size:
            raise ValueError(
                f"publication.trainer_devices has {len(self.trainer_devices)} "
                f"entries but trainer_world_size is {self.trainer_world_size}"
            )
        if self.scope != "full":
            raise ValueError(
                f"publication.scope is {self.scope!r}; this vLLM accepts only "
                "'full' (every manifest tensor is sent)"
            )
        if self.payload_bytes != self.manifest_bytes:
            raise ValueError(
                f"publication.payload_bytes is {self.payload_bytes} but a full "
                f"update carries the whole manifest ({self.manifest_bytes} bytes)"
            )
        if self.checksum is not None:
            from vllm.distributed.weight_transfer.verification.checksum import ALGORITHM

            if self.checksum != ALGORITHM:
                raise ValueError(
                    f"publication.checksum is {self.checksum!r}; this vLLM "
                    f"verifies {ALGORITHM!r} (or null for no checksums)"
                )
        if self.receipt_channel not in ("shm", "producer", "none"):
            raise ValueError(
                f"publication.receipt_channel is {self.receipt_channel!r}; expected "
                "'shm', 'producer' or 'none'"
            )
        if (self.receipt_channel == "shm") != (self.receipt_dir is not None):
            raise ValueError(
                "publication.receipt_dir must be set exactly when receipt_channel "
                f"is 'shm' (channel {self.receipt_channel!r}, dir {self.receipt_dir!r})"
            )
        if self.manifest is not None:
            if not isinstance(self.manifest, Manifest):
                raise ValueError("publication.manifest must be a Manifest")
            self.check_manifest(self.manifest)

    @classmethod
    def create(
        cls,
        *,
        backend: str,
        model_version: int,
        manifest: Manifest,
        trainer_devices: Sequence[str],
        checksum: str | None = None,
        receipt_channel: ReceiptChannelKind = "none",
        receipt_dir: str | None = None,
        publication_id: str | None = None,
    ) -> PublicationHeader:
        """A new publication of ``manifest``, with a fresh random id."""
        return cls(
            publication_id=publication_id or uuid.uuid4().hex,
            backend=backend,
            model_version=model_version,
            manifest_digest=manifest.digest,
            manifest_count=manifest.count,
            manifest_bytes=manifest.total_bytes,
            payload_bytes=manifest.total_bytes,
            trainer_world_size=len(trainer_devices),
            trainer_devices=tuple(trainer_devices),
            checksum=checksum,
            receipt_channel=receipt_channel,
            receipt_dir=receipt_dir,
            manifest=manifest,
        )

    def check_manifest(self, manifest: Manifest) -> None:
        """Raise ``ManifestMismatch`` unless ``manifest`` is the one announced."""
        if (
            manifest.digest != self.manifest_digest
            or manifest.count != self.manifest_count
            or manifest.total_bytes != self.manifest_bytes
        ):
            raise ManifestMismatch(
                f"publication {self.publication_id} announces manifest "
                f"{self.manifest_digest[:16]}… ({self.manifest_count} tensors, "
                f"{self.manifest_bytes} bytes) but the manifest at hand is "
                f"{manifest.digest[:16]}… ({manifest.count} tensors, "
                f"{manifest.total_bytes} bytes); trainer and server disagree on "
                "the model's structure"
            )

    def without_manifest(self) -> PublicationHeader:
        """The same header without the entries, for the later messages."""
        return replace(self, manifest=None)

    def changed_fields(self, other: PublicationHeader) -> list[str]:
        """The fields in which ``other`` differs from this header, the
        manifest's entries aside (a later message may leave them out)."""
        return [
            f.name
            for f in fields(self)
            if f.compare and getattr(self, f.name) != getattr(other, f.name)
        ]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "publication_id": self.publication_id,
            "backend": self.backend,
            "model_version": self.model_version,
            "manifest_digest": self.manifest_digest,
            "manifest_count": self.manifest_count,
            "manifest_bytes": self.manifest_bytes,
            "payload_bytes": self.payload_bytes,
            "trainer_world_size": self.trainer_world_size,
            "trainer_devices": list(self.trainer_devices),
            "scope": self.scope,
            "checksum": self.checksum,
            "receipt_channel": self.receipt_channel,
            "receipt_dir": self.receipt_dir,
        }
        if self.manifest is not None:
            d["manifest"] = self.manifest.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: object) -> PublicationHeader:
        required = {
            "publication_id",
            "backend",
            "model_version",
            "manifest_digest",
            "manifest_count",
            "manifest_bytes",
            "payload_bytes",
            "trainer_world_size",
            "trainer_devices",
        }
        optional = {"scope", "checksum", "receipt_channel", "receipt_dir", "manifest"}
        d = check_fields(d, required | optional, required, "publication")
        kwargs = dict(d)
        if not isinstance(kwargs["trainer_devices"], list):
            raise ValueError("publication.trainer_devices must be a list")
        kwargs["trainer_devices"] = tuple(kwargs["trainer_devices"])
        if kwargs.get("manifest") is not None:
            kwargs["manifest"] = Manifest.from_dict(kwargs["manifest"])
        return cls(**kwargs)


def attach_publication(
    update_info: dict[str, Any],
    header: PublicationHeader,
    checksums: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A copy of ``update_info`` carrying ``header`` under ``"publication"``.

    ``checksums`` (one per payload buffer of this message, in the backend's
    buffer order) ride under ``"payload_checksums"``.
    """
    taken = sorted({PUBLICATION_FIELD, CHECKSUMS_FIELD} & set(update_info))
    if taken:
        raise ValueError(
            f"update_info already has field(s) {taken}; attach the header once "
            "per message"
        )
    out = {**update_info, PUBLICATION_FIELD: header.to_dict()}
    if checksums is not None:
        out[CHECKSUMS_FIELD] = list(checksums)
    return out


def pop_publication(
    update_info: dict[str, Any],
) -> tuple[PublicationHeader | None, list[str] | None, dict[str, Any]]:
    """Split an update message into its header, its payload checksums (None
    when absent) and the rest, which the backend's own wire class parses
    unchanged."""
    if not isinstance(update_info, dict) or not (
        {PUBLICATION_FIELD, CHECKSUMS_FIELD} & set(update_info)
    ):
        return None, None, update_info
    rest = {
        k: v
        for k, v in update_info.items()
        if k not in (PUBLICATION_FIELD, CHECKSUMS_FIELD)
    }
    header = None
    if PUBLICATION_FIELD in update_info:
        header = PublicationHeader.from_dict(update_info[PUBLICATION_FIELD])
    checksums = update_info.get(CHECKSUMS_FIELD)
    if checksums is not None and (
        not isinstance(checksums, list)
        or not all(isinstance(c, str) for c in checksums)
    ):
        raise ValueError(
            f"update_info.{CHECKSUMS_FIELD} must be a list of strings, got "
            f"{checksums!r}"
        )
    if checksums is not None and header is None:
        raise ValueError(
            f"update_info has {CHECKSUMS_FIELD} but no {PUBLICATION_FIELD} header"
        )
    return header, checksums, rest


# ---------------------------------------------------------------------------
# receipt


@dataclass(frozen=True)
class Receipt:
    """A worker's attestation of what landed for one publication.

    ``complete`` is the worker's own verdict: every byte it was promised
    (``expected_bytes``) landed. ``coverage`` is ``coverage_digest`` over the
    ``(name, bytes)`` that landed. ``error`` is set when the worker failed; such
    a receipt never verifies, and ``weights_intact`` then says whether the
    worker's served weights are still exactly the previous ones (a refused or
    staged update) or not (it fenced itself). ``timings`` holds phase
    durations in seconds.
    """

    publication_id: str
    model_version: int
    worker_rank: int
    worker_device: str
    manifest_digest: str
    scope: Scope
    tensors_landed: int
    bytes_landed: int
    expected_bytes: int
    complete: bool
    coverage: str
    checksums_verified: int = 0
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    weights_intact: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.publication_id, str) or not _PUBLICATION_ID_RE.fullmatch(
            self.publication_id
        ):
            raise ValueError(
                f"receipt publication_id {self.publication_id!r} is invalid"
            )
        check_int(self.model_version, "receipt.model_version")
        check_int(self.worker_rank, "receipt.worker_rank")
        _check_str(self.worker_device, "receipt.worker_device")
        _check_digest(self.manifest_digest, "receipt.manifest_digest")
        if self.scope != "full":
            raise ValueError(f"receipt.scope is {self.scope!r}; expected 'full'")
        check_int(self.tensors_landed, "receipt.tensors_landed")
        check_int(self.bytes_landed, "receipt.bytes_landed")
        check_int(self.expected_bytes, "receipt.expected_bytes")
        if not isinstance(self.complete, bool):
            raise ValueError(f"receipt.complete must be a bool, got {self.complete!r}")
        _check_digest(self.coverage, "receipt.coverage")
        check_int(self.checksums_verified, "receipt.checksums_verified")
        if self.error is not None and not isinstance(self.error, str):
            raise ValueError(f"receipt.error must be a string or null: {self.error!r}")
        if self.weights_intact is not None and not isinstance(
            self.weights_intact, bool
        ):
            raise ValueError(
                "receipt.weights_intact must be a bool or null: "
                f"{self.weights_intact!r}"
            )
        if not isinstance(self.timings, dict) or not all(
            isinstance(k, str)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            for k, v in self.timings.items()
        ):
            raise ValueError(
                f"receipt.timings must map phase -> seconds: {self.timings!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        # Every field, in declaration order; ``timings`` as a copy.
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["timings"] = dict(self.timings)
        return d

    @classmethod
    def from_dict(cls, d: object) -> Receipt:
        names = set(cls.__dataclass_fields__)
        required = names - {"checksums_verified", "error", "timings", "weights_intact"}
        d = check_fields(d, names, required, "receipt")
        return cls(**d)

    @classmethod
    def failure(
        cls,
        header: PublicationHeader,
        worker_rank: int,
        worker_device: str,
        error: str,
        weights_intact: bool | None = None,
    ) -> Receipt:
        """A receipt reporting that this worker failed the publication, and
        whether its served weights are still the previous ones."""
        return cls(
            publication_id=header.publication_id,
            model_version=header.model_version,
            worker_rank=worker_rank,
            worker_device=worker_device,
            manifest_digest=header.manifest_digest,
            scope=header.scope,
            tensors_landed=0,
            bytes_landed=0,
            expected_bytes=0,
            complete=False,
            coverage=coverage_digest(()),
            error=error[:4000],
            weights_intact=weights_intact,
        )
