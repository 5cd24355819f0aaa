# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verified-publication lifecycle of one sync, one object per side.

Backends call these two classes instead of wiring the header, checker, fence,
receipt channel, checksums and sync record themselves.

Trainer (the sender rank), inside ``send_weights``::

    pub = TrainerPublication.open(backend=..., model_version=...,
                                  metas=source.metadata(), channel="shm",
                                  checksums=init_info.verify_checksums)
    try:
        client.start_weight_update()
        for each update message:
            info = pub.attach(info)                    # header rides along
            info["checksums"] = [pub.checksum(buf)]    # if pub.checksums
            client.update_weights(info)
        client.update_weights({"prepare": id})       # workers write receipts
        pub.verify(expected_workers=range(n))          # waits for receipts
        commit_update(client, weight_version)          # finish: now visible
    except BaseException as e:
        abort_update(client, reason)                   # nothing committed
        pub.fail(client, e, expected_workers)          # fenced, unless every
        raise                                          # worker kept its weights
    finally:
        pub.close()

(``commit_update`` and ``abort_update`` are in ``full_resync``.)

Worker engine::

    start_weight_update:   self.pub.start()
    update_weights(d):     info = self.pub.begin_message(d)   # pops header
                           for each tensor: self.pub.admit(name, dtype, shape)
                           self.pub.check_payload(what, expected, buf)
                           self.pub.touch(); load; self.pub.landed(name, nbytes)
                           on any exception: self.pub.fail(e, weights_intact=?)
                           # the failure receipt says whether the weights are
                           # intact
    update_weights({"prepare": id}): self.pub.check_prepare(d)  # names it?
                                     self.pub.prepare()   # the receipt
    finish_weight_update:  self.pub.finish()   # receipt unless prepared; commit
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.verification.checks import (
    Delivery,
    ManifestChecker,
    VerifiedPublication,
    WholeTensors,
    verify_receipts,
)
from vllm.distributed.weight_transfer.verification.checksum import (
    ALGORITHM,
    payload_checksum,
)
from vllm.distributed.weight_transfer.verification.fence import (
    PREPARE_FIELD,
    WeightFence,
    WeightState,
    fenced_version,
    set_served_version,
)
from vllm.distributed.weight_transfer.verification.receipts import (
    DEFAULT_RECEIPT_TIMEOUT_S,
    ExpectedWorkers,
    InboxReceipts,
    ReceiptInbox,
    ReceiptSink,
    ShmReceiptBox,
    ShmReceiptSink,
    missing_workers,
    sink_for,
)
from vllm.distributed.weight_transfer.verification.record import SyncRecord
from vllm.distributed.weight_transfer.verification.wire import (
    ChecksumMismatch,
    Manifest,
    ManifestMismatch,
    ParamLike,
    PublicationHeader,
    Receipt,
    ReceiptChannelKind,
    attach_publication,
    describe_error,
    pop_publication,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# How long a failed sync waits for the workers' failure receipts before it
# fences the served version anyway.
FAILURE_RECEIPT_WAIT_S = 2.0


def device_identity(device: torch.device | str) -> str:
    """A host-unique name for a device: ``cuda:<GPU uuid>`` or ``cpu:<host>:<pid>``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        return f"cuda:{torch.cuda.get_device_properties(index).uuid}"
    return f"{device.type}:{socket.gethostname()}:{os.getpid()}"


def served_world_size(client: Any) -> int:
    """How many workers (all DP ranks included) the client's server runs.

    The client needs ``get_world_size()``; the fork's three clients have it.
    """
    method = getattr(client, "get_world_size", None)
    if not callable(method):
        raise TypeError(
            f"cannot ask {type(client).__name__} for the server's world size; give "
            "it a get_world_size() method or pass expected_workers explicitly"
        )
    return int(method())


def expected_workers(client: Any) -> range | int:
    """The workers whose receipts a publication through ``client`` waits for:
    ranks ``0..n-1`` of its one engine, or, for a client that drives several
    engines (``client.handles``: a Ray client over several actors, whose
    workers each number from 0), how many distinct workers they run."""
    workers = served_world_size(client)
    engines = len(getattr(client, "handles", None) or [client])
    return range(workers) if engines == 1 else workers


# ---------------------------------------------------------------------------
# trainer side

TrainerReceipts = ShmReceiptBox | InboxReceipts


class TrainerPublication:
    """One publication, from the sender's point of view; see the module docstring."""

    def __init__(
        self, header: PublicationHeader, receipts: TrainerReceipts | None = None
    ) -> None:
        self.header = header
        # Where the workers' receipts come back (None: nowhere).
        self.receipts = receipts
        self.record = SyncRecord(backend=header.backend, side="trainer")
        self.record.bind(header)
        self.record.nbytes = header.payload_bytes
        self._sent_manifest = False
        self.verified: VerifiedPublication | None = None

    @classmethod
    def open(
        cls,
        *,
        backend: str,
        model_version: int,
        metas: Iterable[ParamLike],
        trainer_devices: Sequence[str] | None = None,
        channel: ReceiptChannelKind = "shm",
        checksums: bool = False,
        inbox: ReceiptInbox | None = None,
        receipt_root: str | Path | None = None,
        manifest: Manifest | None = None,
    ) -> TrainerPublication:
        """``manifest``: the manifest of ``metas`` built before (a trainer
        whose source says nothing changed reuses it), else it is built."""
        if channel == "producer" and inbox is None:
            raise ValueError("channel='producer' needs the producer's ReceiptInbox")
        if manifest is None:
            manifest = Manifest.from_params(metas)
        publication_id = uuid.uuid4().hex
        box = (
            ShmReceiptBox(publication_id, root=receipt_root)
            if channel == "shm"
            else None
        )
        header = PublicationHeader.create(
            backend=backend,
            model_version=model_version,
            manifest=manifest,
            trainer_devices=list(trainer_devices or [device_identity("cpu")]),
            checksum=ALGORITHM if checksums else None,
            receipt_channel=channel,
            receipt_dir=str(box.path) if box is not None else None,
            publication_id=publication_id,
        )
        if box is not None:
            return cls(header, box)
        receipts = InboxReceipts(inbox, publication_id) if inbox is not None else None
        return cls(header, receipts)

    @property
    def box(self) -> ShmReceiptBox | None:
        """The receipt directory, with the ``"shm"`` channel."""
        receipts = self.receipts
        return receipts if isinstance(receipts, ShmReceiptBox) else None

    @property
    def checksums(self) -> bool:
        return self.header.checksum is not None

    def attach(
        self,
        update_info: dict[str, Any],
        checksums: Sequence[str | None] = (),
        *,
        payload: bool = True,
    ) -> dict[str, Any]:
        """``update_info`` plus the header (the first message also carries the
        manifest) and, when checksums are on, one checksum per payload buffer
        of the message, in the backend's buffer order. ``payload=False``: the
        message carries no payload buffers; their bytes travel, and are
        checksummed, another way (``sharded_rdt``'s producers)."""
        header = (
            self.header if not self._sent_manifest else self.header.without_manifest()
        )
        self._sent_manifest = True
        sums = None
        if self.checksums and payload:
            sums = [c for c in checksums if c is not None]
            if len(sums) != len(checksums) or not sums:
                raise ValueError(
                    "checksums are on: pass one checksum per payload buffer "
                    f"(got {list(checksums)!r})"
                )
        return attach_publication(update_info, header, sums)

    def checksum(self, buf: torch.Tensor) -> str | None:
        """The payload checksum of ``buf`` if checksums are on, else None."""
        if not self.checksums:
            return None
        with self.record.phase("checksum"):
            return payload_checksum(buf)

    def collect(
        self,
        expected_workers: Collection[int] | int,
        timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
    ) -> list[Receipt]:
        """Every expected receipt (ranks, or a number of workers; see
        ``verify_receipts``), waiting at most ``timeout_s``."""
        if self.receipts is not None:
            return self.receipts.collect(expected_workers, timeout_s)
        raise RuntimeError(
            f"publication {self.header.publication_id} has no receipt channel"
        )

    def verify(
        self,
        expected_workers: Collection[int] | int,
        *,
        timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
        delivery: Delivery = "full",
        expected_coverage: str | Mapping[int, str] | None = None,
    ) -> VerifiedPublication:
        """Wait for every receipt and verify them; log the trainer's sync line."""
        with self.record.phase("verify"):
            receipts = self.collect(expected_workers, timeout_s)
            self.verified = verify_receipts(
                self.header,
                receipts,
                expected_workers,
                delivery=delivery,
                expected_coverage=expected_coverage,
            )
        self.record.finish(ok=True)
        self.record.log(logger)
        return self.verified

    def fail(
        self,
        client: Any,
        error: BaseException | str,
        expected_workers: ExpectedWorkers | None = None,
    ) -> None:
        """Fence the served version (best effort) and log the failed sync.

        The version is left alone when every one of ``expected_workers``
        reported the failure with its weights intact (a staged or refused
        update): the engines serve the previous version, unfenced."""
        self.record.finish(ok=False, error=error)
        self.record.log(logger)
        if expected_workers is not None and self._all_kept_their_weights(
            expected_workers
        ):
            logger.warning(
                "publication %s failed (%s); every worker kept its previous "
                "weights, so the served version is unchanged",
                self.header.publication_id,
                describe_error(error),
            )
            return
        version = fenced_version(self.header.publication_id, describe_error(error))
        try:
            set_served_version(client, version)
        except Exception as e:  # the server may be unreachable
            logger.error(
                "could not set the served weight version to %r: %s", version, e
            )

    def _all_kept_their_weights(self, expected_workers: ExpectedWorkers) -> bool:
        """Whether every expected worker's receipt is a failure with its
        weights intact. Failure receipts are sent, best effort, as each worker
        closes the update: wait for all of them, at most
        ``FAILURE_RECEIPT_WAIT_S``."""
        deadline = time.monotonic() + FAILURE_RECEIPT_WAIT_S
        while True:
            try:
                have = self._receipts_now()
            except ValueError:  # an unreadable receipt: assume the worst
                return False
            if not missing_workers(have, expected_workers):
                return all(
                    r.error is not None and r.weights_intact is True
                    for r in have.values()
                )
            if any(r.weights_intact is False for r in have.values()):
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _receipts_now(self) -> dict[tuple[int, str], Receipt]:
        return self.receipts.read() if self.receipts is not None else {}

    def close(self) -> None:
        if self.receipts is not None:
            self.receipts.close()


# ---------------------------------------------------------------------------
# worker side


class WorkerPublication:
    """One worker engine's side of every publication; see the module docstring.

    ``manifest_for(header)`` supplies the engine's own manifest
    (``sharded_rdt`` builds it from its init info): it stands in when messages
    carry only the digest, and a manifest a message does carry must equal it;
    ``expected_for(header, manifest)`` supplies this worker's per-name bytes
    when it receives slices. ``producer_call`` delivers receipts on the
    ``"producer"`` channel; ``receipt_root`` is the only directory under which
    the ``"shm"`` channel writes them (default ``default_receipt_root()``).
    """

    def __init__(
        self,
        *,
        backend: str,
        worker_rank: int,
        worker_device: str,
        manifest_for: Callable[[PublicationHeader], Manifest | None] | None = None,
        expected_for: Callable[[PublicationHeader, Manifest], Mapping[str, int] | None]
        | None = None,
        producer_call: Callable[[dict[str, Any]], object] | None = None,
        receipt_root: str | Path | None = None,
    ) -> None:
        self.backend = backend
        self.receipt_root = receipt_root
        self.worker_rank = worker_rank
        self.worker_device = worker_device
        self.fence = WeightFence()
        self._manifest_for = manifest_for
        self._expected_for = expected_for
        self._producer_call = producer_call
        self.header: PublicationHeader | None = None
        self.checker: ManifestChecker | None = None
        self.record: SyncRecord | None = None
        # The payload checksums of the message being received, by buffer.
        self.message_checksums: list[str] | None = None
        # The receipt went out at the trainer's prepare message; the commit
        # (``finish``) does not write it again.
        self._receipt_sent = False
        # Where the open publication's receipts go (checked at its first
        # message); None on the ``"none"`` channel.
        self._sink: ReceiptSink | None = None

    def start(self) -> None:
        self.fence.start()
        self.header = None
        self.checker = None
        self._receipt_sent = False
        self.record = SyncRecord(
            backend=self.backend, side=f"worker {self.worker_rank}"
        )

    def begin_message(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Check a message's header; return the message without it.

        The first message with a header sets up the checker; a header that
        does not fit raises before anything is landed, and so does a later
        message whose header differs from the first.
        """
        header, checksums, rest = pop_publication(update_info)
        self.fence.bind(header)
        self.message_checksums = checksums
        if header is not None and self.checker is None:
            self._admit_header(header)
        elif header is not None and self.header is not None:
            self._check_same_header(header)
        return rest

    def _admit_header(self, header: PublicationHeader) -> None:
        """Set up the checker for ``header``'s publication after every check
        its fields allow before a byte lands: the backend, the receipt
        channel (a ``receipt_dir`` outside this worker's receipt root, or a
        producer channel on an engine without a producer) and the manifest."""
        if header.backend != self.backend:
            raise ValueError(
                f"publication.backend is {header.backend!r} but this engine "
                f"receives {self.backend!r} updates; publish with the backend "
                "the server runs"
            )
        sink = self._receipt_sink(header)
        manifest = header.manifest
        own = self._manifest_for(header) if self._manifest_for else None
        if manifest is None:
            manifest = own
        elif own is not None and (diff := own.difference(manifest)):
            raise ManifestMismatch(
                f"publication {header.publication_id}'s manifest differs from "
                f"the one this engine was initialized with: {diff}; trainer "
                "and server disagree on the model's structure (re-run "
                "init_weight_transfer_engine after changing it)"
            )
        if manifest is None:
            raise ManifestMismatch(
                f"publication {header.publication_id}'s first message carries "
                "no manifest and this engine has none for digest "
                f"{header.manifest_digest[:16]}…"
            )
        expected = self._expected_for(header, manifest) if self._expected_for else None
        self.checker = ManifestChecker(header, manifest, expected=expected)
        self.header = header
        self._sink = sink
        assert self.record is not None
        self.record.bind(header)

    def _receipt_sink(self, header: PublicationHeader) -> ReceiptSink | None:
        """Where this worker's receipts for ``header`` go; ``ValueError``
        naming the header field when they could not go there: a
        ``receipt_dir`` outside the receipt root or missing (the trainer
        creates it before its first message; missing, it runs on another
        host), or a producer channel on an engine without a producer."""
        field = "receipt_dir" if header.receipt_channel == "shm" else "receipt_channel"
        try:
            sink = sink_for(header, self._producer_call, self.receipt_root)
            if isinstance(sink, ShmReceiptSink) and not sink.path.is_dir():
                raise ValueError(
                    f"receipt directory {str(sink.path)!r} does not exist; the "
                    "shm receipt channel needs the trainer on this host, "
                    "which creates it before its first message"
                )
        except ValueError as e:
            raise ValueError(
                f"publication.{field} of publication {header.publication_id} is "
                f"refused before any weight lands: {e}"
            ) from e
        return sink

    def _check_same_header(self, header: PublicationHeader) -> None:
        """``ValueError`` unless a later message's header equals the first
        one's (its manifest entries aside)."""
        assert self.header is not None
        if header == self.header:
            return
        changed = self.header.changed_fields(header)
        shown = ", ".join(
            f"publication.{f} {getattr(self.header, f)!r} -> {getattr(header, f)!r}"
            for f in changed
        )
        raise ValueError(
            f"a message of publication {header.publication_id} changes its "
            f"header ({shown}); every message of a publication carries the "
            "header of its first message"
        )

    def check_prepare(
        self, update_info: Mapping[str, Any], *others: PublicationHeader | None
    ) -> None:
        """Refuse (``ValueError``) the trainer's prepare message
        ``update_info`` (``is_prepare_request``) when it names another
        publication than the one open on this worker: its own, or one of
        ``others`` (a LoRA adapter push's). Called before any check or
        receipt of the prepare, so a refused one attests nothing. An update
        whose messages carried no header has no publication to name."""
        named = update_info[PREPARE_FIELD]
        open_ids = [h.publication_id for h in (self.header, *others) if h is not None]
        if not open_ids or named in open_ids:
            return
        raise ValueError(
            f"update_info.{PREPARE_FIELD} names publication {named!r} but the "
            f"open update is publication {' and '.join(open_ids)}; a prepare "
            "must name the publication whose weights this update received. "
            "Nothing was prepared or attested"
        )

    def admit(
        self,
        name: str,
        dtype: torch.dtype | str,
        shape: Sequence[int],
        nbytes: int | None = None,
    ) -> None:
        if self.checker is not None:
            self.checker.admit(name, dtype, shape, nbytes)

    def admit_slice(
        self, name: str, dtype: torch.dtype | str | None, nbytes: int
    ) -> None:
        if self.checker is not None:
            self.checker.admit_slice(name, dtype, nbytes)

    def admit_whole(self, tensors: WholeTensors | None) -> None:
        """``ManifestChecker.admit_whole`` (``tensors`` is None when this
        publication checks nothing)."""
        if self.checker is not None:
            assert tensors is not None
            self.checker.admit_whole(tensors)

    def landed_whole(self, tensors: WholeTensors | None, nbytes: int) -> None:
        """``landed`` for each of ``tensors`` in full; ``nbytes`` is their
        total, counted when this publication checks nothing."""
        if self.checker is not None:
            assert tensors is not None
            self.checker.landed_whole(tensors)
        if self.record is not None:
            self.record.nbytes += nbytes

    @property
    def checks_payloads(self) -> bool:
        """Whether this publication's payloads carry checksums to verify."""
        return (
            self.checker is not None
            and self.header is not None
            and self.header.checksum is not None
        )

    def check_payload(
        self,
        what: str,
        expected: str | None,
        buf: torch.Tensor,
        *,
        proven: str | None = None,
    ) -> None:
        """Verify ``buf`` against the trainer's checksum when checksums are on.
        ``proven``: the checksum of the bytes, established without them being
        in ``buf`` (a delta checked against the served bytes it is written
        into), compared instead."""
        if not self.checks_payloads:
            return
        assert self.checker is not None and self.header is not None
        if expected is None:
            raise ChecksumMismatch(
                f"publication {self.header.publication_id} promises checksums but "
                f"{what} arrived without one"
            )
        assert self.record is not None
        if proven is not None:
            actual = proven
        else:
            with self.record.phase("checksum"):
                actual = payload_checksum(buf)
        self.checker.verify_checksum(what, expected, actual)

    def check_buffer(self, index: int, buf: torch.Tensor) -> None:
        """``check_payload`` for buffer ``index`` of the current message."""
        sums = self.message_checksums
        expected = sums[index] if sums is not None and index < len(sums) else None
        self.check_payload(f"payload buffer {index}", expected, buf)

    def touch(self) -> None:
        self.fence.touch()

    def landed(self, name: str, nbytes: int) -> None:
        if self.checker is not None:
            self.checker.landed(name, nbytes)
        if self.record is not None:
            self.record.nbytes += nbytes

    def fail(self, error: BaseException | str, *, weights_intact: bool = False) -> None:
        """Close the update as failed: fence, tell the trainer, log."""
        reason = describe_error(error)
        self.fence.fail(reason, weights_intact=weights_intact)
        if self.record is not None and self.record.ok is None:
            self.record.finish(ok=False, error=error)
            self.record.log(logger)
        if self.header is not None:
            self._deliver(
                Receipt.failure(
                    self.header,
                    self.worker_rank,
                    self.worker_device,
                    reason,
                    weights_intact=self.fence.state != WeightState.FENCED,
                ),
                best_effort=True,
            )
        self.header = None
        self.checker = None
        self._receipt_sent = False

    @property
    def receipt_sent(self) -> bool:
        """Whether this update's receipt went out at the prepare message."""
        return self._receipt_sent

    def prepare(self) -> Receipt | None:
        """Write the receipt before the commit, so the trainer can verify every
        worker of every engine before any of them commits. An incomplete
        update raises ``IncompleteUpdate`` here (the caller fails it)."""
        self.fence.check_open("prepare")
        if self.checker is None:
            return None
        assert self.record is not None
        receipt = self.checker.receipt(
            self.worker_rank, self.worker_device, timings=self.record.phases
        )
        self._deliver(receipt, best_effort=False)
        self._receipt_sent = True
        return receipt

    def finish(self) -> Receipt | None:
        """Write the receipt (unless ``prepare`` did) and commit; an incomplete
        update fails and fences."""
        self.fence.check_open("finish_weight_update")
        receipt = None
        try:
            if self.checker is not None and not self._receipt_sent:
                assert self.record is not None
                receipt = self.checker.receipt(
                    self.worker_rank, self.worker_device, timings=self.record.phases
                )
                self._deliver(receipt, best_effort=False)
            self.fence.finish()
        except BaseException as e:
            self.fail(e)
            raise
        if self.record is not None:
            self.record.finish(ok=True)
            self.record.log(logger)
        self.header = None
        self.checker = None
        self._receipt_sent = False
        return receipt

    def _deliver(self, receipt: Receipt, *, best_effort: bool) -> None:
        assert self.header is not None
        try:
            if self._sink is not None:
                self._sink.deliver(receipt)
        except Exception as e:
            if not best_effort:
                raise
            logger.warning("could not deliver the failure receipt: %s", e)
