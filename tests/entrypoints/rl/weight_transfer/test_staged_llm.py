# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staged updates (``WeightTransferConfig(staging="host")``) through a real
vLLM engine on CPU with the ``ipc`` backend: one offline ``LLM`` (dense
Qwen3, fp32, TP=1) shared by every scenario.

* Generation between every update message of a sync serves exactly the old
  weights; after the commit the engine serves exactly a fresh load of the
  trainer's weights (and, in fp32, Hugging Face's forward of them).
* Requests in flight across a sync all complete; each one's output carries
  the weight version of every token (vLLM's ``weight_versions`` spans): the
  tokens before the switch equal the old weights' greedy output and the
  tokens after it equal the new weights' continuation of the same prefix,
  bit for bit (the commit drops the KV cache, so the prefix is recomputed).
* A failure before the commit (a worker raising while staging, a flipped
  byte caught by the checksums, a manifest the server contradicts, a trainer
  that vanishes mid-sync) leaves the old weights serving and the engine
  unfenced; the next sync succeeds with no manual step.
* Twenty failed syncs leave no staging, shared memory or resident memory
  behind.
* A MoE model at TP=2 (its own engine, plain CPU linear layers with the
  planned landing): generation during the transfer serves the old weights, a
  trainer failing mid-sync changes nothing, and the commit serves the
  trainer's weights on both workers, copying every planned tensor straight
  from staging and reloading only the experts.
* A dense model at TP=2 (its own engine, the default layerwise reload at the
  commit, ``staging="device"``): the same three checks on both workers.
* A MoE model at TP=1 (its own engine, the defaults: dense layers processed
  in their shadows while staging, the experts reloaded at the commit): the
  same three checks.

Each test first pushes the state it starts from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_ipc_verified_llm import (
    ResizedSource,
    Rig,
)

from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import ModuleSource, ParamMeta, WeightSource
from vllm.distributed.weight_transfer.testing import (
    GreedyResult,
    assert_bit_identical,
    load_hf_model,
    randomize_weights_,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.ipc_faults import (
    INJECTED_FAILURE,
    ByteFlippingClient,
    fail_stage_once,
    worker_fence_status,
    worker_staging,
)
from vllm.distributed.weight_transfer.testing.oracle import DEFAULT_PROMPTS
from vllm.distributed.weight_transfer.testing.served_layers import (
    planned_landing_state,
)
from vllm.distributed.weight_transfer.testing.shm_census import own_fork_entries
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm
from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:
    with pytest.MonkeyPatch.context() as env:
        # collective_rpc(fn) pickles fn (test-only fault injection and status).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = tiny_llm(
            tiny_model_dir,
            weight_transfer_config=WeightTransferConfig(backend="ipc", staging="host"),
            # In this process, unlike the MoE engines below: a second engine
            # here would find the first one's parallel groups (no experts').
            in_process=True,
        )
        try:
            yield Rig(llm, load_hf_model(tiny_model_dir, "float32"))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


class AfterEachMessage:
    """A sync client that runs ``then()`` after every update message it
    forwards, as an engine that keeps serving would between two messages."""

    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        self.inner, self.then = inner, then
        self.messages = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        self.messages += 1
        self.then()


class StagingWatch:
    """A sync client (``client``) that, after every update message it
    forwards, generates (``during``) and reads each worker's staged bytes
    (``staged``), as an engine that keeps serving would between messages."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.during: list[GreedyResult] = []
        self.staged: list[int] = []
        self.client = AfterEachMessage(rig.client(), self._look)

    def _look(self) -> None:
        self.during.append(self.rig.greedy())
        workers = self.rig.llm.collective_rpc(worker_staging)
        self.staged.extend(s["staged_bytes"] for s in workers)

    def assert_old_weights_served(self, before: GreedyResult) -> None:
        assert self.client.messages >= 3, "the sync should span several messages"
        for result in self.during:
            assert_bit_identical(result, before, what="generation during the transfer")


def test_generation_during_the_transfer_serves_the_old_weights(rig: Rig):
    rig.push(seed=1, version="s1")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=2)
    during: list[GreedyResult] = []
    client = AfterEachMessage(rig.client(), lambda: during.append(vllm_greedy(rig.llm)))
    rig.trainer(client=client).send_weights(weight_version="s2")
    assert client.messages >= 3, "the sync should span several messages"
    for result in during:
        assert_bit_identical(result, before, what="generation during the transfer")
    assert rig.llm.get_weight_version() == "s2"
    rig.assert_serves_trainer()
    assert rig.fence()["state"] == "committed"
    # Every layer was loaded and processed in its shadow while the engine
    # served (the packed CPU GEMM handles built then); the commit only copied
    # and swapped them in, reloading nothing.
    (staging,) = rig.llm.collective_rpc(worker_staging)
    committed = staging["committed"]
    assert committed["tensors_reloaded"] == 0, committed
    assert committed["shadow_layers"] >= 6, committed


def test_requests_in_flight_switch_versions_at_the_commit(rig: Rig):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_tokens = 40
    rig.push(seed=3, version="s3")
    old = vllm_greedy(rig.llm, max_tokens=max_tokens)
    randomize_weights_(rig.model, seed=4)
    engine = rig.llm.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0
    )
    ids = [f"in-flight-{i}" for i in range(len(DEFAULT_PROMPTS))]
    for request_id, prompt in zip(ids, DEFAULT_PROMPTS, strict=True):
        engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(prompt)), params
        )
    finals: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out

    step()
    step()
    rig.trainer(client=AfterEachMessage(rig.client(), step)).send_weights(
        weight_version="s4"
    )
    while engine.has_unfinished_requests():
        step()
    assert sorted(finals) == sorted(ids), "every request in flight completes"

    completions = [finals[request_id].outputs[0] for request_id in ids]
    for i, (prompt, c) in enumerate(zip(DEFAULT_PROMPTS, completions, strict=True)):
        k = c.weight_versions[0].end  # the first token of the new weights
        assert 0 < k < max_tokens, "the sync must fall inside the request"
        spans = [(s.version, s.start, s.end) for s in c.weight_versions]
        assert spans == [("s3", 0, k), ("s4", k, max_tokens)], spans
        tokens = tuple(c.token_ids)
        logprobs = tuple(
            float(step_lp[tok].logprob)
            for tok, step_lp in zip(tokens, c.logprobs, strict=True)
        )
        assert tokens[:k] == old.tokens[i][:k], f"prompt {i}: before the switch"
        assert logprobs[:k] == old.logprobs[i][:k], f"prompt {i}: before the switch"
        # The new weights' continuation of the same prefix, computed afresh.
        new = vllm_greedy(
            rig.llm,
            prompts=[list(prompt) + list(tokens[:k])],
            max_tokens=max_tokens - k,
        )
        assert tokens[k:] == new.tokens[0], f"prompt {i}: after the switch"
        assert logprobs[k:] == new.logprobs[0], f"prompt {i}: after the switch"
    rig.assert_serves_trainer()


class VanishesAfter:
    """A client whose trainer dies after ``n`` update messages: every later
    call (the trainer's own abort included) fails without reaching the server."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n, self.sent = inner, n, 0

    def __getattr__(self, name: str) -> Any:
        if self.sent >= self.n:
            raise ConnectionError("the trainer is gone")
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        if self.sent >= self.n:
            raise ConnectionError("the trainer is gone")
        self.sent += 1
        self.inner.update_weights(update_info)


def _fault_worker_raises(rig: Rig) -> None:
    rig.llm.collective_rpc(fail_stage_once, args=(2,))
    rig.trainer().send_weights(weight_version="never")


def _fault_flipped_byte(rig: Rig) -> None:
    client = ByteFlippingClient(rig.client(), message=1)
    rig.trainer(client=client, verify_checksums=True).send_weights(
        weight_version="never"
    )


def _fault_manifest(rig: Rig) -> None:
    name = "model.norm.weight"
    rig.trainer(source=ResizedSource(ModuleSource(rig.model), name)).send_weights(
        weight_version="never"
    )


def _fault_trainer_vanishes(rig: Rig) -> None:
    rig.trainer(client=VanishesAfter(rig.client(), 2)).send_weights(
        weight_version="never"
    )


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        (_fault_worker_raises, INJECTED_FAILURE),
        (_fault_flipped_byte, "checksum"),
        (_fault_manifest, "model.norm.weight"),
        (_fault_trainer_vanishes, "the trainer is gone"),
    ],
    ids=["worker-raises", "flipped-byte", "manifest", "trainer-vanishes"],
)
def test_a_failure_before_the_commit_keeps_the_old_weights_serving(
    rig: Rig, fault, cause
):
    rig.push(seed=5, version="s5")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=6)
    with pytest.raises(Exception) as info:
        fault(rig)
    assert cause in str(info.value)
    assert_bit_identical(vllm_greedy(rig.llm), before, what="after the failed sync")
    assert rig.llm.get_weight_version() != "never"
    status = rig.fence()
    assert status["state"] != "fenced", status
    # The next full sync needs no manual step (a vanished trainer's update is
    # still open on the server: the new trainer abandons it).
    rig.push(seed=7, version="s7")


# The resident sizes are read after glibc returned its free heap pages
# (``worker_staging``): without that, what the allocator kept for reuse grew
# the RSS by 13.7-19.6 MiB over these twenty failures, depending on what the
# process ran before, with no tensor left behind; with it, by under 1 MiB.
def test_twenty_failed_syncs_leave_nothing_behind(rig: Rig):
    rig.push(seed=8, version="s8")
    before = vllm_greedy(rig.llm)
    # Only this process's: the parallel run's other worker makes its own.
    segments = own_fork_entries()
    randomize_weights_(rig.model, seed=9)

    def fail_syncs(count: int) -> None:
        for _ in range(count):
            rig.llm.collective_rpc(fail_stage_once, args=(2,))
            with contextlib.suppress(Exception):
                rig.trainer().send_weights(weight_version="never")

    fail_syncs(5)
    (start,) = rig.llm.collective_rpc(worker_staging)
    fail_syncs(20)
    (end,) = rig.llm.collective_rpc(worker_staging)
    assert end["staged_bytes"] == 0 and not end["open"], end
    assert own_fork_entries() <= segments
    # Each failed sync staged about 2 MB: twenty leaks would be 40 MB, and
    # one in five 8 MB.
    grown = end["rss"] - start["rss"]
    assert grown < 6 * 2**20, f"worker RSS grew by {grown / 2**20:.1f} MiB"
    assert_bit_identical(vllm_greedy(rig.llm), before, what="after 20 failures")
    assert rig.fence()["state"] != "fenced"
    rig.push(seed=10, version="s10")


# ---------------------------------------------------------------------------
# The same on a MoE model at TP=2: every worker stages whole tensors and
# commits its own slice of them, experts included. This engine runs plain
# CPU linear layers with the planned landing, so its commit copies every
# planned tensor from staging straight into the served one and reloads only
# the experts.


@contextlib.contextmanager
def moe_rig(
    config: WeightTransferConfig, tensor_parallel_size: int = 1, **rig_options: Any
) -> Iterator[Rig]:
    """A staged engine on a generated tiny Qwen3 MoE, shut down on exit."""
    from vllm.distributed.weight_transfer.testing import (
        TinyModelSpec,
        build_tiny_model,
    )

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3_moe"))
    with pytest.MonkeyPatch.context() as env:
        if tensor_parallel_size == 2:
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        # collective_rpc(fn) pickles fn (staging and planned-landing reports).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = tiny_llm(
            model_dir,
            tensor_parallel_size=tensor_parallel_size,
            weight_transfer_config=config,
        )
        try:
            yield Rig(llm, load_hf_model(model_dir, "float32"), **rig_options)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


@pytest.fixture(scope="module")
def moe_tp2() -> Iterator[Rig]:
    config = WeightTransferConfig(
        backend="ipc", staging="host", cpu_linear="plain", landing="planned"
    )
    with moe_rig(config, tensor_parallel_size=2, one_at_a_time=True) as rig:
        yield rig


def moe_trainer(rig: Rig, client: Any = None, source: Any = None) -> Any:
    # HF keeps a MoE layer's experts fused in memory; vLLM loads them by
    # their checkpoint names.
    return rig.trainer(client=client, source=source or CheckpointNamesSource(rig.model))


class FailsAfter(WeightSource):
    """``inner``, raising after ``n`` tensors: a trainer that fails mid-sync."""

    def __init__(self, inner: WeightSource, n: int) -> None:
        self.inner, self.n = inner, n

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(self.inner):
            if i == self.n:
                raise RuntimeError(f"the trainer failed after {i} tensors")
            yield item


def test_moe_tp2_serves_the_old_weights_until_the_commit_and_survives_a_failure(
    moe_tp2: Rig,
):
    rig = moe_tp2
    randomize_weights_(rig.model, seed=11)
    moe_trainer(rig).send_weights(weight_version="m1")
    rig.assert_serves_trainer()
    before = rig.greedy()

    # A trainer failing mid-sync: both workers drop their staging, unfenced.
    randomize_weights_(rig.model, seed=12)
    with pytest.raises(RuntimeError, match="the trainer failed after"):
        moe_trainer(
            rig, source=FailsAfter(CheckpointNamesSource(rig.model), 20)
        ).send_weights(weight_version="never")
    assert_bit_identical(rig.greedy(), before, what="after the failure")
    assert rig.llm.get_weight_version() == "m1"

    # Generation between every message serves the old weights; the commit
    # switches both workers to the trainer's.
    watch = StagingWatch(rig)
    moe_trainer(rig, client=watch.client).send_weights(weight_version="m2")
    watch.assert_old_weights_served(before)
    assert rig.llm.get_weight_version() == "m2"
    rig.assert_serves_trainer()
    # Each worker staged its own shard of the planned tensors (and the
    # experts whole), never the whole model.
    whole = sum(p.numel() * p.element_size() for p in rig.model.parameters())
    assert 0 < max(watch.staged) < whole, (max(watch.staged), whole)

    # Each worker's commit copied the attention, norms and embeddings from
    # staging straight into its served tensors; only the experts reloaded.
    for state in rig.llm.collective_rpc(planned_landing_state):
        assert state["still_bound"]
        direct = state["direct_names"]
        assert any(n.endswith("q_proj.weight") for n in direct), direct
        assert any(n.endswith("input_layernorm.weight") for n in direct), direct
        assert not any(".experts." in n for n in direct)
        assert state["reloaded"] and all(".experts" in m for m in state["reloaded"])
    # The experts are the commit's only reload: no layer qualifies for a shadow
    # beyond those the plan lands directly.
    for staging in rig.llm.collective_rpc(worker_staging):
        assert staging["committed"]["tensors_reloaded"] > 0, staging
        assert staging["committed"]["shadow_layers"] == 0, staging

    # The next sync stages into the buffers this one used (``staging_pool``),
    # the planned slices and the experts alike, and is exact.
    kept = [s["pool"] for s in rig.llm.collective_rpc(worker_staging)]
    randomize_weights_(rig.model, seed=13)
    moe_trainer(rig).send_weights(weight_version="m3")
    rig.assert_serves_trainer()
    after = rig.llm.collective_rpc(worker_staging)
    for before_sync, staging in zip(kept, after, strict=True):
        pool = staging["pool"]
        assert pool["held_back"] == 0, pool
        assert pool["reserved_bytes"] == before_sync["reserved_bytes"] > 0, pool
        assert pool["reuses"] > before_sync["reuses"], (before_sync, pool)


# ---------------------------------------------------------------------------
# A dense model at TP=2 with the default landing (vLLM's layerwise reload at
# the commit) and ``staging="device"``: each worker stages the tensors it
# receives in the model's own memory and reloads its own shard from them.


@pytest.fixture(scope="module")
def dense_tp2(tiny_model_dir: Path) -> Iterator[Rig]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = tiny_llm(
            tiny_model_dir,
            tensor_parallel_size=2,
            weight_transfer_config=WeightTransferConfig(
                backend="ipc", staging="device"
            ),
        )
        try:
            yield Rig(llm, load_hf_model(tiny_model_dir, "float32"))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def test_dense_tp2_serves_the_old_weights_until_the_commit_and_survives_a_failure(
    dense_tp2: Rig,
):
    rig = dense_tp2
    rig.push(seed=31, version="d1")
    before = rig.greedy()

    # A trainer failing mid-sync: both workers drop their staging, unfenced.
    randomize_weights_(rig.model, seed=32)
    with pytest.raises(RuntimeError, match="the trainer failed after"):
        rig.trainer(source=FailsAfter(ModuleSource(rig.model), 20)).send_weights(
            weight_version="never"
        )
    assert_bit_identical(rig.greedy(), before, what="after the failure")
    assert rig.llm.get_weight_version() == "d1"
    for status in rig.llm.collective_rpc(worker_fence_status):
        assert status["state"] != "fenced", status
    for staging in rig.llm.collective_rpc(worker_staging):
        assert staging["staged_bytes"] == 0 and not staging["open"], staging

    # Generation between every message serves the old weights while both
    # workers stage; the commit switches both to the trainer's weights.
    watch = StagingWatch(rig)
    rig.trainer(client=watch.client).send_weights(weight_version="d2")
    watch.assert_old_weights_served(before)
    assert min(watch.staged) >= 0 and max(watch.staged) > 0, watch.staged
    assert rig.llm.get_weight_version() == "d2"
    rig.assert_serves_trainer()
    for status in rig.llm.collective_rpc(worker_fence_status):
        assert status["state"] == "committed", status
    # Each worker processed its shard of every layer while staging.
    for staging in rig.llm.collective_rpc(worker_staging):
        committed = staging["committed"]
        assert committed["tensors_reloaded"] == 0 < committed["shadow_layers"]


# ---------------------------------------------------------------------------
# A MoE model at TP=1 with the defaults (packed CPU linear layers, vLLM's
# layerwise reload at the commit): the attention layers are processed in
# their shadows while staging and the experts are staged whole and reloaded
# at the commit.


@pytest.fixture(scope="module")
def moe_tp1() -> Iterator[Rig]:
    with moe_rig(WeightTransferConfig(backend="ipc", staging="host")) as rig:
        yield rig


def test_moe_tp1_serves_the_old_weights_until_the_commit_and_survives_a_failure(
    moe_tp1: Rig,
):
    rig = moe_tp1
    randomize_weights_(rig.model, seed=41)
    moe_trainer(rig).send_weights(weight_version="e1")
    rig.assert_serves_trainer()
    before = rig.greedy()

    # A trainer failing mid-sync: the staging is dropped, unfenced.
    randomize_weights_(rig.model, seed=42)
    with pytest.raises(RuntimeError, match="the trainer failed after"):
        moe_trainer(
            rig, source=FailsAfter(CheckpointNamesSource(rig.model), 20)
        ).send_weights(weight_version="never")
    assert_bit_identical(rig.greedy(), before, what="after the failure")
    assert rig.llm.get_weight_version() == "e1"
    (status,) = rig.llm.collective_rpc(worker_fence_status)
    assert status["state"] != "fenced", status
    (staging,) = rig.llm.collective_rpc(worker_staging)
    assert staging["staged_bytes"] == 0 and not staging["open"], staging

    # Generation between every message serves the old weights; the commit
    # serves the trainer's.
    watch = StagingWatch(rig)
    moe_trainer(rig, client=watch.client).send_weights(weight_version="e2")
    watch.assert_old_weights_served(before)
    assert rig.llm.get_weight_version() == "e2"
    rig.assert_serves_trainer()
    (status,) = rig.llm.collective_rpc(worker_fence_status)
    assert status["state"] == "committed", status
    # Dense layers were processed in their shadows while staging; the
    # experts (and whatever else no shadow takes) reloaded at the commit.
    (staging,) = rig.llm.collective_rpc(worker_staging)
    committed = staging["committed"]
    assert committed["shadow_layers"] > 0 < committed["tensors_reloaded"], staging
