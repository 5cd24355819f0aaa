# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sharded_rdt worker's pull loop: a background thread pulls every chunk in
order, at most one per receive buffer ahead, while the calling thread lands
each one as it arrives. With deltas on, each pull is handed the chunk's bytes
as the worker last landed them (``held``: a copy, or the served tensors that
hold them), which a delta the producer offers applies to."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.pull.chunks import PullChunk
from vllm.distributed.weight_transfer.pull.delta_bases import (
    HeldBases,
    KeptBytes,
    ServedBytes,
)
from vllm.distributed.weight_transfer.pull.transport import ProducerLink, Pulled
from vllm.logger import init_logger

logger = init_logger(__name__)

# Lands chunk ``index``: (index, data, what its pull brought, timing) -> None.
LandChunk = Callable[[int, torch.Tensor, Pulled, dict[str, float]], None]


@dataclass
class DeltaCounts:
    """One sync's pulls seen as deltas: bytes read from the producers, the
    chunks that arrived as deltas (and of those, the ones written straight
    into the served tensors), and those whose offered delta was refused
    (the whole chunk was read instead; the first reason is kept and logged)."""

    read_bytes: int = 0
    applied: int = 0
    in_place: int = 0
    refused: int = 0
    first_refusal: str | None = None

    def count(self, result: Pulled, what: str) -> None:
        self.read_bytes += result.read_bytes
        if result.delta == "applied":
            self.applied += 1
            self.in_place += result.in_place is not None
        elif result.delta is not None:
            self.refused += 1
            if self.first_refusal is None:
                self.first_refusal = f"{what}: {result.delta}"
                logger.warning(
                    "sharded_rdt: a delta was refused and the whole chunk "
                    "pulled instead (%s)",
                    self.first_refusal,
                )

    def as_receipt(self, held: HeldBases | None) -> dict[str, Any]:
        return {
            "read_bytes": self.read_bytes,
            "delta_chunks": self.applied,
            "delta_in_place": self.in_place,
            "delta_refused": self.refused,
            "delta_first_refusal": self.first_refusal,
            "delta_bases_bytes": held.used_bytes if held is not None else 0,
            "delta_served_bases": held.served_chunks if held is not None else 0,
        }


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def run_pulls(
    chunks: Sequence[PullChunk],
    links: Sequence[ProducerLink],
    buffers: Sequence[torch.Tensor],
    land: LandChunk,
    *,
    consumer_id: int | None,
    stall_timeout_s: float,
    cancel: threading.Event | None = None,
    held: Callable[[int], KeptBytes | ServedBytes | None] | None = None,
    keep: Callable[[int, torch.Tensor], None] | None = None,
) -> tuple[dict[int, int], dict[str, float]]:
    """Pull every chunk in order on a background thread, at most one per
    receive buffer ahead, and ``land`` each one here as it arrives. Returns
    the payload bytes landed per producer, and the seconds spent pulling and
    landing. ``cancel`` set: stop within half a second, raising
    ``RuntimeError``. ``held(index)``: chunk ``index``'s bytes as last landed
    (a delta's base), or None; ``keep(index, data)``: called on the pulling
    thread with each pulled chunk's bytes (the next base), while the
    previous chunk lands."""
    pulled: dict[int, int] = {}
    timing = {"pull": 0.0, "land": 0.0}
    if not chunks:
        return pulled, timing
    # Each chunk's successor from the same producer, requested early.
    following: list[Any] = [None] * len(chunks)
    last_of: dict[int, int] = {}
    for i, chunk in enumerate(chunks):
        if chunk.producer in last_of:
            following[last_of[chunk.producer]] = chunk
        last_of[chunk.producer] = i
    free = threading.Semaphore(len(buffers))
    # A device buffer's landing is queued on the device: before a pull
    # writes into the buffer again (RDMA does not wait for queued device
    # work), the puller waits for the event recorded after that landing.
    landed: list[Any] = [None] * len(buffers)
    ready: queue.Queue[tuple[int, torch.Tensor, Pulled] | _Failed] = queue.Queue()
    stop = threading.Event()

    def puller() -> None:
        try:
            for i, chunk in enumerate(chunks):
                while not free.acquire(timeout=0.5):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                slot = i % len(buffers)
                if landed[slot] is not None:
                    landed[slot].synchronize()
                    landed[slot] = None
                into = buffers[slot][: chunk.nbytes]
                t0 = time.perf_counter()
                base = held(i) if held is not None else None
                result = links[chunk.producer].pull(chunk, into, following[i], base)
                if keep is not None:
                    keep(i, into)
                timing["pull"] += time.perf_counter() - t0
                ready.put((i, into, result))
        except BaseException as e:
            ready.put(_Failed(e))

    thread = threading.Thread(target=puller, name="sharded-rdt-pull", daemon=True)
    thread.start()
    try:
        for _ in chunks:
            item = _next_chunk(ready, cancel, consumer_id, stall_timeout_s)
            if isinstance(item, _Failed):
                raise item.error
            i, data, result = item
            land(i, data, result, timing)
            pulled[chunks[i].producer] = (
                pulled.get(chunks[i].producer, 0) + chunks[i].payload_bytes
            )
            if data.is_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(data.device))
                landed[i % len(buffers)] = event
            free.release()
    finally:
        stop.set()
        thread.join(timeout=1.0)
    return pulled, timing


def _next_chunk(
    ready: queue.Queue[Any],
    cancel: threading.Event | None,
    consumer_id: int | None,
    stall_timeout_s: float,
) -> Any:
    """The next pulled chunk, within the stall timeout, unless cancelled."""
    deadline = time.monotonic() + stall_timeout_s
    while True:
        if cancel is not None and cancel.is_set():
            raise RuntimeError(
                f"sharded_rdt consumer {consumer_id}: the staged pull "
                "was cancelled (the update was aborted)"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"sharded_rdt consumer {consumer_id}: no chunk arrived "
                f"for {stall_timeout_s:.1f}s; a producer most likely "
                "died or stalled"
            )
        try:
            return ready.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
