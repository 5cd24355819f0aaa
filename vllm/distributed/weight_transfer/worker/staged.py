# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One weight update staged in memory the worker owns while the engine keeps
serving the weights it has, then committed in one call.

``WeightTransferConfig.staging`` selects it (``"device"`` or ``"host"``; the
default ``"off"`` lands in place through ``LayerwiseReloadSession``). The
worker engine drives it through the same calls as the in-place session:

1. ``start()`` (from ``start_weight_update``): opens the update. The model is
   not touched until the commit, so generation keeps running on the served
   weights for the whole transfer; nothing hooks the forward pass.
2. ``load(weights)`` (ipc; ``load_planned`` for tensors a planned landing
   copies straight into served tensors) or ``stage(data)`` + ``defer(land)``
   (``sharded_rdt``, from a background pull started with ``in_background``,
   so that the engine keeps stepping while the bytes arrive), any number of
   times: each tensor is copied into staging
   (``where``: the model's device, or host memory, pinned on CUDA) and the
   step that will land it is remembered. On vLLM CPU (``process_while_staging``)
   ``load`` first hands the tensors of layers that can be processed apart from
   the served ones to ``shadow_layers.ShadowLayers``: they load into shadows
   of their layers, and each layer is processed (its CPU GEMM handle built) in
   the call that completes it, so the commit only copies and swaps it in.
   A name received twice is refused.
   Staging is counted against the memory the worker has free; a transfer
   that would not fit is refused before it is copied (``StagingDoesNotFit``).
3. ``prepare()`` (from the trainer's prepare message, or at the start of
   ``finish``): waits for the background work and re-raises its failure,
   then checks, by name only, that the update covers every fused group it
   touches, and that every shadow layer received all its tensors and fits
   the served layer (``ShadowLayers.check``). A refusal here leaves the model
   untouched.
4. ``finish()`` (from ``finish_weight_update``): the commit. A layerwise reload
   session lands every staged tensor in order (planned ones by one copy into
   the served tensor) and processes each reloaded layer, then the shadow
   layers are copied and swapped in, all inside this one call, so no engine
   step runs between the first and the last layer. After a commit the
   staging buffers go back to the worker's ``staging_pool.StagingPool``,
   which hands them to the next update's tensors of the same shape, so a
   sync does not fault in fresh memory; after a failure they are freed.
   ``abort(reason)`` before the commit stops the background work and drops
   the staging: the served weights were never touched. A failure inside the
   commit is handled like an in-place failure (layers that did not complete
   go back; the worker engine fences because the commit had begun).

Deadline: ``timeout_s`` bounds the gap between two calls, as for the in-place
session; past it the update is aborted (staging dropped) and the call raises
``TimeoutError``.

What staging costs: every byte this worker keeps of what it receives, in the
dtype it arrives in, once (``staged_bytes``); the pool keeps that much
reserved between committed updates. For ``sharded_rdt`` that is
exactly the bytes of this worker's pull plan. For ``ipc``, whose workers
receive whole tensors, it is the planned slices of the names a planned
landing copies directly (the worker's TP shard of them), the worker's shard of
each layer processed in a shadow (in its processed form), and every other
tensor whole, since the layerwise reload slices those when it loads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

import torch

from vllm.distributed.weight_transfer.landing.completeness import FusedGroups
from vllm.distributed.weight_transfer.landing.layerwise import (
    DirectLanding,
    LayerwiseReloadSession,
)
from vllm.distributed.weight_transfer.landing.update_calls import (
    CalledSession,
    UpdateCalls,
)
from vllm.distributed.weight_transfer.worker.shadows import ShadowLayers
from vllm.distributed.weight_transfer.worker.staging_pool import (
    StagingPool,
    buffer_kind,
    served_tensors,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

StagingWhere = Literal["device", "host"]

# How long ``abort`` waits for stopped background work.
_STOP_JOIN_S = 30.0

# Staging may take at most this share of the memory free when it is reserved;
# the rest is left for the engine's own allocations while it keeps serving.
FREE_MEMORY_SHARE = 0.9


class StagedDirectLanding(DirectLanding, Protocol):
    """A direct landing whose pieces can be staged: ``slices`` cuts what this
    worker keeps of a tensor, ``land_slices`` copies such pieces into the
    served tensors at the commit."""

    def slices(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    def land_slices(self, name: str, pieces: Sequence[torch.Tensor]) -> None: ...

    def still_bound(self) -> bool: ...


class ServedTensorsReplaced(RuntimeError):
    """A served tensor that a staged update's commit would write through a
    view bound while staging was replaced since (a reload, an offload,
    ``param.data = ...``): the update is dropped before anything is written."""


class StagingDoesNotFit(MemoryError):
    """The staging an update needs exceeds the memory this worker has free."""


def free_bytes(device: torch.device) -> int:
    """Bytes free for new tensors on ``device`` (host memory for CPU): on
    CUDA also what PyTorch's caching allocator holds unused, such as the
    previous update's staging."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device
        )
        return int(free + max(cached, 0))
    import psutil

    return int(psutil.virtual_memory().available)


def reserved_later(device: torch.device, cache_config: Any) -> int:
    """Bytes vLLM will still take on ``device`` after the weights loaded: the
    KV cache and its working memory, from the engine's memory budget
    (``kv_cache_memory_bytes`` when set, else ``gpu_memory_utilization`` of
    the device, less what the process uses already; on vLLM CPU the same
    setting counts host memory). Host memory next to a GPU: nothing.

    vLLM sizes the KV cache only later, when the worker profiles its memory,
    so there is nothing to ask at engine creation: this restates that
    sizing (on vLLM CPU, the requested share less the process's RSS) and
    would drift from it if a later vLLM sized the cache differently."""
    if cache_config is None:
        return 0
    explicit = getattr(cache_config, "kv_cache_memory_bytes", None)
    if explicit is not None:
        return int(explicit)
    utilization = getattr(cache_config, "gpu_memory_utilization", None)
    if utilization is None:
        return 0
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        used = torch.cuda.memory_reserved(device)
    else:
        import psutil

        total = psutil.virtual_memory().total
        used = psutil.Process().memory_info().rss
    return max(0, int(utilization * total) - int(used))


def check_staging_fits_at_start(
    where: StagingWhere,
    model: torch.nn.Module,
    model_device: torch.device,
    cache_config: Any,
    free_memory: Callable[[torch.device], int] | None = None,
) -> int:
    """Refuse to start a worker engine with staging that cannot hold even
    one copy of the weights this worker serves (the least any update
    stages) next to what vLLM still reserves; returns that copy's bytes.

    Called once, when the worker engine is created: after the weights
    loaded, before the KV cache is allocated, so the KV cache's share is
    subtracted from what is free (``reserved_later``)."""
    device = staging_device(where, model_device)
    needed = sum(t.numel() * t.element_size() for t in served_tensors(model))
    free = (free_memory or free_bytes)(device)
    later = reserved_later(device, cache_config) if device == model_device else 0
    left = free - later
    if needed > FREE_MEMORY_SHARE * left:
        raise StagingDoesNotFit(
            f"staging={where!r} keeps up to one copy of the weights this worker "
            f"serves ({_gib(needed)}) on {device} while an update is staged, but "
            f"{_gib(free)} is free there now and vLLM will still take "
            f"{_gib(later)} of it for the KV cache (staging may use "
            f"{FREE_MEMORY_SHARE:.0%} of the rest). Lower --gpu-memory-utilization "
            "or --kv-cache-memory-bytes, use more tensor parallelism (a smaller "
            "shard per worker), choose staging='host' (on a GPU), or set "
            "staging='off' and pause generation during updates"
        )
    return needed


def staging_device(where: StagingWhere, model_device: torch.device) -> torch.device:
    """Where staged tensors live: the model's device, or host memory."""
    return model_device if where == "device" else torch.device("cpu")


Land = Callable[[LayerwiseReloadSession], None]


class StagedUpdate(CalledSession):
    """Stage one update, then commit it; see the module docstring."""

    session_noun = "staged update"

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        *,
        where: StagingWhere,
        model_device: torch.device,
        timeout_s: float | None = None,
        free_memory: Callable[[torch.device], int] | None = None,
        process_while_staging: bool | None = None,
        pool: StagingPool | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.where = where
        self.device = staging_device(where, model_device)
        # The deadline between calls, the names received, the abort reason.
        self._calls = UpdateCalls(
            timeout_s,
            noun="staged weight update",
            aborted_note="the served weights are unchanged",
        )
        # How many bytes are free on a device (``free_bytes`` by default).
        self._free_memory = free_memory
        self.model_device = model_device
        self._pin = where == "host" and model_device.type == "cuda"
        # Staging buffers kept from the worker's last committed update
        # (``staging_pool``); a pool of this update's own when none is given.
        self.pool = pool if pool is not None else StagingPool()
        self.staged_bytes = 0
        self._open = False
        self._prepared = False
        self._lands: list[Land] = []
        # What the commit writes through views bound to the served tensors
        # while staging: per bound object, its check and what it is.
        self._bindings: dict[int, tuple[Callable[[], bool], str]] = {}
        self._committing: LayerwiseReloadSession | None = None
        # Work running on a thread while the engine serves, and its stop flag.
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._background_error: BaseException | None = None
        # Layers loaded and processed while staging (``shadow_layers``); by
        # default on vLLM CPU, where staging and the model share host memory.
        if process_while_staging is None:
            process_while_staging = model_device.type == "cpu"
        self._shadow = ShadowLayers(model) if process_while_staging else None
        # Names staged whole for the reload at the commit (this update).
        self._reload_names = 0
        # What the last commit did: layers swapped in from their shadows and
        # tensors landed through the reload (kept after the commit).
        self.committed: dict[str, int] = {}

    # -- state the worker engine reads ----------------------------------------

    @property
    def prepared(self) -> bool:
        """Whether ``prepare`` passed: no more weights may join the update."""
        return self._prepared

    def _busy(self) -> bool:
        # A pull running on a thread is the update's work, not a silent
        # trainer.
        return self._background is not None and self._background[0].is_alive()

    # -- staging ------------------------------------------------------------------

    def expect(self, nbytes: int, what: str, *, reuse_counts: bool = True) -> None:
        """Refuse now if ``nbytes`` more staging will not fit (called with the
        whole update's size when it is known up front). With ``reuse_counts``
        the buffers the pool kept from the last update count as memory this
        update can use (its shapes repeat); when that is not enough, or for
        a tensor no kept buffer fits, the kept buffers are let go before the
        update is refused."""
        free = (self._free_memory or free_bytes)(self.device)
        reusable = self.pool.reusable_bytes if reuse_counts else 0
        if nbytes - reusable <= FREE_MEMORY_SHARE * free:
            return
        if self.pool.reusable_bytes:
            # Count again without the kept buffers, against what letting
            # them go frees.
            self.pool.release_reusable()
            free = (self._free_memory or free_bytes)(self.device)
        if nbytes > FREE_MEMORY_SHARE * free:
            raise StagingDoesNotFit(
                f"{what} needs {_gib(nbytes)} of staging on {self.device} "
                f"({self.where!r}) beyond the {_gib(self.staged_bytes)} staged so "
                f"far, but only {_gib(free)} is free (staging may take "
                f"{FREE_MEMORY_SHARE:.0%} of it). Free memory, choose "
                "staging='host' (or 'device'), or set staging='off' and pause "
                "generation during updates"
            )

    def stage(self, data: torch.Tensor, what: str = "a tensor") -> torch.Tensor:
        """A copy of ``data`` in staging, counted against free memory."""
        self._check_open("stage")
        nbytes = data.numel() * data.element_size()
        kind = buffer_kind(data.shape, data.dtype, self.device, self._pin)
        copy = self.pool.take(kind)
        if copy is None:
            # No kept buffer fits this tensor: it needs memory of its own.
            self.expect(nbytes, what, reuse_counts=False)
            copy = self.pool.allocate(kind)
        copy.copy_(data)
        if data.is_cuda or copy.is_cuda:
            # The caller reuses ``data`` (a receive buffer) once this returns,
            # and RDMA writes into it do not wait for queued device work.
            torch.cuda.current_stream(
                data.device if data.is_cuda else copy.device
            ).synchronize()
        self.staged_bytes += nbytes
        return copy

    def defer(self, land: Land) -> None:
        """Run ``land(session)`` at the commit, in the order deferred."""
        self._check_open("defer")
        self._lands.append(land)

    def relies_on(self, still_bound: Callable[[], bool], what: str) -> None:
        """Note that the commit writes through views of the served tensors
        bound now (``what``: a planned landing, say): ``still_bound()`` must
        hold at prepare and again right before the commit's first write, or
        the update is dropped (``check_bound``)."""
        self._check_open("relies_on")
        owner = getattr(still_bound, "__self__", still_bound)
        self._bindings[id(owner)] = (still_bound, what)

    def check_bound(self, what: str) -> None:
        """Raise ``ServedTensorsReplaced`` when a served tensor the commit
        would write was replaced since it was bound (by a planned landing or
        a shadow layer); nothing is written either way, so the caller drops
        the update with the old weights serving."""
        stale = [name for check, name in self._bindings.values() if not check()]
        if self._shadow is not None and not self._shadow.still_bound():
            stale.append("the layers processed in shadows")
        if stale:
            raise ServedTensorsReplaced(
                f"{what}: the served tensors that {' and '.join(stale)} would "
                "write were replaced after this update was staged (a reload, an "
                "offload or param.data = ...); committing would write the old "
                "tensors, so the update is dropped and the old weights keep "
                "serving; send it again"
            )

    def receive_names(self, names: Iterable[str]) -> None:
        """Note names of this update; a name received twice is refused."""
        self._calls.received |= self._calls.new_names(names)

    def load(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        foreign_storages: set[int] | None = None,
    ) -> None:
        """Stage checkpoint-format tensors by name (the ``ipc`` path). Tensors
        of layers that can be processed apart from the served ones load into
        their shadow layers now (each layer is processed once all its tensors
        arrived); the others are copied into staging and reload at the commit.
        Nothing kept refers to ``foreign_storages``."""
        del foreign_storages  # shadows and staging hold copies only
        self._check_open("load()")
        self.check_deadline("load()")
        weights = list(weights)
        self.receive_names(name for name, _ in weights)
        shadow = self._shadow
        if shadow is not None:
            early = [w for w in weights if shadow.takes(w[0])]
            if early:
                weights = [w for w in weights if not shadow.takes(w[0])]
                nbytes = sum(t.numel() * t.element_size() for _, t in early)
                self.expect(nbytes, "the layers processed while staging")
                held = shadow.bytes_held
                shadow.load(early)
                self.staged_bytes += shadow.bytes_held - held
        if weights:
            staged = [(name, self.stage(tensor, name)) for name, tensor in weights]
            self._reload_names += len(staged)
            self.defer(lambda session: session.load(staged))

    @property
    def layers_processed_while_staging(self) -> int:
        """Layers of this update already loaded and processed in their shadows,
        which the commit only copies and swaps in."""
        return 0 if self._shadow is None else self._shadow.layers_processed

    def load_planned(
        self, landing: StagedDirectLanding, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Stage tensors that ``landing`` copies straight into the served
        tensors (direct names of a ``planned_landing.LandingPlan``, or
        trainer-side FP8 codes of a ``codes_landing.CodesLanding``): only the
        slices this worker keeps (its TP shard) are staged, and the commit
        copies each into its place, not through the reload."""
        self._check_open("load_planned()")
        self.check_deadline("load_planned()")
        self.relies_on(landing.still_bound, type(landing).__name__)
        weights = list(weights)
        self.receive_names(name for name, _ in weights)
        staged = [
            (name, [self.stage(piece, name) for piece in landing.slices(name, tensor)])
            for name, tensor in weights
        ]
        names = [name for name, _ in staged]

        def land_all() -> None:
            for name, pieces in staged:
                landing.land_slices(name, pieces)

        self.defer(
            lambda session: session.land_bound(
                landing, names, land_all, "the commit's planned landing"
            )
        )

    def in_background(self, work: Callable[[threading.Event], None], name: str) -> None:
        """Run ``work(stop)`` on a thread while the engine keeps serving.
        ``work`` must return soon after ``stop`` is set and bound its own
        waits; ``prepare`` waits for it and re-raises its failure, ``abort``
        stops it. The deadline counts from the moment it ends."""
        self._check_open("in_background")
        if self._background is not None:
            raise RuntimeError("this staged update already runs background work")
        stop = threading.Event()

        def run() -> None:
            try:
                work(stop)
            except BaseException as e:
                self._background_error = e
            finally:
                self._calls.note_call()

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._background = (thread, stop)
        thread.start()

    # -- commit ------------------------------------------------------------------

    def prepare(self) -> None:
        """Wait for the background work, then name-level checks before the
        commit; the model is not touched."""
        self._check_open("prepare")
        self._join_background(stop=False)
        self.check_deadline("prepare")
        if self._calls.received:
            groups = FusedGroups.of(
                self.model, getattr(self.model_config, "hf_config", None)
            )
            groups.check(self._calls.received)
        if self._shadow is not None:
            self._shadow.check()
        self.check_bound("prepare")
        self._prepared = True

    def finish(self) -> None:
        """Commit: land every staged tensor into the model in this one call."""
        self._check_open("finish()")
        if not self._prepared:
            self.prepare()
        self._join_background(stop=False)
        self.committed = {
            "shadow_layers": self.layers_processed_while_staging,
            "tensors_reloaded": self._reload_names,
        }
        committed = False
        try:
            if self._lands:
                session = LayerwiseReloadSession(self.model, self.model_config)
                session.start()
                self._committing = session
                try:
                    # Each landing step is dropped once it ran (its staged
                    # tensors stay in the pool for the next update).
                    lands, self._lands = self._lands, []
                    while lands:
                        lands.pop(0)(session)
                    session.finish()
                except BaseException as e:
                    session.abort(f"the commit failed: {type(e).__name__}: {e}")
                    raise
                # Nothing of the reload may keep staged tensors alive once the
                # staging goes back to the pool.
                del session
            if self._shadow is not None:
                # Checked at prepare: copies of equal shapes and attribute sets.
                self._shadow.commit()
            committed = True
        finally:
            self._committing = None
            self._release(keep_staging=committed)
            self._open = False

    def abort(self, reason: str = "the update was aborted") -> None:
        """Drop the staging; the served weights were not touched."""
        if not self._open:
            return
        self._calls.aborted_reason = reason
        self._join_background(stop=True)
        if self._committing is not None:
            self._committing.abort(reason)
        dropped = self.staged_bytes
        self._release(keep_staging=False)
        self._open = False
        logger.warning(
            "Staged weight update aborted (%s); %s of staging dropped, the served "
            "weights are unchanged",
            reason,
            _gib(dropped),
        )

    # -- internals -------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(self.closed_message(what))

    def _join_background(self, *, stop: bool) -> None:
        """Wait for the background work (stopping it first when ``stop``);
        re-raise its failure unless it was stopped."""
        if self._background is None:
            return
        thread, flag = self._background
        if stop:
            flag.set()
        thread.join(None if not stop else _STOP_JOIN_S)
        if thread.is_alive():
            logger.warning(
                "staged update: %s did not stop within %.0f s; its staging is "
                "dropped anyway",
                thread.name,
                _STOP_JOIN_S,
            )
        self._background = None
        error, self._background_error = self._background_error, None
        if error is not None and not stop:
            raise error

    def _release(self, *, keep_staging: bool) -> None:
        """Let go of this update's staging: kept in the pool for the next
        update after a commit (``keep_staging``), freed otherwise."""
        self._lands = []
        if keep_staging:
            if self.device.type == "cuda" or self._pin:
                # The commit's copies out of staging may still be queued on
                # the device; the next update writes these buffers again,
                # maybe from another thread's stream.
                torch.cuda.current_stream(self.model_device).synchronize()
            self.pool.end_update(served_tensors(self.model))
        else:
            self.pool.drop()
        self._bindings = {}
        self._reload_names = 0
        if self._shadow is not None:
            self._shadow.close()
        self._calls.received = set()
        self._prepared = False
        self.staged_bytes = 0
        if self._pin and hasattr(torch._C, "_host_emptyCache"):
            # Pinned staging stays in PyTorch's host cache otherwise.
            torch._C._host_emptyCache()


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"
