# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sharded_rdt end to end on vLLM CPU: a Ray trainer (one rank, or two ranks
each holding half of the gather groups) serves an offline ``LLM`` running the
default executor; the workers pull their slices over direct NIXL agents on
loopback. After every sync, vLLM serves bit for bit what a fresh vLLM load of
the trainer's weights serves, its greedy tokens and logprobs equal a Hugging
Face forward pass of them, and each worker pulled exactly the
bytes its plan names.

Verified publication on the dense TP=1 engine: a byte flipped in transit is
caught with checksums on, a manifest that contradicts the served model is
refused before any weight changes, a worker failing mid-update is fenced until
a full resync, and the served version changes only once every receipt verified.
It also takes delta syncs, whose bases are the host copies its worker keeps
(the reload lands nothing straight in served tensors).

The MoE TP=2 engine lands planned (``landing="planned"`` with plain CPU
linear layers): every pulled byte of a layer whose processing keeps it goes
straight from the receive buffer into the served tensor, and only the MoE
experts are rebuilt by the layerwise reload, in the same sync.

Staged updates (``staging="host"``) run on three more engines: dense and MoE
TP=1 committing through the layerwise reload, and MoE TP=2 landing planned,
whose commit copies the planned slices from staging and reloads only the
experts.

One engine per (model, TP) combination, shared by the tests of that
combination; each test pushes the state it checks.
"""

from __future__ import annotations

import copy

import pytest

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_bit_identical,
    assert_same_greedy,
    build_tiny_model,
    logprob_atol,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    assert_serves_trainer,
)

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
pytest.importorskip("nixl")

# Dense TP=2 runs under `vllm serve` in test_sharded_rdt_http.py; MoE at TP=1
# lands through the same planner, whose plans test_planner_real_models.py
# checks against load_weights bit for bit at TP=1 and TP=2. The third entry
# is WeightTransferConfig.landing (planned engines run plain CPU linear
# layers, the only ones that keep their bytes on vLLM CPU).
COMBOS = [("qwen3", 1, "reload"), ("qwen3_moe", 2, "planned")]


@pytest.fixture(
    scope="module",
    params=COMBOS,
    ids=[f"{a}-tp{tp}-{landing}" for a, tp, landing in COMBOS],
)
def engine(request, ray_cluster):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        stop_llm_host,
    )

    arch, tp, landing = request.param
    model_dir = str(build_tiny_model(TinyModelSpec(arch=arch)))
    config = WeightTransferConfig(
        backend="sharded_rdt",
        landing=landing,
        cpu_linear="plain" if landing == "planned" else "packed",
    )
    llm = ray.remote(num_cpus=0)(LLMHost).remote(
        model_dir, tp=tp, weight_transfer_config=config
    )
    ray.get(llm.pids.remote())  # wait until the engine is up
    yield llm, model_dir, tp
    stop_llm_host(llm)


def _sync_and_check(llm, ranks, seed: int) -> list[dict]:
    ray.get([t.randomize.remote(seed) for t in ranks])
    ray.get([t.send.remote() for t in ranks])
    assert_serves_trainer(llm, ranks[0])
    return ray.get(llm.receipts.remote())


def test_one_rank_two_successive_syncs(engine, trainer_pool):
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp))
        for seed in (101, 102):  # in-place updates between syncs
            receipts = _sync_and_check(llm, ranks, seed)
            assert len(receipts) == tp
            for r in receipts:
                assert r["transport"] == "nixl"
                assert r["bytes"] == r["planned_bytes"] > 0
                assert r["publication_id"] is not None
            assert all(
                s["state"] == "committed" for s in ray.get(llm.fence_status.remote())
            )


def test_two_ranks_each_holding_half_the_groups(engine, trainer_pool):
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 2) as ranks:
        payloads = ray.get(
            [t.init.remote(llm, num_consumers=tp, hold="half") for t in ranks]
        )
        assert len(payloads[0]["producer_endpoints"]) == 2
        assert payloads[0]["owner_sets"] == [[0], [1]]
        receipts = _sync_and_check(llm, ranks, 103)
        for r in receipts:
            assert r["bytes"] == r["planned_bytes"]
            assert set(r["bytes_by_producer"]) == {"0", "1"}
            assert all(n > 0 for n in r["bytes_by_producer"].values())


def test_a_trainer_failure_mid_sync_fails_both_sides_and_the_next_sync_recovers(
    engine, trainer_pool
):
    llm, model_dir, tp = engine
    if tp != 1 or "moe" in model_dir:
        pytest.skip("one engine (dense, TP=1) is enough for the failure path")
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0))
        ray.get(ranks[0].randomize.remote(104))
        error = ray.get(ranks[0].send_failing.remote(after=5), timeout=120)
        assert "injected trainer failure" in error
        ray.get(llm.greedy.remote())  # the engine keeps serving
        _sync_and_check(llm, ranks, 105)


def test_deltas_through_the_layerwise_reload_apply_to_kept_copies(engine, trainer_pool):
    """Deltas (``delta_bases_gb``) on the reload engine, staging off: no
    chunk lands straight in served tensors, so the worker keeps a copy of
    every chunk it landed; from the second sync each chunk travels as a delta
    against that copy, is rebuilt there and reloaded whole, and the engine
    serves the fresh-load oracle after every sync.
    (test_sharded_rdt_deltas_llm.py covers deltas on planned and staged
    engines, where the bases are read back from served tensors.)"""
    llm, model_dir, tp = engine
    if tp != 1 or "moe" in model_dir:
        pytest.skip("the reload engine (dense, TP=1) is the one keeping copies")
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(
                llm, num_consumers=tp, stall_timeout_s=20.0, delta_bases_gb=1.0
            )
        )
        (whole,) = _sync_and_check(llm, ranks, 107)
        assert whole["delta_chunks"] == 0, whole
        assert whole["delta_bases_bytes"] >= whole["planned_bytes"], whole
        for step in (1, 2):
            ray.get(ranks[0].nudge.remote(step, 0.01))
            ray.get(ranks[0].send.remote())
            assert_serves_trainer(llm, ranks[0])
            (r,) = ray.get(llm.receipts.remote())
            assert r["delta_chunks"] > 0 and r["delta_refused"] == 0, r
            assert r["delta_served_bases"] == r["delta_in_place"] == 0, r
            assert r["delta_bases_bytes"] >= r["planned_bytes"], r
            # 1% of fp32 elements changed: 8 bytes each against 4 whole.
            assert r["read_bytes"] < 0.1 * r["planned_bytes"], r


def test_planned_landing_pulls_straight_into_the_served_tensors(
    engine, request, trainer_pool
):
    """``landing="planned"``: on every TP rank each attention, dense, norm and
    embedding tensor a worker pulls goes once from its receive buffer into
    the served tensor, and only the MoE experts (which vLLM CPU repacks) are
    materialized, loaded and processed, each for the reason it names. With
    checksums on, every direct copy is read back before the receipt. Two
    syncs with in-place trainer changes serve the fresh-load oracle; a worker
    failing mid-sync, after bytes went straight into the served tensors, is
    fenced until the next full sync, which serves the trainer's weights.
    Reload engines keep no planned landing."""
    llm, model_dir, tp = engine
    if request.node.callspec.params["engine"][2] != "planned":
        assert ray.get(llm.planned_landing_state.remote()) == [{}] * tp
        return
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(
                llm, num_consumers=tp, verify_checksums=True, stall_timeout_s=20.0
            )
        )
        states = ray.get(llm.planned_landing_state.remote())
        for seed in (131, 132):
            receipts = _sync_and_check(llm, ranks, seed)
            for state, receipt in zip(states, receipts, strict=True):
                assert receipt["checksums_verified"] == receipt["chunks"] > 1
                # Only the experts were processed after landing; each chunk's
                # direct copies ran as one batched copy.
                assert receipt["modules_processed"] == len(state["reloaded"])
                assert receipt["direct_copies_batched"] > 0
        for state in ray.get(llm.planned_landing_state.remote()):
            assert state["still_bound"]
            direct = state["direct_names"]
            for kept in ("q_proj.weight", "input_layernorm.weight", "embed_tokens"):
                assert any(kept in n for n in direct), (kept, direct)
            assert state["reloaded"] and not any(".experts." in n for n in direct)
            for module, reason in state["reloaded"].items():
                assert ".experts" in module, (module, reason)

        _fail_a_sync_at_chunk_1(llm, ranks[0], 133)
        # Chunk 0 (the embedding) went straight into the served tensors.
        assert _states(llm) == ["fenced"] * tp
        ray.get(llm.greedy.remote())  # the engine keeps serving
        ray.get(ranks[0].send.remote(weight_version="step-133"))
        assert _states(llm) == ["committed"] * tp
        assert_serves_trainer(llm, ranks[0])


def _fail_a_sync_at_chunk_1(llm, rank, seed: int) -> None:
    """A sync of the trainer stepped to ``seed`` whose workers fail when
    landing chunk 1; the trainer's error names that failure."""
    ray.get(rank.randomize.remote(seed))
    ray.get(llm.fail_on_chunk.remote(1))
    error = ray.get(
        rank.send_expecting_failure.remote(weight_version=f"step-{seed}"),
        timeout=120,
    )
    assert "injected worker failure at chunk 1" in error


def _dense_tp1_only(engine) -> None:
    _, model_dir, tp = engine
    if tp != 1 or "moe" in model_dir:
        pytest.skip("one engine (dense, TP=1) is enough for verified publication")


def _states(llm) -> list[str]:
    return [s["state"] for s in ray.get(llm.fence_status.remote())]


def test_the_version_changes_only_after_every_receipt_verified(engine, trainer_pool):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp))
        before = ray.get(llm.weight_version.remote())
        ray.get(ranks[0].randomize.remote(110))
        ray.get(ranks[0].send.remote(weight_version="step-110"))
        # finish_weight_update returned with the old version still served.
        assert ray.get(llm.version_seen_at_finish.remote()) == before
        assert ray.get(llm.weight_version.remote()) == "step-110"
        assert_serves_trainer(llm, ranks[0])


def test_checksums_catch_a_byte_flipped_in_transit_and_a_resync_recovers(
    engine, trainer_pool
):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(
                llm, num_consumers=tp, verify_checksums=True, stall_timeout_s=20.0
            )
        )
        receipts = _sync_and_check(llm, ranks, 111)
        assert all(r["checksums_verified"] == r["chunks"] > 1 for r in receipts)

        ray.get(ranks[0].randomize.remote(112))
        ray.get(ranks[0].flip_byte_after_checksum.remote(seq=1))
        error = ray.get(
            ranks[0].send_expecting_failure.remote(weight_version="step-112"),
            timeout=120,
        )
        # The worker's reason names the cause in words (since 7904274 it no
        # longer carries the exception's type name, ChecksumMismatch).
        assert "chunk seq 1" in error and "checksum" in error
        assert "the bytes changed in transit" in error
        assert ray.get(llm.weight_version.remote()).startswith("fenced:")
        # Chunk 0 had landed: the engine is fenced and says how to recover.
        assert _states(llm) == ["fenced"]
        errors = ray.get(llm.engine_finish_errors.remote())
        assert errors[0] is not None and "full resync is required" in errors[0]
        ray.get(llm.greedy.remote())  # the server keeps serving

        ray.get(ranks[0].send.remote(weight_version="step-112"))
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-112"
        assert_serves_trainer(llm, ranks[0])


def test_a_manifest_mismatch_is_refused_before_any_weight_changes(engine, trainer_pool):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0))
        _sync_and_check(llm, ranks, 113)
        served = ray.get(llm.greedy.remote())
        name = ray.get(ranks[0].param_names.remote())[-1]

        ray.get(ranks[0].randomize.remote(114))
        error = ray.get(ranks[0].send_with_wrong_shape.remote(name), timeout=120)
        assert "manifest differs" in error and name in error
        assert ray.get(llm.weight_version.remote()).startswith("fenced:")
        # Refused before anything was pulled: not fenced, the old weights serve.
        status = ray.get(llm.fence_status.remote())[0]
        assert status["state"] == "committed"
        assert name in status["last_failure"]
        assert_same_greedy(
            ray.get(llm.greedy.remote()), served, atol=logprob_atol("float32")
        )
        _sync_and_check(llm, ranks, 115)


def test_a_worker_failing_mid_update_is_fenced_until_a_full_resync(
    engine, trainer_pool
):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0))
        _fail_a_sync_at_chunk_1(llm, ranks[0], 116)
        assert ray.get(llm.weight_version.remote()).startswith("fenced:")
        status = ray.get(llm.fence_status.remote())[0]
        assert status["state"] == "fenced"
        assert "injected worker failure" in status["reason"]
        ray.get(llm.greedy.remote())  # the server keeps serving

        ray.get(ranks[0].send.remote(weight_version="step-116"))
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-116"
        assert_serves_trainer(llm, ranks[0])


# ---------------------------------------------------------------------------
# The invariant under careless or hostile requests on the dense TP=1 engine:
# after any request the served model is the old weights, the trainer's new
# weights, or fenced with a named cause; the engine keeps answering, and the
# trainer's next full sync serves its weights.

# A short stall timeout: a message that waits for a sync that never begins
# fails after this long instead of the default 300 s.
SHORT_STALL_S = 10.0


def _assert_serves(llm, expected, what: str) -> None:
    assert_bit_identical(ray.get(llm.greedy.remote()), expected, what=what)


def test_generation_after_start_serves_the_old_weights_until_a_sync(
    engine, trainer_pool
):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0))
        _sync_and_check(llm, ranks, 120)
        before = ray.get(llm.greedy.remote())
        version = ray.get(llm.weight_version.remote())
        # An update opened and closed without any weights: by a finish, and by
        # the trainer's abort message and then a finish.
        for close in ("finish", "abort"):
            ray.get(llm.start_weight_update.remote())
            _assert_serves(llm, before, f"vLLM after start ({close})")
            if close == "abort":
                ray.get(
                    llm.update_weights.remote(
                        {"update_info": {"abort": "the trainer gave up"}}
                    )
                )
            ray.get(llm.finish_weight_update.remote())
            _assert_serves(llm, before, f"vLLM after the {close}")
            assert _states(llm) == ["committed"]
            assert ray.get(llm.weight_version.remote()) == version
        ray.get(ranks[0].randomize.remote(121))
        ray.get(ranks[0].send.remote(weight_version="step-121"))
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-121"
        assert_serves_trainer(llm, ranks[0])


# (update_info, what the refusal says). Sync ids name a sync the trainer has
# finished (see the next test for one it has not begun).
MALFORMED_UPDATES = {
    "unknown-field": ({"bogus": 1}, "unknown field"),
    "ipc-fields": ({"sync_id": 1, "names": ["lm_head.weight"]}, "unknown field"),
    "abort-with-more": ({"abort": "giving up", "sync_id": 1}, "only field"),
    "abort-not-a-string": ({"abort": 7}, "must be the only field and a string"),
    # No sync_id: the worker waits for a sync that never begins.
    "no-sync-id": ({}, "no chunk arrived|no progress"),
    "sync-id-a-string": ({"sync_id": "1"}, "sync_id must be an integer"),
    "sync-id-a-bool": ({"sync_id": True}, "sync_id must be an integer"),
    "sync-id-zero": ({"sync_id": 0}, "sync_id must be an integer >= 1"),
}


def test_malformed_updates_after_start_are_refused_and_a_full_sync_recovers(
    engine, trainer_pool
):
    """Each malformed update is refused with its cause, on one trainer: the
    engine serves what it served, closed and unfenced, after every one; then
    one full sync serves the trainer's weights."""
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=SHORT_STALL_S)
        )
        ray.get(ranks[0].randomize.remote(122))
        ray.get(ranks[0].send.remote(weight_version="step-122"))  # sync 1
        before = ray.get(llm.greedy.remote())
        for case, (bad, refusal) in MALFORMED_UPDATES.items():
            ray.get(llm.start_weight_update.remote())
            with pytest.raises(Exception, match=refusal) as info:
                ray.get(
                    llm.update_weights.remote({"update_info": bad}),
                    timeout=SHORT_STALL_S + 60,
                )
            assert str(info.value).strip(), case
            _assert_serves(llm, before, f"vLLM after {case}: update_info={bad!r}")
            # Nothing landed: the update is closed, the engine not fenced.
            (status,) = ray.get(llm.fence_status.remote())
            assert status["state"] == "committed", (case, status)
            assert status["last_failure"], case
            # vLLM's Worker closed the update when update_weights raised.
            with pytest.raises(Exception, match="without a matching start"):
                ray.get(llm.finish_weight_update.remote())

        ray.get(ranks[0].randomize.remote(123))
        ray.get(ranks[0].send.remote(weight_version="step-123"), timeout=120)
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-123"
        assert_serves_trainer(llm, ranks[0])


def test_a_refused_update_naming_the_next_sync_fails_it_and_the_one_after_recovers(
    engine, trainer_pool
):
    """A worker that refuses a message of sync N tells the producers, so the
    trainer's sync N fails at once with the worker's reason (rather than
    after the stall timeout), even when the worker refused before the
    trainer began it. A hand-made message carrying the next sync id thus
    fails that sync: loudly, with the cause, and the next sync recovers."""
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=SHORT_STALL_S)
        )
        before = ray.get(llm.greedy.remote())
        version = ray.get(llm.weight_version.remote())
        ray.get(llm.start_weight_update.remote())
        with pytest.raises(Exception, match=r"unknown field\(s\) \['bogus'\]"):
            ray.get(
                llm.update_weights.remote({"update_info": {"sync_id": 1, "bogus": 1}})
            )
        ray.get(ranks[0].randomize.remote(126))
        error = ray.get(
            ranks[0].send_expecting_failure.remote(weight_version="step-126"),
            timeout=120,
        )
        assert "consumer 0 aborted" in error and "'bogus'" in error
        (status,) = ray.get(llm.fence_status.remote())
        assert status["state"] != "fenced", status  # refused before any pull
        # ... and the worker's failure receipt says so: the version stays.
        assert ray.get(llm.weight_version.remote()) == version
        assert "'bogus'" in status["last_failure"]
        _assert_serves(llm, before, "vLLM after the failed sync")

        ray.get(ranks[0].send.remote(weight_version="step-126"), timeout=120)
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-126"
        assert_serves_trainer(llm, ranks[0])


def test_an_init_declaring_a_float_tensor_int32_is_refused_and_init_recovers(
    engine, trainer_pool
):
    _dense_tp1_only(engine)
    llm, model_dir, tp = engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        payload = ray.get(
            ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0)
        )
        _sync_and_check(llm, ranks, 124)
        before = ray.get(llm.greedy.remote())
        name = "model.norm.weight"
        bad = copy.deepcopy(payload)
        index = bad["names"].index(name)
        assert bad["dtype_names"][index] == "float32"
        bad["dtype_names"][index] = "int32"
        with pytest.raises(Exception, match="int32") as info:
            ray.get(llm.init_weight_transfer_engine.remote({"init_info": bad}))
        error = str(info.value)
        assert f"{name} as int32 (served model: float)" in error
        assert "(init_weight_transfer_engine)" in error
        _assert_serves(llm, before, "vLLM after the refused init")
        assert _states(llm) == ["committed"]
        # The refused init left the previous one in place: the trainer's next
        # sync goes through it.
        _sync_and_check(llm, ranks, 125)

        # The trainer's correct init again; its next sync serves its weights.
        ray.get(llm.init_weight_transfer_engine.remote({"init_info": payload}))
        ray.get(ranks[0].randomize.remote(127))
        ray.get(ranks[0].send.remote(weight_version="step-127"), timeout=120)
        assert _states(llm) == ["committed"]
        assert ray.get(llm.weight_version.remote()) == "step-127"
        assert_serves_trainer(llm, ranks[0])


# ---------------------------------------------------------------------------
# Staged updates (WeightTransferConfig(staging="host")) on engines of their
# own: the pulls run in the background while the engine serves the old
# weights, and a failure before the commit leaves them serving unfenced. The
# dense and MoE TP=1 engines commit through the layerwise reload (every layer,
# the experts too); the MoE TP=2 engine lands planned, so its commit copies
# each staged chunk's planned slices straight into the served tensors and
# reloads only the experts.


STAGED_COMBOS = [
    ("qwen3", 1, "reload"),
    ("qwen3_moe", 1, "reload"),
    ("qwen3_moe", 2, "planned"),
]


@pytest.fixture(
    scope="module",
    params=STAGED_COMBOS,
    ids=[f"{a}-tp{tp}-{landing}" for a, tp, landing in STAGED_COMBOS],
)
def staged_engine(request, ray_cluster):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        stop_llm_host,
    )

    arch, tp, landing = request.param
    model_dir = str(build_tiny_model(TinyModelSpec(arch=arch)))
    llm = ray.remote(num_cpus=0)(LLMHost).remote(
        model_dir,
        tp=tp,
        weight_transfer_config=WeightTransferConfig(
            backend="sharded_rdt",
            staging="host",
            landing=landing,
            cpu_linear="plain" if landing == "planned" else "packed",
        ),
    )
    ray.get(llm.pids.remote())  # wait until the engine is up
    yield llm, model_dir, tp
    stop_llm_host(llm)


def test_a_staged_sync_serves_the_old_weights_while_it_pulls(
    staged_engine, request, trainer_pool
):
    llm, model_dir, tp = staged_engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(ranks[0].init.remote(llm, num_consumers=tp, stall_timeout_s=20.0))
        _sync_and_check(llm, ranks, 201)
        before = ray.get(llm.greedy.remote())
        ray.get(ranks[0].randomize.remote(202))
        # A source that waits before each tensor keeps the pulls going for a
        # few seconds; the engine answers requests all the while.
        sending = ranks[0].send_slowly.remote(0.1, weight_version="step-202")
        during = []
        while not ray.wait([sending], timeout=0)[0]:
            during.append(ray.get(llm.greedy.remote()))
        ray.get(sending)
        after = ray.get(llm.greedy.remote())
        assert_serves_trainer(llm, ranks[0])
        # Requests answered while the sync ran saw the old weights, then (a
        # request queued behind the commit) the new ones; never anything else,
        # never back.
        switched = [r == after for r in during]
        assert all(
            r == before for r, new in zip(during, switched, strict=True) if not new
        )
        assert switched == sorted(switched), "the served weights went back"
        assert switched.count(False) >= 2, "the sync should outlast a few requests"
        assert _states(llm) == ["committed"] * tp
        assert ray.get(llm.weight_version.remote()) == "step-202"
    if request.node.callspec.params["staged_engine"][2] == "planned":
        # The commit copied the attention, norms and embeddings from staging
        # straight into the served tensors; only the experts were reloaded.
        states = ray.get(llm.planned_landing_state.remote())
        receipts = ray.get(llm.receipts.remote())
        for state, receipt in zip(states, receipts, strict=True):
            assert state["still_bound"]
            direct = state["direct_names"]
            for kept in ("q_proj.weight", "input_layernorm.weight", "embed_tokens"):
                assert any(kept in n for n in direct), (kept, direct)
            assert state["reloaded"] and not any(".experts." in n for n in direct)
            assert receipt is not None
            assert receipt["modules_processed"] == len(state["reloaded"])


def test_a_staged_pull_that_fails_keeps_the_old_weights_and_version(
    staged_engine, trainer_pool
):
    llm, model_dir, tp = staged_engine
    with trainer_pool.lend(model_dir, 1) as ranks:
        ray.get(
            ranks[0].init.remote(
                llm, num_consumers=tp, verify_checksums=True, stall_timeout_s=20.0
            )
        )
        _sync_and_check(llm, ranks, 203)
        ray.get(ranks[0].send.remote(weight_version="step-203"))
        before = ray.get(llm.greedy.remote())

        ray.get(ranks[0].randomize.remote(204))
        ray.get(ranks[0].flip_byte_after_checksum.remote(seq=1))
        error = ray.get(
            ranks[0].send_expecting_failure.remote(weight_version="step-204"),
            timeout=120,
        )
        assert "chunk seq 1" in error and "checksum" in error
        # Chunk 0 was only staged: nothing is fenced, the old weights serve
        # and the served version still names them.
        assert _states(llm) == ["committed"] * tp
        assert ray.get(llm.weight_version.remote()) == "step-203"
        _assert_serves(llm, before, "vLLM after the failed staged sync")

        ray.get(ranks[0].send.remote(weight_version="step-204"), timeout=120)
        assert _states(llm) == ["committed"] * tp
        assert ray.get(llm.weight_version.remote()) == "step-204"
        assert_serves_trainer(llm, ranks[0])
