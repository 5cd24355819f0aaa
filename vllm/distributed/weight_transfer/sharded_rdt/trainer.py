# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer side of the ``sharded_rdt`` backend.

Every trainer rank runs a `Producer` for the gather groups it holds and serves
it through a transport server; inference workers pull from the producers.

``trainer_init`` (every rank):
    1. metadata from the `WeightSource`, gather groups (`layerwise_groups`);
    2. ownership: each rank's ``held_names()`` (None = all), exchanged among
       trainer ranks and checked (same metadata everywhere, no orphan names);
    3. this rank's producer and its server (direct NIXL agent + control socket,
       a Ray actor for Ray Direct Transport, or in-process);
    4. endpoints exchanged; the sender (rank 0) sends the worker init info
       (`get_worker_init_payload`) with ``client.init_weight_transfer_engine``.
``send_weights(live_consumer_ids=None, weight_version=None)`` (every rank):
    one sync of ``trainer.sync`` (start, send, prepare and verify receipts,
    commit; abort and fence on failure) whose send step is the sender's
    ``update_weights`` running concurrently with every rank's gather loop:
    for each held group, wait for a credit (at most ``gather_lookahead + 1``
    groups resident), take the group from ``source.iter_groups()`` and
    publish it; then wait until every live consumer has read it all.
    Failures are exchanged so every rank raises.

Verified publication (``verify_publication``, on by default): the sender opens
a `TrainerPublication` whose header (manifest from ``source.metadata()``, the
trainer's model version) rides the update message. Each worker checks it
against the manifest it baked at init before pulling anything, admits every
slice against its plan before landing it and, at the prepare, hands its
receipt to producer 0 (this rank's producer, in the sender's process or its
actor); the sync verifies one complete receipt per live consumer before it
commits (``trainer.sync``). With ``verify_checksums``, producers checksum
every packed chunk and workers verify the bytes that reached them before
landing them.

Deltas (``delta_bases_gb`` above 0, off by default): each producer and each
worker keep up to that many GiB of the chunk bytes last synced (a producer
next to its serve buffers, so on the GPU with ``serve_device="cuda"``; a
worker in host memory), and
a chunk whose changed elements encode smaller than the chunk travels as a
delta against the worker's copy (``pull.delta_bases``); a worker that does
not hold the delta's base reads the whole chunk. Every chunk still lands
whole on the worker, so the served bytes are those of a full sync.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    layerwise_groups,
)
from vllm.distributed.weight_transfer.plan.ops import dtype_name
from vllm.distributed.weight_transfer.pull.registry import (
    ServerSettings,
    make_server,
    resolve_server_transport,
    transport_entry,
)
from vllm.distributed.weight_transfer.pull.routing import (
    DEFAULT_GATHER_LOOKAHEAD,
    DEFAULT_NUM_RDT_BUFFERS,
    DEFAULT_STALL_TIMEOUT_S,
    PRODUCE_METHOD_NAME,
    TRANSPORTS,
)
from vllm.distributed.weight_transfer.pull.transport import (
    ProducerServer,
)
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.trainer.group import (
    TrainerGroup,
    make_trainer_group,
)
from vllm.distributed.weight_transfer.trainer.lifecycle import (
    FullResyncTrainerEngine,
    ModelVersions,
)
from vllm.distributed.weight_transfer.trainer.settings import VerifiedSyncSettings
from vllm.distributed.weight_transfer.verification import (
    TrainerPublication,
    device_identity,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = [
    "DEFAULT_GATHER_LOOKAHEAD",
    "DEFAULT_STALL_TIMEOUT_S",
    "PRODUCE_METHOD_NAME",
    "ShardedRDTTrainerInitInfo",
    "ShardedRDTTrainerWeightTransferEngine",
]


@dataclass
class ShardedRDTTrainerInitInfo(TrainerInitInfo, VerifiedSyncSettings):
    """Trainer-side settings (upstream's names), plus fork fields:
    ``transport`` ("auto" = direct NIXL producers, "rdt" = Ray actors,
    "inprocess" = tests), ``producer_host`` (address workers reach this rank's
    control socket at; default 127.0.0.1 for one node), ``serve_device`` (where
    serve buffers live; default CPU) and ``process_group`` (the trainer ranks'
    group; default all ranks of torch.distributed).

    Verified publication: ``verify_publication``, ``verify_checksums``,
    ``model_version`` and ``receipt_timeout_s`` are ``VerifiedSyncSettings``'
    (keyword-only); receipts come from every live consumer, and checksums
    cover each packed chunk."""

    backend: ClassVar[str] = "sharded_rdt"
    num_consumers: int
    workers_per_replica: int = 0
    trainer_actor_namespace: str | None = None
    num_rdt_buffers: int = DEFAULT_NUM_RDT_BUFFERS
    buffer_presize_gb: float = 0.0
    gather_lookahead: int = DEFAULT_GATHER_LOOKAHEAD
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    transport: str = "auto"
    producer_host: str | None = None
    serve_device: str | None = None
    # GiB of last-synced chunk bytes each producer (next to its serve
    # buffers) and each worker (host memory) keep for delta syncs (0: off;
    # chunks past the limit travel whole). A worker keeps nothing for the
    # chunks that land straight in served tensors: it reads those back.
    delta_bases_gb: float = 0.0
    process_group: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_consumers < 1:
            raise ValueError(
                f"ShardedRDTTrainerInitInfo.num_consumers is {self.num_consumers}; "
                "pass the number of inference workers (DP x TP x PP) in the fleet"
            )
        if self.workers_per_replica < 0 or (
            self.workers_per_replica and self.num_consumers % self.workers_per_replica
        ):
            raise ValueError(
                f"workers_per_replica={self.workers_per_replica} must be 0 or "
                f"divide num_consumers={self.num_consumers}"
            )
        if self.num_rdt_buffers < 1 or self.gather_lookahead < 0:
            raise ValueError(
                f"num_rdt_buffers={self.num_rdt_buffers} must be >= 1 and "
                f"gather_lookahead={self.gather_lookahead} >= 0"
            )
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s is {self.stall_timeout_s}; need > 0")
        if not 0 <= self.delta_bases_gb < float("inf"):
            raise ValueError(
                f"delta_bases_gb is {self.delta_bases_gb}; need a finite number "
                ">= 0 (0: no deltas)"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport is {self.transport!r}; expected one of {list(TRANSPORTS)}"
            )
        super().__post_init__()


def metadata_digest(metas: list[ParamMeta]) -> str:
    text = "\n".join(f"{m.name}|{dtype_name(m.dtype)}|{list(m.shape)}" for m in metas)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ownership_table(
    names: list[str], held_by_rank: dict[int, list[str] | None]
) -> tuple[list[list[int]], list[int]]:
    """``(owner_sets, name_owner_class)`` from each rank's held names (None =
    all); both empty when every rank holds everything."""
    if all(h is None for h in held_by_rank.values()):
        return [], []
    index = {n: i for i, n in enumerate(names)}
    owners: list[list[int]] = [[] for _ in names]
    for rank in sorted(held_by_rank):
        held = held_by_rank[rank]
        for name in names if held is None else held:
            owners[index[name]].append(rank)
    orphans = [n for n, o in zip(names, owners, strict=True) if not o]
    if orphans:
        raise ValueError(
            f"{len(orphans)} parameter(s) are held by no trainer rank, first "
            f"{orphans[0]!r}; every name in metadata() must be in some rank's "
            "held_names()"
        )
    classes: dict[tuple[int, ...], int] = {}
    name_owner_class = [classes.setdefault(tuple(o), len(classes)) for o in owners]
    return [list(s) for s in classes], name_owner_class


class ShardedRDTTrainerWeightTransferEngine(
    FullResyncTrainerEngine[ShardedRDTTrainerInitInfo]
):
    """See the module docstring."""

    init_info_cls = ShardedRDTTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: ShardedRDTTrainerInitInfo,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.rank = init_info.rank
        self._group: TrainerGroup | None = None
        self._metas: list[ParamMeta] = []
        self._groups: list[list[str]] = []
        self._held: frozenset[str] = frozenset()
        self._owned: list[int] = []
        self._owner_sets: list[list[int]] = []
        self._name_owner_class: list[int] = []
        self._server: ProducerServer | None = None
        self._endpoints: list[dict[str, Any]] = []
        self._ready = False
        self._sync_id = 0  # the last sync begun; equal on every rank
        self._versions = ModelVersions(init_info.model_version)

    # -- init ----------------------------------------------------------------

    @classmethod
    def from_init_info(
        cls,
        init_info: ShardedRDTTrainerInitInfo,
        client: VLLMWeightSyncClient,
        source: WeightSource,
    ) -> Self:
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            init_info=init_info,
        )
        engine._init(source)
        return engine

    def _init(self, source: WeightSource) -> None:
        info = self.init_info
        group = make_trainer_group(info.rank, info.process_group, info.stall_timeout_s)
        self._group = group
        error: str | None = None
        payload: tuple[str, list[str] | None] | None = None
        try:
            payload = self._read_source(source)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        gathered = group.exchange(payload, error, "sharded_rdt trainer_init")
        digests = {r: p[0] for r, p in gathered.items()}
        if len(set(digests.values())) != 1:
            raise ValueError(
                f"WeightSource.metadata() differs across trainer ranks (digests "
                f"{digests}); every rank must describe the whole model"
            )
        names = [m.name for m in self._metas]
        self._owner_sets, self._name_owner_class = ownership_table(
            names, {r: p[1] for r, p in gathered.items()}
        )

        error = None
        endpoint: dict[str, Any] | None = None
        try:
            self._server = self._start_server()
            endpoint = self._server.endpoint()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        endpoints = group.exchange(endpoint, error, "sharded_rdt producer start")
        self._endpoints = [endpoints[r] for r in sorted(endpoints)]

        error = None
        if self.is_sender:
            try:
                self.client.init_weight_transfer_engine(self.get_worker_init_payload())
            except Exception as e:
                error = f"init_weight_transfer_engine: {e}"
                if group.world_size == 1:
                    raise
        group.exchange(None, error, "init_weight_transfer_engine")
        self._ready = True

    def _read_source(self, source: WeightSource) -> tuple[str, list[str] | None]:
        metas = list(source.metadata())
        names = [m.name for m in metas]
        groups = layerwise_groups(names)
        if [n for g in groups for n in g] != names:
            raise ValueError(
                "sharded_rdt needs metadata() in group-contiguous order (each "
                "layer's names together, layers ascending, as layerwise_groups "
                "orders them)"
            )
        held_raw = source.held_names()
        held: list[str] | None = None
        if held_raw is not None:
            held_set = set(held_raw)
            unknown = sorted(held_set - set(names))
            if unknown:
                raise ValueError(
                    f"held_names() lists {len(unknown)} name(s) not in metadata(), "
                    f"first {unknown[0]!r}"
                )
            if not held_set:
                raise ValueError(
                    f"held_names() of trainer rank {self.rank} is empty; a rank "
                    "that holds nothing should return None only if it holds all"
                )
            held = [n for n in names if n in held_set]
        self._metas = metas
        self._groups = groups
        self._held = frozenset(names if held is None else held)
        self._owned = [
            gi for gi, g in enumerate(groups) if any(n in self._held for n in g)
        ]
        return metadata_digest(metas), held

    def _start_server(self) -> ProducerServer:
        info = self.init_info
        kwargs: dict[str, Any] = dict(
            rank=self.rank,
            **self._layout(),
            served_names=self._held,
            num_slots=info.num_rdt_buffers,
            gather_lookahead=info.gather_lookahead,
            stall_timeout_s=info.stall_timeout_s,
            workers_per_replica=info.workers_per_replica,
            buffer_presize_bytes=int(info.buffer_presize_gb * (1 << 30)),
            device=info.serve_device or "cpu",
            checksums=info.verify_checksums,
            delta_bases_bytes=int(info.delta_bases_gb * (1 << 30)),
        )
        return make_server(
            resolve_server_transport(info.transport),
            ServerSettings(
                kwargs,
                host=info.producer_host or "127.0.0.1",
                namespace=info.trainer_actor_namespace,
                max_concurrency=info.num_consumers * info.num_rdt_buffers + 4,
            ),
        )

    def _layout(self) -> dict[str, Any]:
        """What the producers and the workers both take of the model's
        layout: the names in metadata order and each gather group's length."""
        return {
            "names": [m.name for m in self._metas],
            "group_lens": [len(g) for g in self._groups],
        }

    def get_worker_init_payload(self) -> dict[str, Any]:
        """The worker init info (a JSON-safe dict) for
        ``init_weight_transfer_engine``; a restarted inference engine rejoins
        with it. Needs no collective."""
        if not self._endpoints:
            raise RuntimeError("get_worker_init_payload before trainer_init")
        info = self.init_info
        rdt = transport_entry(resolve_server_transport(info.transport)).actor_endpoints
        return ShardedRDTWeightTransferInitInfo(
            trainer_actor_names=[e["actor_name"] for e in self._endpoints]
            if rdt
            else [],
            trainer_actor_namespace=info.trainer_actor_namespace,
            produce_method_name=PRODUCE_METHOD_NAME,
            **self._layout(),
            dtype_names=[dtype_name(m.dtype) for m in self._metas],
            shapes=[list(m.shape) for m in self._metas],
            owner_sets=self._owner_sets,
            name_owner_class=self._name_owner_class,
            num_consumers=info.num_consumers,
            num_rdt_buffers=info.num_rdt_buffers,
            buffer_presize_gb=info.buffer_presize_gb,
            transport="rdt" if rdt else "auto",
            producer_endpoints=[] if rdt else list(self._endpoints),
            stall_timeout_s=info.stall_timeout_s,
            delta_bases_gb=info.delta_bases_gb,
        ).to_dict()

    # -- send ----------------------------------------------------------------

    def send_weights(
        self,
        live_consumer_ids: Collection[int] | None = None,
        weight_version: str | None = None,
    ) -> None:
        """Serve one full sync; see the module docstring. ``live_consumer_ids``
        (default: all) are the workers that pull this time; the others (dead or
        restarting) are not waited for. ``weight_version``, if given, becomes
        the served version once every live consumer's receipt verified."""
        if not self._ready or self._group is None or self._server is None:
            raise RuntimeError("send_weights before trainer_init")
        n = self.init_info.num_consumers
        if live_consumer_ids is None:
            live = list(range(n))
        else:
            live = sorted(set(live_consumer_ids))
            bad = [c for c in live if not 0 <= c < n]
            if bad:
                raise ValueError(f"live_consumer_ids {bad} are outside 0..{n - 1}")
            if len(live) < n:
                logger.warning(
                    "sharded_rdt sync with %d of %d consumers live: %s",
                    len(live),
                    n,
                    live,
                )
        pub = self._open_publication()
        self._run_sync(
            lambda: self._serve(live, pub),
            group=self._group,
            pub=pub,
            verify=self.init_info.verify_publication,
            expected=lambda: live,
            weight_version=weight_version,
            verify_options={"delivery": "sliced"},
        )

    def _serve(self, live: list[int], pub: TrainerPublication | None) -> None:
        """The send step of one sync: the sender's ``update_weights`` runs
        concurrently with this rank's gather loop; failures are exchanged so
        every rank raises."""
        assert self._group is not None
        self._sync_id += 1
        update_info: dict[str, Any] = {"sync_id": self._sync_id}
        if pub is not None:
            # The bytes travel through the producers, which checksum them.
            update_info = pub.attach(update_info, payload=False)
        pool = concurrent.futures.ThreadPoolExecutor(1) if self.is_sender else None
        future = (
            pool.submit(self.client.update_weights, update_info)
            if pool is not None
            else None
        )
        # (when, what) of each failure: the first is the cause, later ones
        # usually follow from it.
        failures: list[tuple[float, str]] = []
        if future is not None:
            future.add_done_callback(lambda f: self._on_update_done(f, failures))
        try:
            self._gather(live, future)
        except Exception as e:
            failures.append((time.monotonic(), f"{type(e).__name__}: {e}"))
        if future is not None:
            # Its failure is in ``failures`` (the callback has run).
            concurrent.futures.wait([future])
        if pool is not None:
            pool.shutdown(wait=False)
        error = "; then ".join(m for _, m in sorted(failures)) or None
        # With staging, a worker's pull fails after its update_weights
        # returned: the update stays open until the abort.
        self._group.exchange(None, error, "sharded_rdt send_weights")

    def _open_publication(self) -> TrainerPublication | None:
        """The sender's publication of this sync (None elsewhere or when off);
        every rank contributes its device identity."""
        info = self.init_info
        if not info.verify_publication:
            return None
        assert self._group is not None
        devices = self._group.exchange(
            device_identity(info.serve_device or "cpu"), None, "publication"
        )
        if not self.is_sender:
            return None
        assert self._server is not None and self.source is not None
        return TrainerPublication.open(
            backend="sharded_rdt",
            model_version=self._versions.next(),
            metas=list(self.source.metadata()),
            trainer_devices=[devices[r] for r in sorted(devices)],
            channel="producer",
            checksums=info.verify_checksums,
            inbox=self._server.receipts,
        )

    def _on_update_done(
        self, future: concurrent.futures.Future[Any], failures: list[tuple[float, str]]
    ) -> None:
        """A failed ``update_weights`` (a worker refused the update, e.g. its
        manifest check) fails this rank's producer at once, so a trainer
        waiting for consumers that will never pull wakes up now rather than
        after the stall timeout."""
        error = future.exception()
        if error is None:
            return
        failures.append((time.monotonic(), f"update_weights: {error}"))
        server = self._server
        if server is not None:
            server.fail(f"a worker's update_weights failed: {error}")

    def _gather(
        self, live: list[int], future: concurrent.futures.Future[Any] | None
    ) -> None:
        assert self._server is not None and self.source is not None
        server = self._server
        try:
            server.begin_sync(live, self._sync_id)
            batches = self.source.iter_groups()
            for gi in self._owned:
                server.wait_credit()
                if future is not None and future.done():
                    future.result()
                try:
                    names, tensors = next(batches)
                except StopIteration:
                    raise RuntimeError(
                        f"WeightSource.iter_groups() ended before group {gi}"
                    ) from None
                if list(names) != self._groups[gi]:
                    raise RuntimeError(
                        f"WeightSource.iter_groups() yielded {list(names)[:3]}... "
                        f"where group {gi} is {self._groups[gi][:3]}...; "
                        "iteration must follow groups() in metadata order"
                    )
                server.publish(gi, self._held_tensors(gi, names, tensors))
            server.end_sync()
        except BaseException as e:
            server.fail(f"trainer rank {self.rank}: {type(e).__name__}: {e}")
            raise

    def _held_tensors(
        self, gi: int, names: list[str], tensors: list[Any]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in zip(names, tensors, strict=True):
            held = name in self._held
            if held and not isinstance(tensor, torch.Tensor):
                raise RuntimeError(
                    f"WeightSource yielded {type(tensor).__name__} for {name!r}, "
                    f"which trainer rank {self.rank} holds (group {gi})"
                )
            if not held and tensor is not None:
                raise RuntimeError(
                    f"WeightSource yielded a tensor for {name!r}, which "
                    f"held_names() of trainer rank {self.rank} excludes; yield "
                    "None for names this rank does not hold"
                )
            if held:
                out[name] = tensor.detach()
        return out

    @property
    def producer(self) -> Any:
        """This rank's producer (a local object or a Ray actor proxy)."""
        return None if self._server is None else self._server.producer

    def shutdown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._ready = False
