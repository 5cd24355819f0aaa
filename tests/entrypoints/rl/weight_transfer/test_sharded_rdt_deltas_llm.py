# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt delta syncs end to end on vLLM CPU over NIXL: a Ray trainer
with ``delta_bases_gb`` set serves an offline ``LLM``; after the first sync
each chunk whose changed elements encode smaller than the chunk travels as a
delta against what the worker landed, and after every sync vLLM serves bit
for bit what a fresh vLLM load of the trainer's weights serves.

Two engines, shared by every test here (each start costs tens of seconds):
dense Qwen3 TP=1 landing planned (plain CPU linear), staging off, whose
worker keeps no copy of what it landed: every chunk lands straight in
served tensors, and a delta's base is read back from there; and
Qwen3-MoE TP=2 landing planned with host staging, whose layer chunks hold
experts (reloaded, so kept as copies) while the others are read back from
the served tensors (the committed bytes, during a staged pull), and whose
deltas land in staging and reach the served tensors at the commit.

What a worker holds is checked, never trusted: one re-initialized (its held
bytes gone), one that missed a sync, one whose served byte was flipped out of
band, and deltas with any spoiled field each end exact, through whole chunks
where the delta does not apply, and never fence the engine."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    build_tiny_model,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    assert_serves_trainer,
)
from vllm.distributed.weight_transfer.testing.tiny_models import Architecture

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
pytest.importorskip("nixl")

DELTA_GB = 1.0
# The fraction of elements each trainer step moves (`TrainerRank.nudge`).
CHANGED = 0.01
# A norm weight: served as the checkpoint's bytes by both engines.
NORM = "model.layers.0.input_layernorm.weight"


# (arch, TP, WeightTransferConfig options): the engines every test here shares.
ENGINES: dict[str, tuple[Architecture, int, dict[str, Any]]] = {
    "dense-tp1-planned": ("qwen3", 1, {"landing": "planned", "cpu_linear": "plain"}),
    "moe-tp2-planned-staged": (
        "qwen3_moe",
        2,
        {"landing": "planned", "cpu_linear": "plain", "staging": "host"},
    ),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, ray_cluster):
    """One engine at a time: pytest runs every test on the first, stops it,
    then runs them on the second."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        stop_llm_host,
    )

    arch, tp, options = ENGINES[request.param]
    model_dir = str(build_tiny_model(TinyModelSpec(arch=arch)))
    config = WeightTransferConfig(backend="sharded_rdt", **options)
    llm = ray.remote(num_cpus=0)(LLMHost).remote(
        model_dir, tp=tp, weight_transfer_config=config
    )
    ray.get(llm.pids.remote())  # wait until the engine is up
    yield llm, model_dir, tp
    stop_llm_host(llm)


def _dense_only(engine) -> None:
    if engine[2] != 1:
        pytest.skip("the worker-side cases need one engine: dense TP=1")


@contextlib.contextmanager
def _trainer(engine, pool) -> Iterator:
    """One trainer rank with deltas on, initialized against ``engine``."""
    llm, model_dir, tp = engine
    with pool.lend(model_dir) as (rank,):
        ray.get(
            rank.init.remote(
                llm, num_consumers=tp, stall_timeout_s=20.0, delta_bases_gb=DELTA_GB
            )
        )
        yield rank


def _committed(llm) -> bool:
    return all(s["state"] == "committed" for s in ray.get(llm.fence_status.remote()))


def _synced(llm, rank, send=None) -> list[dict]:
    """Run ``send`` (default: a plain sync), check the oracle and that the
    engine committed; each worker's receipt."""
    ray.get(send if send is not None else rank.send.remote(), timeout=180)
    assert_serves_trainer(llm, rank)
    assert _committed(llm), ray.get(llm.fence_status.remote())
    return ray.get(llm.receipts.remote())


def _first_sync(llm, rank, seed: int = 11) -> list[dict]:
    """A sync of freshly randomized weights: every chunk travels whole."""
    ray.get(rank.randomize.remote(seed))
    receipts = _synced(llm, rank)
    for r in receipts:
        assert r["delta_chunks"] == 0 and r["delta_refused"] == 0, r
        assert r["read_bytes"] >= r["planned_bytes"], r  # padding too
    return receipts


def _assert_deltas(receipts: list[dict]) -> None:
    """Every worker applied deltas and read a fraction of its bytes."""
    for r in receipts:
        assert r["delta_chunks"] > 0, r
        assert r["delta_refused"] == 0, r
        assert r["bytes"] == r["planned_bytes"]
        # 1% of fp32 elements changed: 8 bytes each against 4 whole.
        assert r["read_bytes"] < 0.1 * r["planned_bytes"], r


def test_delta_syncs_move_only_changed_bytes_and_serve_the_trainers_weights(
    engine, trainer_pool
):
    llm, _, tp = engine
    with _trainer(engine, trainer_pool) as rank:
        assert len(_first_sync(llm, rank)) == tp
        for step in range(2):
            ray.get(rank.nudge.remote(step, CHANGED))
            receipts = _synced(llm, rank)
            _assert_deltas(receipts)
        for r in receipts:
            if tp == 1:
                # Every module of the dense engine lands straight in its
                # served tensors: each chunk's base is checked there, the
                # delta written there, and the worker keeps no copy at all.
                assert r["delta_served_bases"] == r["chunks"], r
                assert r["delta_in_place"] == r["delta_chunks"] == r["chunks"], r
                assert r["delta_bases_bytes"] == 0, r
            else:
                # The MoE engine (staged): the chunks with reloaded experts
                # are kept as copies, the others read back, and every delta
                # is rebuilt in the receive buffer and staged.
                assert 0 < r["delta_served_bases"] < r["chunks"], r
                assert 0 < r["delta_bases_bytes"] < r["planned_bytes"], r
                assert r["delta_in_place"] == 0, r


def test_a_reinitialized_worker_reads_whole_chunks_then_deltas_again(
    engine, trainer_pool
):
    _dense_only(engine)
    llm, _, _ = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        ray.get(rank.nudge.remote(1, CHANGED))
        _assert_deltas(_synced(llm, rank))
        # A restarted worker: init again, what it held is gone. The producer
        # still offers deltas; the worker has nothing to apply them to.
        ray.get(rank.reinit_workers.remote())
        ray.get(rank.nudge.remote(2, CHANGED))
        (whole,) = _synced(llm, rank)
        assert whole["delta_chunks"] == whole["delta_refused"] == 0, whole
        assert whole["read_bytes"] >= whole["planned_bytes"], whole
        ray.get(rank.nudge.remote(3, CHANGED))
        _assert_deltas(_synced(llm, rank))


def test_a_worker_that_missed_a_sync_ends_exact(engine, trainer_pool):
    """All TP workers of an engine take every sync together, so the worker
    misses one whole: the trainer syncs with no live consumer and the engine
    is never told. The producer packed nothing for the worker then, so the
    bytes it kept are still the worker's: the next sync's deltas (two steps'
    changes) apply to them."""
    _dense_only(engine)
    llm, _, _ = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        ray.get(rank.nudge.remote(4, CHANGED))
        ray.get(rank.send_missed.remote(), timeout=120)
        ray.get(rank.nudge.remote(5, CHANGED))
        (receipt,) = _synced(llm, rank)
        assert receipt["delta_chunks"] > 0 and receipt["delta_refused"] == 0, receipt


def test_a_served_byte_flipped_out_of_band_is_overwritten_by_the_next_sync(
    engine, trainer_pool
):
    """Every chunk lands whole, whatever it was rebuilt from, so a served byte
    changed out of band is overwritten by the next delta sync. Where the
    worker keeps a copy of the chunk (the MoE engine: the norm shares its
    chunk with reloaded experts) the delta applies to the copy; where it
    reads the chunk back from the served tensors (the dense engine), the
    flipped byte fails the delta's base checksum and the chunk is read
    whole."""
    llm, _, tp = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        before = ray.get(llm.served_bytes.remote(NORM))
        ray.get(llm.flip_served_byte.remote(NORM, 1))
        flipped = ray.get(llm.served_bytes.remote(NORM))
        for old, new in zip(before, flipped, strict=True):
            assert int((old != new).sum()) == 1
        ray.get(rank.nudge.remote(6, CHANGED))
        receipts = _synced(llm, rank)
        if tp == 1:
            (r,) = receipts
            assert r["delta_refused"] == 1 and r["delta_chunks"] > 0, r
            assert "delta.base_digest" in r["delta_first_refusal"], r
        else:
            _assert_deltas(receipts)
        trainer = ray.get(rank.param_bytes.remote(NORM))
        for served in ray.get(llm.served_bytes.remote(NORM)):
            assert served.equal(trainer)


# Each spoiled field and what the worker's refusal names (a regex).
BAD_FIELDS = {
    "base_version": "delta.base_version",
    "base_digest": "delta.base_digest",
    "nbytes": "delta.nbytes",
    "unit": "delta.unit",
    "count": "delta.count",
    "positions_dtype": "delta.positions_dtype",
    "values_offset": "delta.values_offset",
    "buffer_nbytes": "delta.buffer_nbytes",
    "format": "delta.format",
    "reply_nbytes": "partial or overlong",
}


def test_every_spoiled_delta_field_is_refused_unfenced_and_the_sync_ends_exact(
    engine, trainer_pool
):
    """One sync per spoiled field on one trainer (`send_with_bad_delta`): the
    worker refuses every delta, reads each chunk whole, and the sync commits
    exact; the receipt names the field. A clean sync after them deltas
    again."""
    _dense_only(engine)
    llm, _, _ = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        for step, (field, word) in enumerate(BAD_FIELDS.items()):
            ray.get(rank.nudge.remote(100 + step, CHANGED))
            (r,) = _synced(llm, rank, rank.send_with_bad_delta.remote(field))
            assert r["delta_chunks"] == 0 and r["delta_refused"] > 0, (field, r)
            assert re.search(word, r["delta_first_refusal"]), (field, r)
            assert r["read_bytes"] >= r["planned_bytes"], (field, r)
        ray.get(rank.nudge.remote(99, CHANGED))
        _assert_deltas(_synced(llm, rank))


def test_a_worker_failing_after_deltas_were_written_in_place_is_fenced(
    engine, trainer_pool
):
    """The dense engine writes each delta straight into its served tensors:
    a worker that fails landing chunk 1, after chunk 0's delta was written
    there, is fenced (its served weights are neither the old nor the new
    ones) and keeps serving; the chunks the failed sync pulled are no bases,
    so the next sync reads them whole and commits exact, and the one after
    writes deltas in place again."""
    _dense_only(engine)
    llm, _, _ = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        ray.get(rank.nudge.remote(9, CHANGED))
        ray.get(llm.fail_on_chunk.remote(1))
        error = ray.get(rank.send_expecting_failure.remote(), timeout=180)
        assert "injected worker failure at chunk 1" in error
        assert [s["state"] for s in ray.get(llm.fence_status.remote())] == ["fenced"]
        ray.get(llm.greedy.remote())  # the engine keeps serving
        ray.get(rank.nudge.remote(10, CHANGED))
        (r,) = _synced(llm, rank)
        # (Here every chunk was pulled before the failure stopped the pulls:
        # all are read whole.)
        assert r["delta_in_place"] == r["delta_chunks"] < r["chunks"], r
        ray.get(rank.nudge.remote(11, CHANGED))
        (r,) = _synced(llm, rank)
        assert r["delta_in_place"] == r["delta_chunks"] == r["chunks"], r


def test_a_trainer_failing_mid_delta_sync_is_followed_by_an_exact_one(
    engine, trainer_pool
):
    """The failed sync's landed chunks were pending, never bases: the next
    sync reads those whole and the rest as deltas."""
    llm, _, _ = engine
    with _trainer(engine, trainer_pool) as rank:
        _first_sync(llm, rank)
        ray.get(rank.nudge.remote(7, CHANGED))
        # Slowly: the worker lands the first group's chunk well before the
        # source fails in a later group.
        error = ray.get(rank.send_failing.remote(after=8, delay_s=0.25), timeout=180)
        assert "injected trainer failure" in error
        ray.get(llm.greedy.remote())  # the engine keeps serving
        ray.get(rank.nudge.remote(8, CHANGED))
        for r in _synced(llm, rank):
            # The chunks landed before the failure were read whole (on the
            # worker they were never bases; on the producer they were).
            assert 0 < r["delta_chunks"] < r["chunks"], r
            assert r["read_bytes"] < r["planned_bytes"], r
