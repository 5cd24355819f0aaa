# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How receipts get from the workers back to the trainer.

Upstream's routes, LLM methods and Ray client discard what the workers return,
so receipts take a side channel chosen by the backend and named in the
publication header:

* ``"shm"`` (colocated backends such as ``ipc``): the trainer opens a
  ``ShmReceiptBox``, a private directory ``vllm-wt-receipts-<publication id>``
  under ``/dev/shm`` (or the temp dir where ``/dev/shm`` is missing), and puts
  its path in the header. Each worker's ``ShmReceiptSink`` writes
  ``worker-<rank>-<device tag>.json`` atomically (temp file + rename); the
  device tag tells apart workers of different engines that share a rank.
  The header comes from a client, so a worker writes only into a directory
  that is a direct child of its own receipt root (``default_receipt_root()``
  unless the engine names another), is no symbolic link, and is owned by its
  uid; it creates files there with ``O_EXCL | O_NOFOLLOW`` relative to the
  directory it opened.
  After ``finish_weight_update`` returns, the trainer ``collect``s the
  expected ranks (or, for several engines, the expected number of workers),
  waiting at most ``timeout_s``, then deletes the directory.
  The trainer holds an exclusive ``flock`` on the directory while the box is
  open (``owner_lock``); ``reap_receipt_dirs``, run before each new box,
  removes at once this user's receipt directories that nobody holds that
  lock on (left by trainers killed mid-sync), whatever PID namespace their
  trainer ran in, and never a live trainer's.
* ``"producer"`` (``sharded_rdt``): the worker hands its receipt to a trainer
  producer actor it already talks to, through a ``CallbackReceiptSink``
  wrapping that call (for example ``ray.get(actor.deliver_receipt.remote(d),
  timeout=...)``). The producer keeps a ``ReceiptInbox`` and the trainer waits
  on it.

Every wait is bounded; a timeout names the workers that did not answer.
Workers are identified by ``(rank, device)`` (``worker_key``): ranks alone
repeat across engines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from vllm.distributed.weight_transfer.common.owner_lock import (
    create_owned,
    reap_unowned,
)
from vllm.distributed.weight_transfer.verification.wire import (
    PublicationHeader,
    Receipt,
)

RECEIPT_DIR_PREFIX = "vllm-wt-receipts-"
DEFAULT_RECEIPT_TIMEOUT_S = 60.0
# Matched with fullmatch: ``$`` would accept a trailing newline.
_RECEIPT_DIR_RE = re.compile(r"vllm-wt-receipts-[A-Za-z0-9_-]{8,64}")
_RECEIPT_FILE_RE = re.compile(r"worker-([0-9]+)-([0-9a-f]{16})\.json")

# A worker's identity: its rank within its engine and its device identity.
WorkerKey = tuple[int, str]
# What a trainer waits for: these worker ranks (one engine), or this many
# distinct workers (several engines, whose ranks repeat).
ExpectedWorkers = Collection[int] | int


def worker_key(receipt: Receipt) -> WorkerKey:
    return (receipt.worker_rank, receipt.worker_device)


def receipt_file_name(receipt: Receipt) -> str:
    tag = hashlib.sha256(receipt.worker_device.encode()).hexdigest()[:16]
    return f"worker-{receipt.worker_rank}-{tag}.json"


class ReceiptTimeoutError(TimeoutError):
    """Not every expected worker delivered a receipt in time."""


class ReceiptSink(Protocol):
    """Worker side: where a receipt goes."""

    def deliver(self, receipt: Receipt) -> None: ...


def default_receipt_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def reap_receipt_dirs(root: str | Path) -> list[str]:
    """Remove this user's ``vllm-wt-receipts-*`` directories under ``root``
    whose owner's lock nobody holds (their trainer is gone); return their
    names."""
    return reap_unowned(
        str(root),
        _RECEIPT_DIR_RE,
        is_dir=True,
        remove=shutil.rmtree,
        what="receipt director(ies)",
    )


def _make_receipt_dir(path: Path) -> tuple[str, int | None]:
    """Create ``path`` and open it (None when it was removed before that)."""
    # mode 0700: only this user's processes (the colocated workers) write.
    path.mkdir(mode=0o700)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return str(path), os.open(path, flags)
    except FileNotFoundError:
        return str(path), None


# ---------------------------------------------------------------------------
# shared-memory directory (colocated)


class ShmReceiptBox:
    """Trainer side of the ``"shm"`` channel for one publication.

    Create it before the first update message (the header carries ``path``),
    ``collect`` after ``finish_weight_update`` returned, ``close`` always.
    """

    def __init__(self, publication_id: str, root: str | Path | None = None) -> None:
        name = f"{RECEIPT_DIR_PREFIX}{publication_id}"
        if not _RECEIPT_DIR_RE.fullmatch(name):
            raise ValueError(f"publication id {publication_id!r} is not valid")
        base = Path(root or default_receipt_root())
        reap_receipt_dirs(base)  # left by trainers that died mid-sync
        path, fd = create_owned(lambda: _make_receipt_dir(base / name))
        self.path = Path(path)
        # The directory is owned while fd, which holds its lock, is open; a
        # box dropped unclosed leaves it to the next trainer's reap.
        self._owner = weakref.finalize(self, os.close, fd)

    def __enter__(self) -> ShmReceiptBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> dict[WorkerKey, Receipt]:
        """Every receipt present now, by worker."""
        out: dict[WorkerKey, Receipt] = {}
        for entry in sorted(os.listdir(self.path)):
            m = _RECEIPT_FILE_RE.fullmatch(entry)
            if m is None:
                continue  # a writer's temporary file
            file = self.path / entry
            try:
                receipt = Receipt.from_dict(json.loads(file.read_text()))
            except (OSError, ValueError) as e:
                raise ValueError(f"receipt file {file} is unreadable: {e}") from e
            if receipt_file_name(receipt) != entry:
                raise ValueError(
                    f"receipt file {file} holds the receipt of worker "
                    f"{receipt.worker_rank} ({receipt.worker_device})"
                )
            out[worker_key(receipt)] = receipt
        return out

    def collect(
        self,
        expected_workers: ExpectedWorkers,
        timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
    ) -> list[Receipt]:
        """Wait until every expected worker's receipt is here, or one failed."""
        return _wait(
            self.read,
            expected_workers,
            timeout_s,
            f"receipt directory {self.path}",
        )

    def close(self) -> None:
        """Delete the directory, then drop its lock. Idempotent."""
        if self._owner.alive:
            shutil.rmtree(self.path, ignore_errors=True)
            self._owner()


class ShmReceiptSink:
    """Worker side of the ``"shm"`` channel: writes into the trainer's box.

    ``directory`` comes from the publication header; it must be a
    ``vllm-wt-receipts-<publication id>`` directory directly under ``root``
    (default ``default_receipt_root()``), after resolving symbolic links in
    its parent.
    """

    def __init__(self, directory: str | Path, root: str | Path | None = None) -> None:
        path = Path(directory)
        if not path.is_absolute() or not _RECEIPT_DIR_RE.fullmatch(path.name):
            raise ValueError(
                f"receipt directory {str(directory)!r} is not a "
                f"{RECEIPT_DIR_PREFIX}<publication id> directory"
            )
        real_root = Path(os.path.realpath(root or default_receipt_root()))
        if Path(os.path.realpath(path.parent)) != real_root:
            raise ValueError(
                f"receipt directory {str(directory)!r} is not directly under this "
                f"worker's receipt root {str(real_root)!r}; the trainer must "
                "create its receipt box there (TrainerPublication's default)"
            )
        self.path = real_root / path.name

    def deliver(self, receipt: Receipt) -> None:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dir_fd = os.open(self.path, flags)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"receipt directory {self.path} does not exist; the trainer that "
                "published this update is gone or runs on another host (the shm "
                "receipt channel needs a colocated trainer)"
            ) from None
        except OSError as e:
            raise ValueError(
                f"receipt directory {self.path} is a symbolic link or not a "
                f"directory ({e.strerror}); a worker writes receipts only into "
                "the directory the trainer created"
            ) from e
        try:
            owner = os.fstat(dir_fd).st_uid
            if owner != os.geteuid():
                raise ValueError(
                    f"receipt directory {self.path} is owned by uid {owner}, not "
                    f"by this worker's uid {os.geteuid()}; the trainer must run "
                    "as the same user as the vLLM server"
                )
            self._write(dir_fd, receipt)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _write(dir_fd: int, receipt: Receipt) -> None:
        tmp = f".tmp-{secrets.token_hex(8)}.json"
        create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, create, stat.S_IRUSR | stat.S_IWUSR, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(receipt.to_dict(), f)
            # rename replaces a link planted under the final name, never
            # follows it.
            os.replace(
                tmp, receipt_file_name(receipt), src_dir_fd=dir_fd, dst_dir_fd=dir_fd
            )
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise


# ---------------------------------------------------------------------------
# producer call (sharded_rdt)


class CallbackReceiptSink:
    """Worker side of the ``"producer"`` channel: ``call(receipt.to_dict())``.

    ``call`` must bound its own wait (e.g. ``ray.get(..., timeout=...)``).
    """

    def __init__(self, call: Callable[[dict[str, Any]], object]) -> None:
        self._call = call

    def deliver(self, receipt: Receipt) -> None:
        self._call(receipt.to_dict())


class ReceiptInbox:
    """Trainer/producer side of the ``"producer"`` channel; thread-safe.

    The producer exposes ``deliver`` (taking the receipt as a plain dict) to
    workers; the trainer calls ``collect`` for a publication, then ``discard``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._receipts: dict[str, dict[int, Receipt]] = {}

    def deliver(self, receipt: dict[str, Any] | Receipt) -> None:
        if not isinstance(receipt, Receipt):
            receipt = Receipt.from_dict(receipt)
        with self._cond:
            self._receipts.setdefault(receipt.publication_id, {})[
                receipt.worker_rank
            ] = receipt
            self._cond.notify_all()

    def collect(
        self,
        publication_id: str,
        expected_workers: ExpectedWorkers,
        timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
    ) -> list[Receipt]:
        def read() -> dict[WorkerKey, Receipt]:  # called with the lock held
            got = self._receipts.get(publication_id, {})
            return {worker_key(r): r for r in got.values()}

        return _wait(
            read,
            expected_workers,
            timeout_s,
            f"the receipt inbox of publication {publication_id}",
            cond=self._cond,
        )

    def read(self, publication_id: str) -> dict[WorkerKey, Receipt]:
        """The receipts of ``publication_id`` present now, by worker."""
        with self._cond:
            got = self._receipts.get(publication_id, {})
            return {worker_key(r): r for r in got.values()}

    def discard(self, publication_id: str) -> None:
        with self._cond:
            self._receipts.pop(publication_id, None)


class InboxReceipts:
    """The receipts of one publication in a producer's `ReceiptInbox`, read
    the way a `ShmReceiptBox` is (``read``, ``collect``, ``close``, which
    forgets them)."""

    def __init__(self, inbox: ReceiptInbox, publication_id: str) -> None:
        self.inbox = inbox
        self.publication_id = publication_id

    def read(self) -> dict[WorkerKey, Receipt]:
        return self.inbox.read(self.publication_id)

    def collect(self, expected: ExpectedWorkers, timeout_s: float) -> list[Receipt]:
        return self.inbox.collect(self.publication_id, expected, timeout_s)

    def close(self) -> None:
        self.inbox.discard(self.publication_id)


# ---------------------------------------------------------------------------


def sink_for(
    header: PublicationHeader,
    producer_call: Callable[[dict[str, Any]], object] | None = None,
    receipt_root: str | Path | None = None,
) -> ReceiptSink | None:
    """The sink a worker uses for ``header``'s channel (None for ``"none"``);
    ``receipt_root`` is where the ``"shm"`` channel may write (default
    ``default_receipt_root()``)."""
    if header.receipt_channel == "shm":
        assert header.receipt_dir is not None
        return ShmReceiptSink(header.receipt_dir, root=receipt_root)
    if header.receipt_channel == "producer":
        if producer_call is None:
            raise ValueError(
                f"publication {header.publication_id} asks for receipts through "
                "the producer, but this engine has no producer to call"
            )
        return CallbackReceiptSink(producer_call)
    return None


def missing_workers(
    have: Mapping[WorkerKey, Receipt], expected: ExpectedWorkers
) -> str:
    """Who of ``expected`` has no receipt in ``have`` (empty when nobody)."""
    return _missing(have, expected)


def _missing(have: Mapping[WorkerKey, Receipt], expected: ExpectedWorkers) -> str:
    """Who has not delivered yet (empty when nobody)."""
    if isinstance(expected, int):
        short = expected - len(have)
        return f"{short} of {expected} worker(s)" if short > 0 else ""
    ranks = {rank for rank, _ in have}
    missing = [w for w in sorted(set(expected)) if w not in ranks]
    return f"worker(s) {missing}" if missing else ""


def _wait(
    read: Callable[[], Mapping[WorkerKey, Receipt]],
    expected_workers: ExpectedWorkers,
    timeout_s: float,
    where: str,
    cond: threading.Condition | None = None,
) -> list[Receipt]:
    deadline = time.monotonic() + timeout_s
    poll_s = 0.001
    with cond if cond is not None else contextlib.nullcontext():
        while True:
            have = read()
            # A failed worker ends the wait at once; verify_receipts reports it.
            if not _missing(have, expected_workers) or any(
                r.error is not None for r in have.values()
            ):
                return [have[k] for k in sorted(have)]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got = [f"{rank} ({device})" for rank, device in sorted(have)]
                raise ReceiptTimeoutError(
                    f"no receipt from {_missing(have, expected_workers)} in "
                    f"{where} after {timeout_s:.1f}s (got {got}); those workers "
                    "did not finish the update or cannot reach the trainer"
                )
            if cond is not None:
                cond.wait(timeout=remaining)
            else:
                time.sleep(min(remaining, poll_s))
                poll_s = min(poll_s * 2, 0.05)
