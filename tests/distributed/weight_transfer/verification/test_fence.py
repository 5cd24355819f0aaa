# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker-side fence and the trainer's served-version helpers."""

import time

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.trainer.lifecycle import ModelVersions
from vllm.distributed.weight_transfer.verification.fence import (
    MAX_VERSION_AHEAD_US,
    WeightFence,
    WeightsFencedError,
    WeightState,
    fenced_version,
    is_fenced_version,
    set_served_version,
    version_ceiling,
)
from vllm.distributed.weight_transfer.verification.wire import (
    Manifest,
    PublicationHeader,
)

MANIFEST = Manifest.from_params([ParamMeta("w", torch.float32, (2,))])


def header(version: int = 1) -> PublicationHeader:
    return PublicationHeader.create(
        backend="ipc",
        model_version=version,
        manifest=MANIFEST,
        trainer_devices=["cpu:h:0"],
    )


def committed_fence(version: int = 1) -> WeightFence:
    fence = WeightFence()
    fence.start()
    fence.bind(header(version))
    fence.touch()
    fence.finish()
    return fence


def test_full_update_commits_its_version():
    fence = committed_fence(4)
    status = fence.status
    assert status.state == WeightState.COMMITTED and status.model_version == 4


def test_failure_after_landing_fences_update_and_finish():
    fence = committed_fence()
    fence.start()
    fence.bind(header(2))
    fence.touch()
    fence.fail("worker 1: connection reset")
    assert fence.state == WeightState.FENCED
    for op in (fence.touch, fence.finish):
        with pytest.raises(WeightsFencedError) as e:
            op()
        assert str(e.value) == (
            "weights are fenced after a failed update (worker 1: connection reset); "
            "a full resync is required: start_weight_update, send every tensor, "
            "finish_weight_update"
        )
    assert fence.status.to_dict()["state"] == "fenced"


def test_full_resync_clears_the_fence():
    fence = committed_fence()
    fence.start()
    fence.touch()
    fence.fail("boom")
    fence.start()
    assert fence.status.resync_required
    fence.bind(header(2))
    fence.touch()
    fence.finish()
    assert fence.state == WeightState.COMMITTED and not fence.status.resync_required


def test_update_without_header_cannot_clear_the_fence():
    fence = committed_fence()
    fence.start()
    fence.touch()
    fence.fail("boom")
    fence.start()
    fence.bind(None)
    fence.touch()
    with pytest.raises(WeightsFencedError, match="carried no publication header"):
        fence.finish()
    assert fence.state == WeightState.FENCED


def test_update_without_header_commits_on_a_healthy_engine():
    fence = committed_fence(2)
    fence.start()
    fence.bind(None)
    fence.touch()
    fence.finish()
    assert fence.state == WeightState.COMMITTED and fence.status.model_version == 2


def test_an_update_that_touched_no_weight_keeps_the_committed_publication():
    """An update that carried only a LoRA adapter never reaches the fence
    with its publication and touches no weight: the base weights'
    committed publication and version stay as they were."""
    fence = committed_fence(2)
    committed = fence.status.publication_id
    fence.start()
    fence.finish()
    status = fence.status
    assert (status.publication_id, status.model_version) == (committed, 2)
    # A header-less update that did change weights no longer names it.
    fence.start()
    fence.touch()
    fence.finish()
    assert fence.status.publication_id is None and fence.status.model_version == 2


def test_rejection_before_landing_keeps_weights_and_state():
    fence = committed_fence(3)
    fence.start()
    fence.fail("manifest mismatch", weights_intact=True)
    assert fence.state == WeightState.COMMITTED
    assert fence.status.last_failure == "manifest mismatch"
    with pytest.raises(RuntimeError, match="call start_weight_update first"):
        fence.finish()


def test_weights_intact_is_ignored_once_a_weight_was_touched():
    fence = committed_fence()
    fence.start()
    fence.touch()
    fence.fail("late failure", weights_intact=True)
    assert fence.state == WeightState.FENCED


def test_versions_never_go_backwards_but_may_repeat():
    fence = committed_fence(5)
    fence.start()
    with pytest.raises(ValueError, match="older than the committed version 5"):
        fence.bind(header(4))
    fence.bind(header(5))


def test_messages_of_another_publication_are_rejected():
    fence = WeightFence()
    fence.start()
    fence.bind(header(1))
    with pytest.raises(ValueError, match="the open update is publication"):
        fence.bind(header(1))


def test_misuse_outside_an_update_does_not_fence():
    fence = committed_fence()
    with pytest.raises(RuntimeError, match="needs an open weight update"):
        fence.bind(None)
    fence.fail("update_weights before start")
    assert fence.state == WeightState.COMMITTED


def test_restart_abandons_an_untouched_update_without_fencing():
    fence = committed_fence()
    fence.start()
    fence.start()
    assert fence.state == WeightState.UPDATING and not fence.status.resync_required
    fence.touch()
    fence.start()
    assert fence.status.resync_required


def test_fenced_version_is_one_line_and_recognisable():
    v = fenced_version("abcdef0123", "receipt\nmissing   from worker 3")
    assert v == "fenced:abcdef0123: receipt missing from worker 3"
    assert is_fenced_version(v) and not is_fenced_version("step-7")
    assert len(fenced_version("abcdef0123", "x" * 5000)) < 400


def test_set_served_version_uses_the_client_method():
    class WithMethod:
        def __init__(self):
            self.got = []

        def update_weight_version(self, v):
            self.got.append(v)

    c = WithMethod()
    set_served_version(c, "v1")
    assert c.got == ["v1"]

    class Offline:  # an llm field is not enough: the client must say how
        def __init__(self, llm):
            self.llm = llm

    with pytest.raises(TypeError, match="cannot set the served weight version"):
        set_served_version(Offline(WithMethod()), "v2")
    with pytest.raises(TypeError, match="cannot set the served weight version"):
        set_served_version(object(), "v3")


def test_a_failure_without_a_message_still_names_its_cause():
    fence = WeightFence()
    fence.start()
    fence.bind(header())
    fence.touch()
    fence.fail("")
    assert fence.status.reason == "unknown failure (no reason given)"
    assert fenced_version("p" * 8, "").endswith(": unknown failure (no reason given)")


def test_a_version_far_beyond_the_wall_clock_is_refused_and_locks_out_nobody():
    fence = committed_fence()
    fence.start()
    with pytest.raises(ValueError, match="beyond .* wall clock"):
        fence.bind(header(2**62))
    fence.fail("refused", weights_intact=True)
    assert fence.state == WeightState.COMMITTED
    # a default (wall-clock) trainer still gets through afterwards
    now_us = time.time_ns() // 1000
    fence.start()
    fence.bind(header(now_us))
    fence.touch()
    fence.finish()
    assert fence.status.model_version == now_us < version_ceiling()


def test_a_version_a_day_ahead_is_refused_naming_the_field():
    """A publication 23 hours ahead of the wall clock (once under the old
    one-day bound) is refused before it binds; default trainers go on."""
    fence = committed_fence()
    fence.start()
    ahead = time.time_ns() // 1000 + 23 * 3600 * 1_000_000
    with pytest.raises(ValueError, match=r"publication\.model_version .* beyond"):
        fence.bind(header(ahead))
    fence.fail("refused", weights_intact=True)
    assert fence.state == WeightState.COMMITTED and fence.status.model_version == 1
    now_us = ModelVersions(None).next()
    fence.start()
    fence.bind(header(now_us))
    fence.touch()
    fence.finish()
    assert fence.status.model_version == now_us


def test_one_publication_keeps_default_trainers_out_for_at_most_the_bound(
    monkeypatch,
):
    """The ceiling follows the wall clock, not the committed version: a
    publication at the ceiling commits, a default trainer's version is older
    only until the clock passes it, and no second publication can push the
    committed version further ahead of the clock."""
    clock_ns = [time.time_ns()]
    monkeypatch.setattr(time, "time_ns", lambda: clock_ns[0])
    hostile = version_ceiling()
    assert hostile == clock_ns[0] // 1000 + MAX_VERSION_AHEAD_US
    fence = committed_fence(hostile)
    fence.start()
    with pytest.raises(ValueError, match=r"publication\.model_version .* beyond"):
        fence.bind(header(hostile + 1))  # no ratchet beyond the clock's bound
    fence.fail("refused", weights_intact=True)
    trainer = ModelVersions(None)
    fence.start()
    with pytest.raises(ValueError, match="older than the committed version"):
        fence.bind(header(trainer.next()))
    fence.fail("refused", weights_intact=True)
    clock_ns[0] += (MAX_VERSION_AHEAD_US + 1) * 1000  # the bound has passed
    fence.start()
    fence.bind(header(trainer.next()))
    fence.touch()
    fence.finish()
    committed = fence.status.model_version
    assert committed is not None and committed > hostile
