# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a consumer reaches the producers: one narrow interface, three transports.

A worker engine sees a transport as:

* ``ConsumerTransport.receive_buffer(nbytes)``: a uint8 buffer the transport
  can write pulled bytes into (registered with NIXL once, for the NIXL-based
  transports);
* ``ConsumerTransport.connect(producer_index, endpoint)`` -> a `ProducerLink`;
* ``ProducerLink.register(consumer_id, chunks, digest)`` at init;
* ``ProducerLink.pull(chunk, into, next_chunk, held)`` per chunk: returns
  once the packed bytes of ``chunk`` are in ``into``, and the producer has
  been told they were read; the result (`Pulled`) carries the producer's
  payload checksum of those bytes (None when checksums are off, or when
  ``checksums`` is False), how many bytes were read, and what became of a
  delta the producer offered (applied to ``held``, the chunk's bytes as the
  worker last pulled them, or refused: the whole chunk was read instead);
* ``ProducerLink.abort(reason)`` when the worker gives up on a sync;
* ``ProducerLink.deliver_receipt(receipt)`` at the end of a sync: the worker's
  verified-publication receipt (a JSON-safe dict) goes to the producer's
  `ReceiptInbox`, bounded by the transport's control timeout.

A trainer rank serves its `Producer` through a `ProducerServer`, whose
``endpoint()`` (JSON) rides the worker init info and whose ``receipts`` is
the inbox the sending rank collects receipts from.

Implementations: `InProcessServer` / `InProcessTransport` here (producer and
consumer in one process, for tests), ``pull.nixl`` (direct NIXL agents, any
executor) and ``pull.ray`` (Ray Direct Transport); ``pull.registry`` names
them and makes either side of each by name.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from vllm.distributed.weight_transfer.pull.chunks import PullChunk
from vllm.distributed.weight_transfer.pull.delta import DeltaBaseMismatch
from vllm.distributed.weight_transfer.pull.delta_bases import (
    KeptBytes,
    OfferedDelta,
    ServedBytes,
    delta_in_place,
    forget_rebuilt,
    land_delta,
)
from vllm.distributed.weight_transfer.pull.delta_write import PiecesWrite
from vllm.distributed.weight_transfer.pull.producer import Packed, Producer
from vllm.distributed.weight_transfer.verification import (
    ReceiptInbox,
    describe_error,
    payload_checksum,
)

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.pull.registry import (
        ConsumerSettings,
        ServerSettings,
    )


@dataclass(frozen=True)
class Offered:
    """A producer's answer to a pull: how many bytes it packed, how to read
    them into the consumer's buffer, their checksum (asked for after the
    read: a transport may fetch it with a call of its own), and the delta
    offered next to them, if any."""

    nbytes: int
    read_into: Callable[[torch.Tensor], object]
    checksum: Callable[[], str | None]
    delta: OfferedDelta | None = None


class Pulled(NamedTuple):
    """What one pull brought: the producer's checksum of the chunk's bytes
    (None when off), the bytes read from the producer, and the offered
    delta's fate: None (none offered, or no bytes held to apply it to),
    "applied", or why it was refused (the whole chunk was read instead).
    ``in_place``: an applied delta still to be written into the served
    tensors its base was read from (`delta_in_place`); the receive buffer
    then does not hold the chunk, and the landing writes this instead."""

    checksum: str | None
    read_bytes: int
    delta: str | None = None
    in_place: PiecesWrite | None = None


class ProducerLink(ABC):
    """A consumer's connection to one producer. A pull is the same on every
    transport: ask the producer for the chunk (``_request_pull``), check it
    packed the bytes the plan says, read them, take their checksum and tell
    the producer they were read (``_read_done``); a transport supplies only
    the two hooks."""

    sync_id: int | None = None  # the sync the next pulls belong to, if known
    # Whether the current sync carries payload checksums; a transport whose
    # pull reply cannot carry the checksum asks for it only then.
    checksums: bool = False
    peer = "the producer"  # how errors name the producer this link reaches

    @abstractmethod
    def register(
        self, consumer_id: int, chunks: Sequence[PullChunk], digest: str
    ) -> None: ...

    def pull(
        self,
        chunk: PullChunk,
        into: torch.Tensor,
        next_chunk: PullChunk | None = None,
        held: KeptBytes | ServedBytes | None = None,
    ) -> Pulled:
        """Land ``chunk``'s packed bytes in ``into`` (uint8, ``chunk.nbytes``)
        and return what the pull brought (`Pulled`). ``next_chunk``, the
        consumer's next pull from this producer, may be requested early so
        that it is packed while this one is read. ``held``: the chunk's bytes
        as this worker last landed them (a copy, or the served tensors that
        hold them), which an offered delta applies to (to served bytes that
        carry their pieces: checked there and returned unwritten,
        ``Pulled.in_place``); a delta that does not apply (another base, a
        malformed one, or, when the producer gives a checksum, a rebuilt
        chunk that does not match it) is refused and the whole chunk read
        instead."""
        offered = self._request_pull(chunk, next_chunk)
        if offered.nbytes != chunk.nbytes:
            raise RuntimeError(
                f"{self.peer} packed {offered.nbytes} bytes for chunk seq "
                f"{chunk.seq} (group {chunk.group}) but the plan says {chunk.nbytes}"
            )
        into = into[: chunk.nbytes]
        delta = None
        proven = None  # the rebuilt bytes' checksum, when it is proven
        in_place = None
        if offered.delta is not None and held is not None:
            try:
                if isinstance(held, ServedBytes) and held.pieces is not None:
                    in_place = delta_in_place(
                        offered.delta, into, held, checksum=self.checksums
                    )
                    proven = in_place.checksum
                else:
                    proven = land_delta(
                        offered.delta, into, held, checksum=self.checksums
                    )
                delta = "applied"
            except ValueError as e:
                delta = describe_error(e)
        checksum = offered.checksum()
        if delta == "applied" and checksum is not None:
            # The producer's checksum covers the chunk's new bytes: a held
            # copy that was not the delta's base (whatever its stored
            # checksum said) does not rebuild them. (A delta for the served
            # tensors is unwritten yet: its checksum is proven or nothing.)
            rebuilt = proven
            if rebuilt is None and in_place is None:
                rebuilt = payload_checksum(into)
            if rebuilt != checksum:
                assert held is not None
                forget_rebuilt(held)
                delta = describe_error(
                    DeltaBaseMismatch(
                        f"the chunk rebuilt from the held bytes and the delta "
                        f"checksums to {rebuilt} but the producer's checksum is "
                        f"{checksum}; pull the whole chunk instead"
                    )
                )
        if delta == "applied":
            assert offered.delta is not None
            read = offered.delta.nbytes
        else:
            in_place = None
            offered.read_into(into)
            read = chunk.nbytes
        self._read_done(chunk.seq)
        return Pulled(checksum, read, delta, in_place)

    @abstractmethod
    def _request_pull(self, chunk: PullChunk, next_chunk: PullChunk | None) -> Offered:
        """Ask the producer to pack ``chunk`` (and, where the transport can,
        ``next_chunk`` ahead) and return its answer."""

    @abstractmethod
    def _read_done(self, seq: int) -> None:
        """Tell the producer chunk ``seq`` was read, which frees its slot."""

    def abort(self, reason: str) -> None:  # noqa: B027
        """Tell the producer this consumer gave up on the current sync."""

    @abstractmethod
    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        """Hand a receipt to the producer's inbox; raises if it cannot within
        the transport's control timeout."""

    def close(self) -> None:  # noqa: B027
        pass


class ConsumerTransport(ABC):
    """A consumer's side of a transport; see the module docstring."""

    name: str

    def receive_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    @abstractmethod
    def connect(self, producer_index: int, endpoint: Any) -> ProducerLink: ...

    def close(self) -> None:  # noqa: B027
        pass


class DrivesProducer:
    """The calls a trainer drives a `Producer` with during a sync, passed on to
    ``self.producer``; both `ProducerServer` and the Ray producer actor offer
    them."""

    producer: Any  # the `Producer`, or a handle on one in another process

    def begin_sync(
        self, live_consumer_ids: Sequence[int], sync_id: int | None = None
    ) -> None:
        self.producer.begin_sync(live_consumer_ids, sync_id)

    def wait_credit(self) -> None:
        self.producer.wait_credit()

    def publish(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.producer.publish(group, tensors)

    def end_sync(self) -> None:
        self.producer.end_sync()

    def fail(self, reason: str) -> None:
        self.producer.fail(reason)


class ProducerServer(DrivesProducer, ABC):
    """Makes one trainer rank's `Producer` reachable by consumers. The trainer
    drives the producer through the server (``begin_sync``, ``wait_credit``,
    ``publish``, ``end_sync``, ``fail``), since it may live in another process."""

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """JSON-safe address consumers connect to."""

    @property
    def receipts(self) -> ReceiptInbox:
        """Where the receipts workers deliver to this producer arrive."""
        return self.producer.receipts

    def close(self) -> None:  # noqa: B027
        pass


# -- in-process ---------------------------------------------------------------

_REGISTRY: dict[str, Producer] = {}
_REGISTRY_LOCK = threading.Lock()
_COUNTER = itertools.count()


class InProcessServer(ProducerServer):
    """Serves a producer to consumers in the same process."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        with _REGISTRY_LOCK:
            self._key = f"inprocess-{next(_COUNTER)}-rk{producer.rank}"
            _REGISTRY[self._key] = producer

    def endpoint(self) -> dict[str, Any]:
        return {"transport": "inprocess", "key": self._key}

    def close(self) -> None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self._key, None)


class _InProcessLink(ProducerLink):
    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.consumer_id = -1

    def register(
        self, consumer_id: int, chunks: Sequence[PullChunk], digest: str
    ) -> None:
        self.consumer_id = consumer_id
        self.producer.register(consumer_id, chunks, digest)

    def _request_pull(self, chunk: PullChunk, next_chunk: PullChunk | None) -> Offered:
        packed = self.producer.pack(self.consumer_id, chunk.seq, self.sync_id)
        return Offered(
            packed.view.numel(),
            lambda into: into.copy_(packed.view),
            lambda: packed.checksum,
            offered_delta(packed),
        )

    def _read_done(self, seq: int) -> None:
        self.producer.read_done(self.consumer_id, seq)

    def abort(self, reason: str) -> None:
        self.producer.fail(
            f"consumer {self.consumer_id} aborted: {reason}", sync_id=self.sync_id
        )

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        self.producer.deliver_receipt(receipt)


def offered_delta(packed: Packed) -> OfferedDelta | None:
    """The delta ``packed`` offers, read by a copy (a transport whose
    consumer shares the producer's memory)."""
    if packed.delta is None:
        return None
    view = packed.delta.view
    return OfferedDelta(packed.delta.header, view.numel(), lambda i: i.copy_(view))


class InProcessTransport(ConsumerTransport):
    name = "inprocess"

    def connect(self, producer_index: int, endpoint: Any) -> ProducerLink:
        key = endpoint.get("key") if isinstance(endpoint, dict) else None
        with _REGISTRY_LOCK:
            producer = _REGISTRY.get(key) if key else None
        if producer is None:
            raise RuntimeError(
                f"no in-process producer {key!r} for producer {producer_index}; "
                "transport='inprocess' needs the trainer in the worker's process"
            )
        return _InProcessLink(producer)


def inprocess_consumer(settings: ConsumerSettings) -> ConsumerTransport:
    """The "inprocess" transport's consumer factory (see `pull.registry`)."""
    return InProcessTransport()


def inprocess_server(settings: ServerSettings) -> ProducerServer:
    """The "inprocess" transport's server factory (see `pull.registry`)."""
    return InProcessServer(Producer(**settings.producer_kwargs))
