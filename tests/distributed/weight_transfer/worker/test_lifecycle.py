# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The rule of ``worker_lifecycle`` for what ``finish_weight_update`` does
after a failed ``update_weights``, checked on both worker engines that share
it (``ipc`` and ``sharded_rdt``):

- nothing had landed: the update is closed, the model is untouched and
  finish returns quietly;
- a weight had landed: the engine is fenced, finish raises
  ``WeightsFencedError`` naming the reason and the way out (an abort message,
  then finish, then a full update), and that way out closes it quietly;
- after the trainer's abort message, finish closes quietly either way.

The backends' transfers are replaced by a failure injected after (or
before) the point where a weight reaches the model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer.ipc.worker import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.sharded_rdt.worker import (
    ShardedRDTWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import (
    WeightsFencedError,
    WeightState,
)

ENGINES = {
    "ipc": IPCWeightTransferEngine,
    "sharded_rdt": ShardedRDTWeightTransferEngine,
}


def make(backend: str):
    model = torch.nn.Linear(2, 2)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(dtype=None, model=None),
    )
    engine = ENGINES[backend](
        SimpleNamespace(backend=backend),
        vllm_config,
        torch.device("cpu"),
        model,
    )
    return engine, model


def fail_in_receive(engine, landed: bool) -> None:
    """Make the next ``receive_weights`` fail, after marking a weight landed
    when ``landed``."""

    def receive(update_info) -> None:
        if landed:
            engine._mark_landed()
        raise RuntimeError("injected transfer failure")

    engine.receive_weights = receive
    engine.parse_update_info = lambda message: message


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_a_failure_before_anything_landed_closes_the_update_quietly(backend):
    engine, model = make(backend)
    before = model.weight.detach().clone()
    engine.start_weight_update()
    fail_in_receive(engine, landed=False)
    with pytest.raises(RuntimeError, match="injected transfer failure"):
        engine.update_weights({"names": []})
    engine.finish_weight_update()  # nothing landed: closes quietly
    assert engine.fence_status["state"] != WeightState.FENCED.value
    assert "injected" in engine.fence_status["last_failure"]
    assert torch.equal(model.weight, before)
    engine.start_weight_update()  # the next update opens as usual
    assert engine.fence_status["state"] == WeightState.UPDATING.value


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_a_failure_after_a_weight_landed_fences_and_says_the_way_out(backend):
    engine, _ = make(backend)
    engine.start_weight_update()
    fail_in_receive(engine, landed=True)
    with pytest.raises(RuntimeError, match="injected transfer failure"):
        engine.update_weights({"names": []})
    status = engine.fence_status
    assert status["state"] == WeightState.FENCED.value
    assert "injected transfer failure" in status["reason"]
    with pytest.raises(WeightsFencedError, match="injected") as refused:
        engine.update_weights({"names": []})
    with pytest.raises(WeightsFencedError, match="injected") as refused:
        engine.finish_weight_update()
    assert "{'abort'" in str(refused.value) and "full update" in str(refused.value)
    # the way out it names: an abort message, then finish, closes quietly
    engine.update_weights({"abort": "the trainer gave up"})
    engine.finish_weight_update()
    assert engine.fence_status["state"] == WeightState.FENCED.value
    engine.start_weight_update()  # a resync may begin
    assert engine.fence_status["state"] == WeightState.UPDATING.value


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_an_abort_message_closes_the_update_and_finish_is_quiet(backend):
    engine, _ = make(backend)
    engine.start_weight_update()
    engine.update_weights({"abort": "trainer rank 1 died"})
    engine.finish_weight_update()
    assert engine.fence_status["state"] != WeightState.FENCED.value  # none landed
    assert engine._session is None


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_a_blank_failure_is_never_a_blank_error(backend):
    engine, _ = make(backend)
    engine.start_weight_update()

    def receive(update_info) -> None:
        raise AssertionError()

    engine.receive_weights = receive
    engine.parse_update_info = lambda message: message
    with pytest.raises(RuntimeError, match="update_weights failed: AssertionError"):
        engine.update_weights({"names": []})
    assert "AssertionError" in engine.fence_status["last_failure"]


@pytest.mark.parametrize("backend", sorted(ENGINES))
@pytest.mark.parametrize(
    "message", [{"names": []}, {"prepare": "p" * 8}, {"adapter": {}}], ids=str
)
def test_a_message_after_an_abort_is_refused_naming_the_abort(backend, message):
    """Whoever aborted the update, the next message of any kind but the
    finish hears why, and lands nothing."""
    engine, model = make(backend)
    before = model.weight.detach().clone()
    engine.start_weight_update()
    fail_in_receive(engine, landed=True)  # would land if it were reached
    engine.update_weights({"abort": "abandoned: trainer B started a new sync"})
    with pytest.raises(RuntimeError, match="aborted \\(abandoned: trainer B"):
        engine.update_weights(message)
    engine.finish_weight_update()  # the abort's finish still closes quietly
    assert torch.equal(model.weight, before)
