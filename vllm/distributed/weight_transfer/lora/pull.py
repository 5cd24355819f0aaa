# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapter pushes that cross machines: workers pull the adapter over NIXL.

A colocated trainer hands workers a CUDA IPC or shared-memory handle on the
buffer its adapter is packed in (``lora_trainer``, ``transport="ipc"``). A
worker on another machine cannot map that buffer, so with ``transport="nixl"``
the same packed buffer is served by a ``sharded_rdt`` `Producer` over the
direct NIXL transport (``sharded_rdt_nixl``) and every worker reads it with a
NIXL READ. The producer sees the buffer as one uint8 tensor, ``PAYLOAD``, in
one gather group, and every worker pulls all of it: an adapter is megabytes,
vLLM's LoRA layers cut each TP rank's slice from the whole adapter, and all
workers pull the same bytes, so they share one serve slot and the producer
packs the adapter once per push.

One push, after ``start_weight_update``:

    trainer (``AdapterServer``)            each worker (``AdapterPuller``)
    forget the last push's consumers
    send update_weights with the           register the one chunk (its random
    adapter header and ``AdapterPull``     consumer id), then pull it for
    (endpoint, sync id, payload bytes)     ``sync_id``: the producer holds the
                                           pull until the sync begins
    once ``workers`` consumers registered:
    begin the sync, publish the buffer,    NIXL READ of the payload, then view
    wait until every consumer read it      the tensors in it (``payload_views``)
                                           and stage them as an ipc push does

Receipts of a verified push go back through the producer's control socket
(the publication's ``"producer"`` receipt channel), so nothing needs a path
both machines share. Every wait is bounded by the push's ``stall_timeout_s``:
the trainer's wait for registrations, the worker's wait for the sync and its
READ. A failure on either side fails the producer's sync, so the other side
raises at once instead of at its deadline.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, dtype_from_name
from vllm.distributed.weight_transfer.pull.chunks import (
    PullChunk,
    chunks_digest,
    make_chunk,
)
from vllm.distributed.weight_transfer.pull.registry import (
    ConsumerSettings,
    ServerSettings,
    make_consumer,
    make_server,
)
from vllm.distributed.weight_transfer.pull.transport import ProducerLink
from vllm.distributed.weight_transfer.verification import describe_error
from vllm.logger import init_logger

logger = init_logger(__name__)

# The update_info field that makes an adapter message a pull.
ADAPTER_PULL_KEY = "adapter_pull"
# The producer's one source tensor: the packed adapter.
PAYLOAD = "lora_adapter_payload"
# How often the trainer looks for registrations while it waits for them.
_REGISTRATION_POLL_S = 0.005


@dataclass(frozen=True)
class AdapterPull:
    """Where a worker pulls one push's packed adapter from (JSON-safe)."""

    endpoint: Mapping[str, Any]  # the producer's NIXL endpoint
    sync_id: int  # the producer sync the pull belongs to
    nbytes: int  # bytes of the packed adapter
    stall_timeout_s: float  # bound on every wait of the pull

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, Mapping):
            raise ValueError(
                f"adapter_pull.endpoint is a {type(self.endpoint).__name__}, "
                "not an object"
            )
        if self.endpoint.get("transport") != "nixl":
            raise ValueError(
                f"adapter_pull.endpoint names transport "
                f"{self.endpoint.get('transport')!r}; adapters are pulled over "
                "'nixl' only"
            )
        for field_name in ("sync_id", "nbytes"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"adapter_pull.{field_name} must be a positive integer, "
                    f"got {value!r}"
                )
        timeout = self.stall_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(
                f"adapter_pull.stall_timeout_s must be a number, got {timeout!r}"
            )
        if not timeout > 0:
            raise ValueError(
                f"adapter_pull.stall_timeout_s must be > 0, got {timeout!r}"
            )

    def chunk(self) -> PullChunk:
        """The one chunk every worker pulls: the whole payload."""
        spec = SliceSpec(source=PAYLOAD, chain=(), shape=(self.nbytes,), dtype="uint8")
        return make_chunk(group=0, producer=0, seq=0, specs=[spec])

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoint": dict(self.endpoint),
            "sync_id": self.sync_id,
            "nbytes": self.nbytes,
            "stall_timeout_s": float(self.stall_timeout_s),
        }

    @classmethod
    def from_dict(cls, data: Any) -> AdapterPull:
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{ADAPTER_PULL_KEY} must be an object, got {type(data).__name__}"
            )
        fields = {"endpoint", "sync_id", "nbytes", "stall_timeout_s"}
        missing = sorted(fields - set(data))
        if missing:
            raise ValueError(f"{ADAPTER_PULL_KEY} lacks {missing}")
        return cls(
            endpoint=data["endpoint"],
            sync_id=data["sync_id"],
            nbytes=data["nbytes"],
            stall_timeout_s=data["stall_timeout_s"],
        )


def payload_views(
    payload: torch.Tensor, message: Mapping[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each tensor the message lists (``names``,
    ``dtype_names``, ``shapes``, ``offsets``, ``tensor_sizes``), viewed in
    ``payload`` (uint8): every field checked before any view is made."""
    fields = ("names", "dtype_names", "shapes", "offsets", "tensor_sizes")
    lists = {}
    for key in fields:
        value = message.get(key)
        if not isinstance(value, list):
            raise ValueError(f"adapter message field {key!r} must be a list")
        lists[key] = value
    n = len(lists["names"])
    uneven = {k: len(v) for k, v in lists.items() if len(v) != n}
    if uneven:
        raise ValueError(
            f"adapter message lists {n} names but {uneven} entries in other fields"
        )
    total = payload.numel()
    out = []
    for name, dtype_name, shape, offset, size in zip(
        *(lists[k] for k in fields), strict=True
    ):
        if not isinstance(name, str):
            raise ValueError(f"adapter tensor name {name!r} is not a string")
        try:
            dtype = dtype_from_name(str(dtype_name).removeprefix("torch."))
        except ValueError as e:
            raise ValueError(f"adapter tensor {name!r}: {e}") from None
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"adapter tensor {name!r} has shape {shape!r}")
        for label, value in (("offset", offset), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"adapter tensor {name!r} has {label} {value!r}")
        numel = 1
        for d in shape:
            numel *= d
        if size != numel * dtype.itemsize:
            raise ValueError(
                f"adapter tensor {name!r}: size {size} B, but shape {shape} of "
                f"{dtype} holds {numel * dtype.itemsize} B"
            )
        if offset % dtype.itemsize or offset + size > total:
            raise ValueError(
                f"adapter tensor {name!r} at offset {offset} ({size} B) does not "
                f"fit the {total} B payload aligned for {dtype}"
            )
        view = payload[offset : offset + size].view(dtype).view(shape)
        out.append((name, view))
    return out


# -- trainer side --------------------------------------------------------------


class AdapterServer:
    """A trainer's producer of packed adapters over NIXL: one per pusher,
    kept across pushes (its NIXL agent, control socket and serve buffer)."""

    def __init__(
        self, *, host: str, stall_timeout_s: float, device: torch.device
    ) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._server = make_server(
            "nixl",
            ServerSettings(
                dict(
                    rank=0,
                    names=[PAYLOAD],
                    group_lens=[1],
                    served_names=[PAYLOAD],
                    num_slots=1,
                    gather_lookahead=0,
                    stall_timeout_s=stall_timeout_s,
                    # Every consumer pulls the same chunk: one shared serve slot.
                    workers_per_replica=1,
                    device=device,
                    exact_buffers=True,
                ),
                host=host,
            ),
        )
        self._sync_id = 0

    @property
    def receipts(self) -> Any:
        """The inbox workers' receipts arrive in (``ReceiptInbox``)."""
        return self._server.receipts

    def open_push(self, nbytes: int) -> AdapterPull:
        """The next push's pull info; consumers of earlier pushes are
        forgotten, so that only this push's registrations count."""
        self._server.producer.forget_consumers()
        self._sync_id += 1
        return AdapterPull(
            endpoint=self._server.endpoint(),
            sync_id=self._sync_id,
            nbytes=nbytes,
            stall_timeout_s=self.stall_timeout_s,
        )

    def serve(
        self,
        pull: AdapterPull,
        payload: torch.Tensor,
        workers: int,
        stop: threading.Event,
    ) -> None:
        """Serve ``payload`` (uint8, ``pull.nbytes``) to ``workers`` consumers:
        wait until they registered, then run the sync until each has read
        it. Returns early, without serving, once ``stop`` is set (the update
        failed elsewhere). Any failure fails the sync, so pulls waiting for it
        raise at once."""
        producer = self._server.producer
        try:
            deadline = time.monotonic() + self.stall_timeout_s
            while len(registered := producer.registered()) < workers:
                if stop.is_set():
                    return
                aborted = producer.failure_of(pull.sync_id)
                if aborted is not None:
                    raise RuntimeError(aborted)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{len(registered)} of {workers} workers registered for "
                        f"the adapter pull within {self.stall_timeout_s:.1f}s"
                    )
                time.sleep(_REGISTRATION_POLL_S)
            producer.begin_sync(registered, pull.sync_id)
            producer.publish(0, {PAYLOAD: payload})
            producer.end_sync()
        except BaseException as e:
            self.fail(pull, describe_error(e))
            raise

    def fail(self, pull: AdapterPull, reason: str) -> None:
        """Fail ``pull``'s sync, begun or not: a worker waiting for it
        raises now."""
        self._server.producer.fail_sync(pull.sync_id, reason)

    def close(self) -> None:
        self._server.close()


# -- worker side ---------------------------------------------------------------


class AdapterPuller:
    """A worker's side of adapter pulls: its NIXL agent, its link to the
    trainer's producer and its receive buffer, kept across pushes. Its
    consumer id is random: workers of several engines pull from one
    producer, and none of them knows the others' ranks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.consumer_id = secrets.randbelow(2**31 - 1) + 1
        self._transport: Any = None
        self._link: ProducerLink | None = None
        self._endpoint: dict[str, Any] | None = None
        # The endpoint of the last pull, which its receipt goes back to.
        self._last_endpoint: dict[str, Any] | None = None
        self._buffer: torch.Tensor | None = None

    def pull(self, pull: AdapterPull) -> torch.Tensor:
        """The payload's bytes (valid until the next pull). On failure the
        producer is told, so the trainer stops waiting for this worker."""
        link = self._link_for(pull)
        chunk = pull.chunk()
        try:
            link.register(self.consumer_id, [chunk], chunks_digest([chunk]))
            link.sync_id = pull.sync_id
            into = self._buffer_for(chunk.nbytes)
            link.pull(chunk, into)
        except BaseException as e:
            try:
                link.abort(f"adapter pull failed: {describe_error(e)}")
            except Exception as abort_error:
                logger.warning(
                    "could not tell the adapter producer about a failed pull: %s",
                    abort_error,
                )
            # The connection may hold a half-read reply: the next push starts
            # a new one.
            self._drop_link()
            raise
        return into[: pull.nbytes]

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        """Hand a receipt to the producer of the last pull (its own control
        connection, bounded by the pull's stall timeout)."""
        endpoint = self._last_endpoint
        if self._transport is None or endpoint is None:
            raise RuntimeError(
                "an adapter receipt before any adapter pull: no producer to "
                "deliver it to"
            )
        link = self._link
        if link is None:
            link = self._link = self._transport.connect(0, endpoint)
            self._endpoint = endpoint
        link.deliver_receipt(receipt)

    def _link_for(self, pull: AdapterPull) -> ProducerLink:
        if self._transport is None:
            self._transport = make_consumer(
                "nixl", ConsumerSettings(self.consumer_id, pull.stall_timeout_s)
            )
        self._transport.stall_timeout_s = pull.stall_timeout_s
        endpoint = dict(pull.endpoint)
        self._last_endpoint = endpoint
        if self._link is None or self._endpoint != endpoint:
            self._drop_link()
            self._link = self._transport.connect(0, endpoint)
            self._endpoint = endpoint
        assert self._link is not None
        return self._link

    def _buffer_for(self, nbytes: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < nbytes:
            # Registered with NIXL until the puller closes; doubling keeps
            # the registrations few while adapters grow.
            size = max(nbytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffer = self._transport.receive_buffer(size, self.device)
        return buffer

    def _drop_link(self) -> None:
        link, self._link, self._endpoint = self._link, None, None
        if link is not None:
            try:
                link.close()
            except Exception as e:
                logger.debug("closing the adapter producer link failed: %s", e)

    def close(self) -> None:
        self._drop_link()
        transport, self._transport = self._transport, None
        self._buffer = None
        if transport is not None:
            transport.close()


def served_workers(expected: range | int) -> int:
    """How many workers pull a push (``expected_workers(client)``)."""
    return len(expected) if isinstance(expected, range) else int(expected)
