# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker side of the ``sharded_rdt`` backend: each inference worker pulls only
the slices of the trainer's tensors its own weight loaders keep.

``init_weight_transfer_engine``:
    1. bake: dry-run the model's loaders over the trainer's metadata
       (`sharded_rdt_bake.bake_worker_plan`) -> a `WorkerPlan`;
    2. chunk: route each slice to a producer (`RdtRouter`) and pack per
       (group, producer) (`sharded_rdt_chunks.build_pull_plan`);
    3. connect a transport to every producer and register the chunks there;
       allocate ``num_rdt_buffers`` receive buffers of the largest chunk.
``start_weight_update``: open a layerwise-reload session.
``update_weights``: pull every chunk in group order (a background thread keeps
    up to ``num_rdt_buffers`` pulls ahead) and land each one
    (`sharded_rdt_reload.ChunkLander`); a layer is processed as soon as its
    last slice has landed. Returns when all of it is in place, so
    ``defers_processing`` is False and ``drain_pending`` has nothing to wait for.
``finish_weight_update``: close the session (layers that got nothing keep
    their weights). Any failure aborts the session, which restores every layer
    not yet completed, and tells the producers.

With staging (``WeightTransferConfig.staging``), ``update_weights`` starts
the pulls on a background thread and returns: each chunk is checked and
copied into staging while the engine keeps serving the old weights. The
trainer's prepare message waits for the pulls (each bounded by
``stall_timeout_s``) and re-raises their failure, which leaves the engine
unfenced; ``finish_weight_update`` lands the staged chunks through the same
``ChunkLander`` in one call.

Trainer-side FP8 codes (``fp8_codes.Fp8ChannelCodes`` on the trainer, an
engine quantized online per channel): at init ``codes_landing.CodesLanding``
plans where this worker's shard of every codes tensor and scale lands in the
served codes, and those pieces join the pull plan as direct copies
(``sharded_rdt_plan.with_direct_copies``): pulled like any slice, copied by
``ChunkLander`` straight into the served views, never loaded or processed.
The other tensors are baked and landed as above.

Planned landing (``WeightTransferConfig.landing="planned"``): at init
``planned_landing.LandingPlan.of_plan`` proves which modules of the baked
plan keep their bytes through vLLM's post-load processing; their copies are
bound to views of the served tensors and join the lander's direct copies
(``sharded_rdt_plan.leaving_unprocessed`` takes them out of every group's
``completes``). Each pulled byte of those modules is then copied once, from
the receive buffer into the served tensor; the other modules (MoE experts on
vLLM CPU, packed or quantized layers) are materialized, loaded and processed
as above, in the same sync. A sync whose copies are all direct never opens
the layerwise reload. With checksums on, every direct copy is read back
after its chunk landed (``ChunkLander.direct_differs``).

Verified publication (`WorkerPublication`): the update message's header must
carry the manifest this worker baked its plan from, or the update is refused
before anything is pulled (the weights stay intact, the engine is not
fenced). Each pulled chunk is checked against the producer's checksum when
the publication has checksums, and each of its slices is admitted against
the plan before it lands. At finish the worker hands its receipt to producer
0, whose trainer rank verifies it. A failure after the first chunk landed
fences the engine: ``update_weights`` and ``finish_weight_update`` are refused
until a full resync (start, update, finish with a header) completes.

No step needs an accelerator or vLLM's Ray executor: under the default (mp)
executor the bytes move over direct NIXL agents (``transport="nixl"``); under
the Ray executor with Ray producer actors, over Ray Direct Transport.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.common.wire_fields import check_int
from vllm.distributed.weight_transfer.landing.codes import CodesLanding, CodesRefused
from vllm.distributed.weight_transfer.landing.layerwise import (
    LayerwiseReloadSession,
)
from vllm.distributed.weight_transfer.landing.planned import LandingPlan
from vllm.distributed.weight_transfer.plan.ops import (
    dtype_from_name,
)
from vllm.distributed.weight_transfer.plan.worker_plan import (
    WorkerPlan,
    leaving_unprocessed,
)
from vllm.distributed.weight_transfer.pull.chunks import (
    PullPlan,
)
from vllm.distributed.weight_transfer.pull.delta_bases import HeldBases
from vllm.distributed.weight_transfer.pull.registry import transport_entry
from vllm.distributed.weight_transfer.pull.routing import (
    buffer_alloc_bytes,
)
from vllm.distributed.weight_transfer.pull.transport import (
    ConsumerTransport,
    ProducerLink,
    Pulled,
)
from vllm.distributed.weight_transfer.quant.values import (
    packed_values,
    refuse_bad_values,
)
from vllm.distributed.weight_transfer.sharded_rdt.consumer import (
    choose_transport,
    make_consumer_transport,
    plan_consumer,
    planned_bytes,
)
from vllm.distributed.weight_transfer.sharded_rdt.lander import (
    ChunkLander,
)
from vllm.distributed.weight_transfer.sharded_rdt.pulls import DeltaCounts, run_pulls
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
    ShardedRDTWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    WorkerPublication,
    describe_error,
    device_identity,
)
from vllm.distributed.weight_transfer.worker.lifecycle import (
    LayerwiseWorkerEngine,
    UpdateSession,
)
from vllm.distributed.weight_transfer.worker.staged import StagedUpdate
from vllm.logger import init_logger

logger = init_logger(__name__)

# Upstream 0.32's private name for the same function (its tests import it).
_dtype_from_name = dtype_from_name

__all__ = [
    "ShardedRDTWeightTransferEngine",
    "ShardedRDTWeightTransferInitInfo",
    "ShardedRDTWeightTransferUpdateInfo",
]


class ShardedRDTWeightTransferEngine(
    LayerwiseWorkerEngine[
        ShardedRDTWeightTransferInitInfo, ShardedRDTWeightTransferUpdateInfo
    ]
):
    """See the module docstring."""

    backend_name = "sharded_rdt"
    init_info_cls = ShardedRDTWeightTransferInitInfo
    update_info_cls = ShardedRDTWeightTransferUpdateInfo
    supports_draft_weight_update = False
    defers_processing = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.consumer_id: int | None = None
        self.transport_name: str | None = None
        self.plan: WorkerPlan | None = None
        self.pulls: PullPlan | None = None
        self.stall_timeout_s = 300.0
        self._transport: ConsumerTransport | None = None
        self._links: list[ProducerLink] = []
        self._buffers: list[torch.Tensor] = []
        self._lander: ChunkLander | None = None
        # Trainer-side FP8 codes of the init's layout, landed straight in the
        # served codes (None when the trainer sends none).
        self._codes: CodesLanding | None = None
        # With ``landing="planned"``: the modules of the plan whose pulled
        # bytes go straight into the served tensors (None otherwise). It is
        # planned over ``_baked``, the loaders' plan alone; ``_pulled`` adds
        # the codes' copies (the plan the pulls were built from), and
        # ``plan`` takes the planned modules out of its ``completes``.
        self.landing_plan: LandingPlan | None = None
        self._baked: WorkerPlan | None = None
        self._pulled: WorkerPlan | None = None
        # What the last update_weights pulled and landed (JSON-safe).
        self.last_receipt: dict[str, Any] | None = None
        # The structure the plan was baked from, and the bytes of each tensor
        # the plan pulls; set at init.
        self.manifest: Manifest | None = None
        self.expected: dict[str, int] = {}
        # With deltas on: each chunk's bytes as last landed (a delta's base):
        # a copy, or, for a chunk every slice of which lands by a direct copy,
        # the served tensors themselves.
        self._held: HeldBases | None = None
        self._sync_id: int | None = None

    def _make_publication(self) -> WorkerPublication:
        return WorkerPublication(
            backend="sharded_rdt",
            worker_rank=self.consumer_id or 0,  # set again when init names it
            worker_device=device_identity(self.device),
            manifest_for=lambda header: self.manifest,
            expected_for=lambda header, manifest: self.expected,
            producer_call=self._deliver_receipt,
        )

    # -- parsing -------------------------------------------------------------

    def parse_init_info(
        self, init_dict: dict[str, Any]
    ) -> ShardedRDTWeightTransferInitInfo:
        return ShardedRDTWeightTransferInitInfo.from_dict(init_dict)

    def parse_update_info(
        self, update_dict: dict[str, Any]
    ) -> ShardedRDTWeightTransferUpdateInfo:
        return ShardedRDTWeightTransferUpdateInfo.from_dict(update_dict)

    # -- init ----------------------------------------------------------------

    def init_transfer_engine(self, init_info: ShardedRDTWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        if getattr(parallel, "enable_eplb", False):
            raise RuntimeError(
                "sharded_rdt does not support EPLB: expert placement changes at "
                "runtime while the plan is baked once; disable enable_eplb"
            )
        if not init_info.names:
            raise ValueError("sharded_rdt init_info.names is empty")
        transport_name = choose_transport(
            init_info, parallel.distributed_executor_backend
        )
        transport_entry(transport_name).check_ready()
        started = time.perf_counter()
        plan = plan_consumer(
            init_info,
            model=self.model,
            model_config=self.model_config,
            parallel=parallel,
            vllm_config=self.vllm_config,
            device=self.device,
        )
        consumer_id, metas, pulls = plan.consumer_id, plan.metas, plan.pulls
        baked, pulled, codes = plan.baked, plan.pulled, plan.codes
        landing = self._planned_landing(baked)

        # Every check so far is pure: an init they refuse leaves the previous
        # one serving syncs. From here on the old links give way to new ones,
        # and an update still open on them (a staged pull may be running) is
        # closed first.
        if self._session is not None and self._session.is_open:
            self._fail_update(
                RuntimeError(
                    "init_weight_transfer_engine replaced the transfer an open "
                    "update was using"
                )
            )
        self._release()
        transport, links, buffers, size = self._connect(
            init_info, transport_name, consumer_id, pulls
        )
        self.consumer_id = consumer_id
        self.pub.worker_rank = consumer_id
        self.manifest = Manifest.from_params(metas)
        self.expected = planned_bytes(pulls)
        self.transport_name = transport_name
        self.stall_timeout_s = init_info.stall_timeout_s
        bases_bytes = int(init_info.delta_bases_gb * (1 << 30))
        self._held = (
            HeldBases(bases_bytes, served=_ServedChunks(lambda: self._lander))
            if bases_bytes
            else None
        )
        self._baked = baked
        self._pulled = pulled
        self.landing_plan = landing
        self.plan = self._landing_order(pulled, landing)
        self.pulls = pulls
        self._transport = transport
        self._links = links
        self._buffers = buffers
        self._codes = codes
        self._lander = self._make_lander()
        logger.info(
            "sharded_rdt consumer %d: %s transport, %d chunks from %d producers, "
            "%d bytes per sync, %d receive buffers of %d bytes; ready in %.2f s",
            consumer_id,
            transport_name,
            len(pulls.chunks),
            len(links),
            pulls.payload_bytes,
            len(buffers),
            size,
            time.perf_counter() - started,
        )

    def _make_lander(self) -> ChunkLander:
        """The lander of the plan, with the FP8 codes' copies and the planned
        landing's bound to views of the served tensors they fill."""
        assert self.plan is not None and self.pulls is not None
        direct = dict(self._codes.slice_copies(self.model)) if self._codes else {}
        if self.landing_plan is not None:
            direct.update(self.landing_plan.bound_copies())
        return ChunkLander(self.model, self.plan, self.pulls, direct=direct)

    def _planned_landing(self, baked: WorkerPlan) -> LandingPlan | None:
        """With ``landing="planned"``, the modules of ``baked`` that land
        straight in the served tensors; else None."""
        if getattr(self.config, "landing", "reload") != "planned":
            return None
        return LandingPlan.of_plan(self.model, baked, vllm_config=self.vllm_config)

    @staticmethod
    def _landing_order(pulled: WorkerPlan, landing: LandingPlan | None) -> WorkerPlan:
        """The plan the lander follows: ``pulled`` with the planned landing's
        modules processed nowhere."""
        if landing is None:
            return pulled
        return leaving_unprocessed(pulled, landing.writers)

    def _connect(
        self,
        init_info: ShardedRDTWeightTransferInitInfo,
        transport_name: str,
        consumer_id: int,
        pulls: PullPlan,
    ) -> tuple[ConsumerTransport, list[ProducerLink], list[torch.Tensor], int]:
        """Links to every producer, each told which chunks this consumer
        pulls, and the receive buffers; on any failure everything opened here
        is closed again."""
        transport = make_consumer_transport(transport_name, init_info, consumer_id)
        endpoints: list[Any] = (
            list(init_info.trainer_actor_names)
            if transport_entry(transport_name).actor_endpoints
            else list(init_info.producer_endpoints)
        )
        links: list[ProducerLink] = []
        try:
            for p, endpoint in enumerate(endpoints):
                link = transport.connect(p, endpoint)
                links.append(link)
                link.register(consumer_id, pulls.for_producer(p), pulls.digest(p))
            presize = int(init_info.buffer_presize_gb * (1 << 30))
            size = buffer_alloc_bytes(pulls.max_chunk_bytes, presize)
            buffers = (
                [
                    transport.receive_buffer(size, self.device)
                    for _ in range(init_info.num_rdt_buffers)
                ]
                if pulls.max_chunk_bytes
                else []
            )
        except BaseException:
            for link in links:
                link.close()
            transport.close()
            raise
        return transport, links, buffers, size

    # -- updates -------------------------------------------------------------

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The sync id is known before any check, so that a refusal below
        # names this sync to the producers even before the first pull.
        sync_id = update_info.get("sync_id") if isinstance(update_info, dict) else None
        try:
            check_int(sync_id, "sync_id", minimum=1)
        except ValueError:
            pass  # the parse below refuses it, naming the field
        else:
            for link in self._links:
                link.sync_id = sync_id
        super().update_weights(update_info)

    def receive_weights(self, update_info: ShardedRDTWeightTransferUpdateInfo) -> None:
        if self.pulls is None or self._lander is None:
            raise RuntimeError(
                "sharded_rdt update_weights before init_weight_transfer_engine"
            )
        session = self._session_for("sharded_rdt update_weights")
        started = time.perf_counter()
        header = self.pub.header
        self._sync_id = update_info.sync_id
        for link in self._links:
            link.sync_id = update_info.sync_id
            link.checksums = header is not None and header.checksum is not None
        if self._codes is not None:
            self._check_codes_bound()
        if (
            self.landing_plan is not None
            and not (isinstance(session, LayerwiseReloadSession) and session.landing)
            and not self.landing_plan.still_bound()
        ):
            # (Checked only while every layer serves: once an update has
            # begun landing, its layers sit aside and the views it bound
            # are the ones it must write.)
            self._bind_planned_again()
        lander = self._lander
        if isinstance(session, StagedUpdate):
            # Refuse before the first pull when this worker's plan cannot be
            # staged; the lander's steps run at the commit.
            session.expect(self.pulls.payload_bytes, "this worker's pull plan")
            # The commit lands through views bound now: checked again at
            # prepare and before the commit's first write.
            if self.landing_plan is not None:
                session.relies_on(self.landing_plan.still_bound, "the planned landing")
            if self._codes is not None:
                session.relies_on(self._codes.still_bound, "the FP8 codes landing")

            def begin(landing: LayerwiseReloadSession) -> None:
                landing.writing_served()
                lander.begin(before_first_module=landing.begin_landing)

            session.defer(begin)
            # The pulls run while the engine keeps serving; the trainer's
            # prepare message waits for them.
            session.in_background(
                lambda stop: self._pull_all(lander, session, started, stop),
                name="sharded-rdt-stage",
            )
            return
        assert isinstance(session, LayerwiseReloadSession)
        session.writing_served()
        lander.begin(before_first_module=session.begin_landing)
        self._pull_all(lander, session, started, None)

    def _check_codes_bound(self) -> None:
        """Before anything is pulled: the served tensors the codes were bound
        to at init are still the ones served (a reload may have replaced
        them); bind them again if not, as long as the plan is unchanged. (A
        staged update stages the pulled chunks and lands them, codes
        included, at the commit.)"""
        codes = self._codes
        assert codes is not None
        if codes.still_bound():
            return
        assert self.manifest is not None
        fresh = CodesLanding.plan(
            self.model,
            [(e.name, e.dtype, tuple(e.shape)) for e in self.manifest.entries],
            worker=f"consumer {self.consumer_id}",
            vllm_config=self.vllm_config,
        )
        if fresh is None or fresh.copies != codes.copies:
            raise CodesRefused(
                "the served FP8 layers changed since init_weight_transfer_engine "
                "and the codes no longer land where they were planned; call "
                "init_weight_transfer_engine again; nothing was pulled"
            )
        self._codes = fresh
        self._lander = self._make_lander()

    def _bind_planned_again(self) -> None:
        """Before anything is pulled: a served tensor the planned landing was
        bound to was replaced since init (a reload); plan the landing again on
        the tensors that serve now. The pull plan does not change."""
        assert self._baked is not None and self._pulled is not None
        self.landing_plan = self._planned_landing(self._baked)
        self.plan = self._landing_order(self._pulled, self.landing_plan)
        self._lander = self._make_lander()

    def _pull_all(
        self,
        lander: ChunkLander,
        session: UpdateSession,
        started: float,
        stop: threading.Event | None,
    ) -> None:
        """Pull and land (or stage) every chunk; record the sync's numbers."""
        assert self.pulls is not None
        header = self.pub.header
        deltas = DeltaCounts()
        if self._held is not None:
            # A delta to bytes read back from the served tensors is written
            # there too, unless this sync lands in staging.
            self._held.write_served = not isinstance(session, StagedUpdate)
        try:
            pulled, timing = run_pulls(
                self.pulls.chunks,
                self._links,
                self._buffers,
                lambda i, data, result, timing: self._land(
                    lander, session, i, data, result, timing, deltas
                ),
                consumer_id=self.consumer_id,
                stall_timeout_s=self.stall_timeout_s,
                cancel=stop,
                held=self._held.base if self._held is not None else None,
                keep=self._keep_pulled if self._held is not None else None,
            )
        except BaseException as e:
            if stop is not None:  # a background pull: tell the producers now
                self._on_update_failed(describe_error(e))
            raise
        elapsed = time.perf_counter() - started
        if self._held is not None and self.pub.record is not None:
            self.pub.record.read_bytes = deltas.read_bytes
        self.last_receipt = {
            "consumer_id": self.consumer_id,
            "transport": self.transport_name,
            "publication_id": header.publication_id if header else None,
            "chunks": len(self.pulls.chunks),
            "bytes": sum(pulled.values()),
            "bytes_by_producer": {str(p): n for p, n in sorted(pulled.items())},
            "planned_bytes": self.pulls.payload_bytes,
            # Bytes read from the producers (deltas count their own size),
            # and the chunks that came as deltas or were refused as such.
            **deltas.as_receipt(self._held),
            "modules_processed": len(lander.processed),
            # Direct copies moved by each chunk's one batched copy.
            "direct_copies_batched": lander.batched,
            "checksums_verified": (
                self.pub.checker.checksums_verified if self.pub.checker else 0
            ),
            "seconds": elapsed,
            # Time inside transport pulls (request, pack, read) on the pulling
            # thread, and landing + processing on this one; they overlap.
            "pull_seconds": timing["pull"],
            "land_seconds": timing["land"],
        }

    def drain_pending(self) -> None:
        """Nothing is queued once update_weights returns."""

    def shutdown(self) -> None:
        super().shutdown()
        self._release()

    # -- internals -----------------------------------------------------------

    def _land(
        self,
        lander: ChunkLander,
        session: UpdateSession,
        index: int,
        data: torch.Tensor,
        result: Pulled,
        timing: dict[str, float],
        deltas: DeltaCounts,
    ) -> None:
        """Check chunk ``index`` (its checksum, each slice against the plan),
        then land it, or stage a copy to land at the commit."""
        assert self.pulls is not None
        chunk = self.pulls.chunks[index]
        pub = self.pub
        checksum = result.checksum
        # A delta checked against the served bytes and still to be written
        # there: ``data`` holds only the delta, and the checksum of the
        # chunk's new bytes is proven (`delta_in_place`).
        in_place = result.in_place
        deltas.count(result, f"chunk seq {chunk.seq} from producer {chunk.producer}")
        pub.check_payload(
            f"chunk seq {chunk.seq} (group {chunk.group}) from producer "
            f"{chunk.producer}",
            checksum,
            data,
            proven=in_place.checksum if in_place is not None else None,
        )
        slices = [p.spec for p in chunk.slices if p.spec.nbytes]
        for spec in slices:
            pub.admit_slice(spec.source, None, spec.nbytes)
        # Scales and float8 codes hold what a quantizer gives, or nothing
        # lands. (A chunk written in place holds none: `ChunkLander.pieces`.)
        if in_place is None:
            refuse_bad_values(
                packed_values(chunk.slices, data), f"chunk seq {chunk.seq}"
            )
        if not isinstance(session, StagedUpdate):
            # (The engine's own session may already be detached by a finish
            # that waits for this background pull: decide by this one.)
            self._mark_landed()
        t0 = time.perf_counter()
        if isinstance(session, StagedUpdate):
            if in_place is not None:
                raise RuntimeError(
                    f"chunk seq {chunk.seq}: a delta for the served tensors "
                    "arrived in a staged sync"
                )
            staged = session.stage(data, f"chunk seq {chunk.seq}")
            session.defer(lambda _landing: lander.land(index, staged))
        else:
            record = pub.record
            with record.phase("load") if record is not None else nullcontext():
                if in_place is not None:
                    in_place.write()
                    lander.land_in_place(index)
                else:
                    lander.land(index, data, reused=True)
        if (
            checksum is not None
            and in_place is None
            and not isinstance(session, StagedUpdate)
            and lander.has_direct(index)
            and bool(lander.direct_differs(index, data))
        ):
            raise RuntimeError(
                f"chunk seq {chunk.seq} (group {chunk.group}): the direct landing "
                "wrote bytes that differ from the pulled ones into the served "
                "tensors"
            )
        timing["land"] += time.perf_counter() - t0
        for spec in slices:
            pub.landed(spec.source, spec.nbytes)

    def _keep_pulled(self, index: int, data: torch.Tensor) -> None:
        """Keep chunk ``index``'s pulled bytes as its next delta base (a
        pending one: the update must commit first)."""
        assert self._held is not None
        self._held.record(index, data, self._sync_id)

    def _on_committed(self) -> None:
        if self._held is not None:
            self._held.commit()

    def _on_update_closed(self) -> None:
        super()._on_update_closed()
        if self._held is not None:
            self._held.discard_pending()

    def _deliver_receipt(self, receipt: dict[str, Any]) -> None:
        """Hand a receipt to producer 0, the sending trainer rank's."""
        if not self._links:
            raise RuntimeError(
                "sharded_rdt has no producer to deliver its receipt to; "
                "init_weight_transfer_engine did not connect any"
            )
        self._links[0].deliver_receipt(receipt)

    def _on_update_failed(self, reason: str) -> None:
        """Tell every producer, so the trainer stops waiting for this worker."""
        for link in self._links:
            try:
                link.abort(reason)
            except Exception as e:  # the producer may be the one that died
                logger.debug("sharded_rdt abort not delivered: %s", e)

    def _release(self) -> None:
        for link in self._links:
            try:
                link.close()
            except Exception as e:
                logger.debug("sharded_rdt link close failed: %s", e)
        if self._transport is not None:
            self._transport.close()
        self._links = []
        self._buffers = []
        self._transport = None
        self._lander = None
        self.plan = None
        self._baked = None
        self._pulled = None
        self.landing_plan = None
        self.pulls = None


class _ServedChunks:
    """`ReadBack` through whichever lander the worker holds when a delta
    comes (binding the served tensors again makes a new one): the chunks
    whose every slice lands by a direct copy that keeps its bytes."""

    def __init__(self, lander: Callable[[], ChunkLander | None]) -> None:
        self._lander = lander

    def can_read_back(self, index: int) -> bool:
        lander = self._lander()
        return lander is not None and lander.can_read_back(index)

    def read_back(self, index: int, into: torch.Tensor) -> None:
        lander = self._lander()
        if lander is None:
            raise ValueError("no lander: init_weight_transfer_engine was released")
        lander.read_back(index, into)

    def pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        lander = self._lander()
        return lander.pieces(index) if lander is not None else None
