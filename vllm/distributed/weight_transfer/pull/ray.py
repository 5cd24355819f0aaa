# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ray Direct Transport: producers are Ray actors, packed chunks travel as the
return value of a ``tensor_transport="nixl"`` method.

Each trainer rank spawns one named producer actor (``enable_tensor_transport``)
that owns its `Producer`; the rank publishes each gather group to it (through
the object store on CPU). Workers must be Ray actors created with
``enable_tensor_transport=True`` (vLLM's Ray executor does this for
``sharded_rdt``, gated by `check_ray_rdt_version`) or a Ray driver. A worker
resolves the actors by name and calls, per chunk:

    ref = actor.rdt_produce_weights_batched.remote(consumer_id, seq)
    [packed] = ray.get(ref)            # NIXL read by Ray
    actor.packed_checksum.remote(consumer_id, seq)   # only with checksums on
    actor.read_done.remote(consumer_id, seq)

When the producer offers a delta next to the packed chunk (deltas on), the
produce method returns ``[delta, {"nbytes", "delta": header, "delta_nbytes"}]``
instead: Ray reads only the delta's bytes. A worker that cannot apply it (no
held bytes, another base, a malformed delta) reads the whole chunk with
``actor.rdt_produce_whole_chunk.remote(consumer_id, seq)`` before its
``read_done``; the actor keeps each offered chunk until then.

and at finish ``actor.deliver_receipt.remote(receipt)``; the sending trainer
rank collects receipts with ``actor.collect_receipts`` (`ActorReceiptInbox`).
Every ``ray.get`` is bounded by the stall timeout.
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.weight_transfer.pull.chunks import PullChunk
from vllm.distributed.weight_transfer.pull.delta_bases import OfferedDelta
from vllm.distributed.weight_transfer.pull.producer import Packed, Producer
from vllm.distributed.weight_transfer.pull.routing import (
    PRODUCE_METHOD_NAME,
    check_ray_rdt_version,
)
from vllm.distributed.weight_transfer.pull.transport import (
    ConsumerTransport,
    DrivesProducer,
    Offered,
    ProducerLink,
    ProducerServer,
)
from vllm.distributed.weight_transfer.verification import (
    DEFAULT_RECEIPT_TIMEOUT_S,
    Receipt,
    ReceiptInbox,
    ReceiptTimeoutError,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.pull.registry import (
        ConsumerSettings,
        ServerSettings,
    )

logger = init_logger(__name__)

_GRACE_S = 5.0


class _ProducerActorBase(DrivesProducer):
    """The producer actor's plain methods, the trainer's sync calls among them
    (the produce method is added with its Ray decorator in
    `producer_actor_class`)."""

    def __init__(self, producer_kwargs: dict[str, Any]) -> None:
        self.producer = Producer(**producer_kwargs)
        # Chunks offered as deltas, by (consumer, seq), until their read_done:
        # a consumer that refuses the delta reads the whole chunk from here.
        self._offered: dict[tuple[int, int], Packed] = {}
        self._offered_lock = threading.Lock()

    def _produce(self, consumer_id: int, seq: int, sync_id: int | None) -> list[Any]:
        """The produce method's return: ``[packed bytes]``, or ``[delta bytes,
        {"nbytes", "delta": header, "delta_nbytes"}]`` when a delta is
        offered."""
        packed = self.producer.pack(consumer_id, seq, sync_id)
        if packed.delta is None:
            return [packed.view]
        with self._offered_lock:
            self._offered[(consumer_id, seq)] = packed
        view = packed.delta.view
        if view.numel() == 0:  # nothing changed; Ray moves no empty tensors
            view = torch.zeros(1, dtype=torch.uint8, device=view.device)
        info = {
            "nbytes": packed.view.numel(),
            "delta": packed.delta.header,
            "delta_nbytes": packed.delta.view.numel(),
        }
        return [view, info]

    def _whole_chunk(self, consumer_id: int, seq: int) -> list[torch.Tensor]:
        with self._offered_lock:
            packed = self._offered.get((consumer_id, seq))
        if packed is None:
            raise RuntimeError(
                f"consumer {consumer_id} asked for the whole chunk seq {seq}, "
                "which this producer did not offer as a delta (or it was read)"
            )
        return [packed.view]

    def ping(self) -> int:
        return os.getpid()

    def register(
        self, consumer_id: int, chunks: list[dict[str, Any]], digest: str
    ) -> int:
        parsed = [PullChunk.from_json(c) for c in chunks]
        return len(self.producer.register(consumer_id, parsed, digest))

    def read_done(self, consumer_id: int, seq: int) -> None:
        with self._offered_lock:
            self._offered.pop((consumer_id, seq), None)
        self.producer.read_done(consumer_id, seq)

    def abort(self, consumer_id: int, reason: str, sync_id: int | None = None) -> None:
        self.producer.fail(f"consumer {consumer_id} aborted: {reason}", sync_id)

    def packed_checksum(self, consumer_id: int, seq: int) -> str | None:
        return self.producer.packed_checksum(consumer_id, seq)

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        self.producer.deliver_receipt(receipt)

    def collect_receipts(
        self, publication_id: str, expected_workers: list[int] | int, timeout_s: float
    ) -> dict[str, Any]:
        """``{"receipts": [...]}``, or ``{"timeout": message}``."""
        try:
            got = self.producer.receipts.collect(
                publication_id, expected_workers, timeout_s
            )
        except ReceiptTimeoutError as e:
            return {"timeout": str(e)}
        return {"receipts": [r.to_dict() for r in got]}

    def discard_receipts(self, publication_id: str) -> None:
        self.producer.receipts.discard(publication_id)

    def close(self) -> None:
        with self._offered_lock:
            self._offered.clear()
        self.producer.close()


@functools.cache
def producer_actor_class() -> type:
    """The producer actor class, with its NIXL tensor-transport methods."""
    import ray

    class RdtProducerActor(_ProducerActorBase):
        @ray.method(tensor_transport="nixl")
        def rdt_produce_weights_batched(
            self, consumer_id: int, seq: int, sync_id: int | None = None
        ) -> list[Any]:
            return self._produce(consumer_id, seq, sync_id)

        @ray.method(tensor_transport="nixl")
        def rdt_produce_whole_chunk(
            self, consumer_id: int, seq: int
        ) -> list[torch.Tensor]:
            return self._whole_chunk(consumer_id, seq)

    return RdtProducerActor


class ActorReceiptInbox(ReceiptInbox):
    """The trainer's view of a producer actor's receipt inbox."""

    def __init__(self, actor: Any, timeout_s: float) -> None:
        super().__init__()
        self._actor = actor
        self._timeout_s = timeout_s

    def deliver(self, receipt: dict[str, Any] | Receipt) -> None:
        import ray

        if isinstance(receipt, Receipt):
            receipt = receipt.to_dict()
        ray.get(self._actor.deliver_receipt.remote(receipt), timeout=self._timeout_s)

    def collect(
        self,
        publication_id: str,
        expected_workers: Collection[int] | int,
        timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
    ) -> list[Receipt]:
        import ray

        expected = (
            expected_workers
            if isinstance(expected_workers, int)
            else sorted(set(expected_workers))
        )
        ref = self._actor.collect_receipts.remote(publication_id, expected, timeout_s)
        result = ray.get(ref, timeout=timeout_s + self._timeout_s)
        if "timeout" in result:
            raise ReceiptTimeoutError(result["timeout"])
        return [Receipt.from_dict(r) for r in result["receipts"]]

    def discard(self, publication_id: str) -> None:
        import ray

        try:
            ray.get(
                self._actor.discard_receipts.remote(publication_id),
                timeout=self._timeout_s,
            )
        except Exception as e:  # the actor may be gone; nothing to free then
            logger.debug("could not discard receipts on the producer actor: %s", e)


class RdtProducerServer(ProducerServer):
    """Spawns and drives one trainer rank's producer actor."""

    def __init__(
        self,
        producer_kwargs: dict[str, Any],
        *,
        name: str,
        namespace: str | None,
        max_concurrency: int,
    ) -> None:
        import ray

        check_ray_rdt_version()
        if not ray.is_initialized():
            raise RuntimeError(
                "transport='rdt' spawns Ray actors; call ray.init() in the "
                "trainer first"
            )
        self.actor_name = name
        self.namespace = namespace
        self.stall_timeout_s = float(producer_kwargs["stall_timeout_s"])
        self.producer = (
            ray.remote(producer_actor_class())
            .options(
                name=name,
                namespace=namespace,
                num_cpus=0,
                max_concurrency=max_concurrency,
                enable_tensor_transport=True,
            )
            .remote(producer_kwargs)
        )
        ray.get(self.producer.ping.remote(), timeout=self.stall_timeout_s)
        self._receipts = ActorReceiptInbox(self.producer, self.stall_timeout_s)

    @property
    def receipts(self) -> ReceiptInbox:
        return self._receipts

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        ref = getattr(self.producer, method).remote(*args)
        return ray.get(ref)

    def endpoint(self) -> dict[str, Any]:
        return {
            "transport": "rdt",
            "actor_name": self.actor_name,
            "namespace": self.namespace,
        }

    def begin_sync(
        self, live_consumer_ids: Sequence[int], sync_id: int | None = None
    ) -> None:
        self._call("begin_sync", list(live_consumer_ids), sync_id)

    def wait_credit(self) -> None:
        self._call("wait_credit")

    def publish(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._call("publish", group, {n: t.cpu() for n, t in tensors.items()})

    def end_sync(self) -> None:
        self._call("end_sync")

    def fail(self, reason: str) -> None:
        try:
            self._call("fail", reason)
        except Exception as e:
            logger.warning("could not fail the producer actor: %s", e)

    def close(self) -> None:
        import ray

        try:
            ray.get(self.producer.close.remote(), timeout=10)
        except Exception as e:
            logger.debug("producer actor close failed: %s", e)
        ray.kill(self.producer)


def _byte_count(value: Any) -> int:
    """``value`` when it is an int, else -1 (refused where it is checked)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


class _RdtLink(ProducerLink):
    def __init__(self, transport: RdtConsumerTransport, index: int, actor: Any):
        self.transport = transport
        self.index = index
        self.peer = f"producer actor {index}"
        self.actor = actor
        self.consumer_id = transport.consumer_id

    def _get(self, ref: Any, what: str, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"producer actor {self.index} did not answer {what} within "
                f"{timeout_s:.1f}s"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"producer actor {self.index} died during {what}; the trainer "
                f"rank most likely died: {e}"
            ) from e

    def register(
        self, consumer_id: int, chunks: Sequence[PullChunk], digest: str
    ) -> None:
        ref = self.actor.register.remote(
            consumer_id, [c.to_json() for c in chunks], digest
        )
        self._get(ref, "register", self.transport.stall_timeout_s)

    def _request_pull(self, chunk: PullChunk, next_chunk: PullChunk | None) -> Offered:
        method = getattr(self.actor, self.transport.produce_method_name)
        ref = method.remote(self.consumer_id, chunk.seq, self.sync_id)
        timeout_s = self.transport.stall_timeout_s + _GRACE_S
        reply = self._get(ref, f"pull of seq {chunk.seq}", timeout_s)

        def checksum() -> str | None:
            if not self.checksums:
                return None
            return self._get(
                self.actor.packed_checksum.remote(self.consumer_id, chunk.seq),
                f"checksum of seq {chunk.seq}",
                self.transport.stall_timeout_s,
            )

        if len(reply) == 1:
            (packed,) = reply
            return Offered(packed.numel(), lambda into: into.copy_(packed), checksum)
        delta_bytes, info = reply
        header = info.get("delta") if isinstance(info, dict) else None
        nbytes = info.get("nbytes") if isinstance(info, dict) else None

        def read_whole(into: torch.Tensor) -> None:
            ref = self.actor.rdt_produce_whole_chunk.remote(self.consumer_id, chunk.seq)
            (whole,) = self._get(ref, f"whole chunk seq {chunk.seq}", timeout_s)
            into.copy_(whole)

        def read_delta(into: torch.Tensor) -> None:
            if into.numel() > delta_bytes.numel():
                raise ValueError(
                    f"the delta of chunk seq {chunk.seq} is {delta_nbytes} bytes "
                    f"by the producer's word but {delta_bytes.numel()} arrived"
                )
            into.copy_(delta_bytes[: into.numel()])

        delta_nbytes = info.get("delta_nbytes") if isinstance(info, dict) else None
        return Offered(
            _byte_count(nbytes),
            read_whole,
            checksum,
            OfferedDelta(header, _byte_count(delta_nbytes), read_delta),
        )

    def _read_done(self, seq: int) -> None:
        self.actor.read_done.remote(self.consumer_id, seq)

    def abort(self, reason: str) -> None:
        self.actor.abort.remote(self.consumer_id, reason, self.sync_id)

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        self._get(
            self.actor.deliver_receipt.remote(receipt),
            "receipt delivery",
            self.transport.stall_timeout_s,
        )


class RdtConsumerTransport(ConsumerTransport):
    """A worker's side of Ray Direct Transport; see the module docstring."""

    name = "rdt"

    def __init__(
        self,
        consumer_id: int,
        *,
        namespace: str | None,
        produce_method_name: str = PRODUCE_METHOD_NAME,
        stall_timeout_s: float,
    ) -> None:
        try:
            import ray
        except ImportError as e:
            raise RuntimeError(
                "transport='rdt' needs Ray on the inference side; use "
                "transport='nixl' to run without it"
            ) from e
        if not ray.is_initialized():
            raise RuntimeError(
                "transport='rdt' needs the worker to be a Ray actor (vLLM's Ray "
                "executor) or a Ray driver; use transport='nixl' otherwise"
            )
        self.consumer_id = consumer_id
        self.namespace = namespace
        self.produce_method_name = produce_method_name
        self.stall_timeout_s = stall_timeout_s

    def connect(self, producer_index: int, endpoint: Any) -> ProducerLink:
        import ray

        name = endpoint["actor_name"] if isinstance(endpoint, dict) else endpoint
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
        except ValueError as e:
            raise RuntimeError(
                f"could not find producer actor {name!r} in namespace "
                f"{self.namespace!r}: {e}"
            ) from e
        # A handle resolved by name does not carry the class's tensor-transport
        # opt-in; the produce method needs it.
        actor._ray_enable_tensor_transport = True
        return _RdtLink(self, producer_index, actor)


def rdt_consumer(settings: ConsumerSettings) -> ConsumerTransport:
    """The "rdt" transport's consumer factory (see `pull.registry`)."""
    return RdtConsumerTransport(
        settings.consumer_id,
        namespace=settings.namespace,
        produce_method_name=settings.produce_method_name,
        stall_timeout_s=settings.stall_timeout_s,
    )


def rdt_server(settings: ServerSettings) -> ProducerServer:
    """The "rdt" transport's server factory (see `pull.registry`): spawns the
    rank's producer actor under a fresh name."""
    rank = settings.producer_kwargs["rank"]
    return RdtProducerServer(
        settings.producer_kwargs,
        name=f"vllm_rdt_producer_{uuid.uuid4().hex[:12]}_rk{rank}",
        namespace=settings.namespace,
        max_concurrency=settings.max_concurrency,
    )
