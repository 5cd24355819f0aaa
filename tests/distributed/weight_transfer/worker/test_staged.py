# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staged updates (``WeightTransferConfig.staging``) on the ipc worker engine
and a small torch model (no vLLM engine): the model serves its old weights
until ``finish_weight_update`` commits, a forward pass in between is served
normally, every failure before the commit drops the staging without fencing,
the receipt is written at the trainer's prepare message before anything is
committed, and staging that does not fit is refused before it is copied."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.verification import (
    PREPARE_FIELD,
    is_prepare_request,
)
from vllm.distributed.weight_transfer.worker import staged as staged_module
from vllm.distributed.weight_transfer.worker.staged import (
    StagedUpdate,
    StagingDoesNotFit,
)

from ..ipc.worker_rig import (
    EngineClient,
    NoReload,
    TinyNet,
    planned_ready,
    reload_ready,
    state,
)


def staged_engine(
    model: torch.nn.Module,
    where: str = "host",
    timeout_s: float = 600.0,
    landing: str = "reload",
) -> IPCWeightTransferEngine:
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        model_config=SimpleNamespace(dtype=None, model=None),
    )
    return IPCWeightTransferEngine(
        SimpleNamespace(
            backend="ipc", staging=where, update_timeout_s=timeout_s, landing=landing
        ),
        vllm_config,
        torch.device("cpu"),
        model,
    )


class OpenUpdate(NamedTuple):
    """A served model, its weights before any update, its engine with host
    staging and the staged update that engine opened."""

    target: TinyNet
    before: dict[str, torch.Tensor]
    engine: IPCWeightTransferEngine
    session: StagedUpdate


def open_update(timeout_s: float = 600.0) -> OpenUpdate:
    target = reload_ready(0)
    before = state(target)
    engine = staged_engine(target, timeout_s=timeout_s)
    engine.start_weight_update()
    session = engine._session
    assert isinstance(session, StagedUpdate)
    return OpenUpdate(target, before, engine, session)


class ServingClient(EngineClient):
    """Drives the engine like the worker's RPC handlers and runs a forward
    pass of the served model after every update message, as an engine that
    keeps generating would; records what each forward saw."""

    def __init__(self, engine: IPCWeightTransferEngine) -> None:
        super().__init__(engine)
        self.seen: list[dict[str, torch.Tensor]] = []
        self.finished = False

    def update_weights(self, update_info):
        super().update_weights(update_info)
        model = self.engine.model
        model.b(model.a(torch.ones(1, 4)))  # type: ignore[operator]  # a forward
        self.seen.append(state(model))


def trainer_for(client, model, **kwargs) -> IPCTrainerWeightTransferEngine:
    return IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64, **kwargs),
        client=client,
        source=ModuleSource(model),
    )


def assert_state(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        param = dict(model.named_parameters())[name]
        assert not param.is_meta and torch.equal(param, value), name


@pytest.mark.parametrize("verified", [True, False])
def test_the_old_weights_serve_until_the_commit(verified):
    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    engine = staged_engine(target)
    client = ServingClient(engine)
    trainer_for(client, trainer, verify_publication=verified).send_weights()
    weights = [s for s in client.seen]
    assert len(weights) >= 2  # several messages, a forward after each
    for seen in weights:  # every forward before the commit saw the old weights
        for name, value in before.items():
            assert torch.equal(seen[name], value), name
    assert_state(target, state(trainer))
    assert engine.fence_status["state"] == "committed"


def test_a_planned_landing_commits_straight_into_the_served_tensors():
    """Staging with ``landing="planned"``: the old weights serve until the
    commit, which copies each planned tensor from staging into the served
    one (no layerwise reload), twice in a row; a failure before the commit
    still leaves the old weights, unfenced."""
    target = planned_ready(0)
    engine = staged_engine(target, landing="planned")
    for seed in (1, 2):
        before, trainer = state(target), TinyNet(seed)
        client = ServingClient(engine)
        with NoReload():
            trainer_for(client, trainer).send_weights()
        assert len(client.seen) >= 2
        for seen in client.seen:
            for name, value in before.items():
                assert torch.equal(seen[name], value), name
        assert_state(target, state(trainer))
        assert engine.fence_status["state"] == "committed"
    plan = engine.landing_plan
    assert plan is not None and plan.direct_names == set(state(target))

    before, trainer = state(target), TinyNet(3)
    with pytest.raises(RuntimeError, match="injected failure while staging"):
        trainer_for(FailsAtMessage(engine, 2), trainer).send_weights()
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"


class ReplacesBefore(EngineClient):
    """Forwards every call, but first gives served parameter ``name`` new
    memory (``param.data = ...``, as an offload and restore does) right
    before the trainer's prepare message (``at="prepare"``) or its finish
    (``at="finish"``)."""

    def __init__(self, engine, name: str, at: str) -> None:
        super().__init__(engine)
        self.name, self.at = name, at
        # What served after the replacement (set by a test's own _replace).
        self.replaced: dict[str, torch.Tensor] = {}

    def _replace(self) -> None:
        param = dict(self.engine.model.named_parameters())[self.name]
        param.data = param.data.clone()

    def update_weights(self, update_info):
        if self.at == "prepare" and is_prepare_request(update_info):
            self._replace()
        super().update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        if self.at == "finish":
            self.at = "done"
            self._replace()
        super().finish_weight_update(weight_version)


@pytest.mark.parametrize("at", ["prepare", "finish"])
def test_a_served_tensor_replaced_after_staging_drops_the_planned_commit(at):
    """The planned landing's commit writes through views of the served
    tensors bound while staging. A served tensor given new memory after
    that (before the prepare message, or between it and the finish) would
    take the staged bytes in its old memory: the update is refused before
    anything is written, the old weights serving, unfenced. The next sync
    plans again and commits."""
    target = planned_ready(0)
    engine = staged_engine(target, landing="planned")
    before, trainer = state(target), TinyNet(1)
    with pytest.raises(RuntimeError, match="were replaced after this update was"):
        trainer_for(ReplacesBefore(engine, "a.weight", at), trainer).send_weights()
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"
    with NoReload():
        trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))
    assert engine.fence_status["state"] == "committed"


def test_a_served_layer_replaced_after_its_shadow_was_checked_drops_the_commit():
    """Layers processed in shadows are copied into the served tensors their
    layers held when the trainer's prepare message checked them. A served
    parameter replaced on its layer between that and the finish is found
    before the first copy: dropped, unfenced, the replacement untouched."""
    target, trainer = reload_ready(0), TinyNet(1)
    engine = staged_engine(target)
    client = ReplacesBefore(engine, "b.weight", "finish")

    def replace_object() -> None:
        target.b.weight = torch.nn.Parameter(torch.full_like(target.b.weight, 5.0))
        client.replaced = state(target)

    client._replace = replace_object  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="layers processed in shadows"):
        trainer_for(client, trainer).send_weights()
    assert_state(target, client.replaced)
    assert engine.fence_status["state"] != "fenced"
    session = engine._session
    assert session is None or not session.is_open


def test_the_receipt_is_written_at_prepare_before_anything_commits():
    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    engine = staged_engine(target)
    prepared: list[dict] = []

    class WatchesPrepare(EngineClient):
        def update_weights(self, update_info):
            super().update_weights(update_info)
            if is_prepare_request(update_info):
                pub = self.engine.pub
                prepared.append(
                    {"receipt_sent": pub.receipt_sent, "state": state(target)}
                )

    trainer_for(WatchesPrepare(engine), trainer).send_weights(weight_version="v1")
    assert len(prepared) == 1 and prepared[0]["receipt_sent"]
    assert_state_equal(prepared[0]["state"], before)
    assert_state(target, state(trainer))


def assert_state_equal(got, want):
    for name, value in want.items():
        assert torch.equal(got[name], value), name


class FailsAtMessage(EngineClient):
    """Forwards update messages, but makes message ``n`` (from 1) fail inside
    the worker after its bytes were received."""

    def __init__(self, engine, n: int) -> None:
        super().__init__(engine)
        self.n, self.calls = n, 0

    def update_weights(self, update_info):
        self.calls += 1
        if self.calls == self.n:
            originals = (StagedUpdate.load, StagedUpdate.load_planned)

            def failing(session, *args, **kwargs):
                raise RuntimeError("injected failure while staging")

            StagedUpdate.load = failing  # type: ignore[method-assign,assignment]
            StagedUpdate.load_planned = failing  # type: ignore[method-assign,assignment]
            try:
                return super().update_weights(update_info)
            finally:
                StagedUpdate.load, StagedUpdate.load_planned = originals  # type: ignore[method-assign]
        return super().update_weights(update_info)


@pytest.mark.parametrize("at", [1, 2])
def test_a_failure_before_the_commit_keeps_the_old_weights_unfenced(at):
    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    engine = staged_engine(target)
    with pytest.raises(RuntimeError, match="injected failure while staging"):
        trainer_for(FailsAtMessage(engine, at), trainer).send_weights()
    assert_state(target, before)
    status = engine.fence_status
    assert status["state"] != "fenced", status
    assert "injected" in (status["last_failure"] or "")
    assert engine._session is None or not engine._session.is_open
    trainer_for(EngineClient(engine), trainer).send_weights()  # no resync needed
    assert_state(target, state(trainer))


def test_the_trainers_abort_drops_the_staging_unfenced():
    target, before, engine, session = open_update()
    trainer = TinyNet(1)
    session.load([("a.weight", torch.ones(6, 4)), ("a.bias", torch.ones(6))])
    assert session.staged_bytes == (24 + 6) * 4
    engine.update_weights({"abort": "trainer rank 1 died"})
    engine.finish_weight_update()
    assert session.staged_bytes == 0
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"
    trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))


def test_an_update_past_its_deadline_is_dropped_unfenced(monkeypatch):
    target, before, engine, session = open_update(timeout_s=5.0)
    trainer = TinyNet(1)
    session.load([("a.weight", torch.ones(6, 4))])
    session._calls.last_call -= 10.0  # the trainer went silent for 10 s
    with pytest.raises(TimeoutError, match="without a call from the trainer"):
        engine.update_weights({PREPARE_FIELD: "p"})
    assert session.staged_bytes == 0
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"
    engine.finish_weight_update()  # vLLM's Worker still holds it open: closes quietly
    trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))


def test_staging_that_does_not_fit_is_refused_before_it_is_copied(monkeypatch):
    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    engine = staged_engine(target)
    # 100 bytes free: the publication's 136 bytes cannot be staged.
    monkeypatch.setattr(staged_module, "free_bytes", lambda device: 100)
    with pytest.raises(StagingDoesNotFit, match="needs 0.000 GiB of staging"):
        trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"
    monkeypatch.undo()
    trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))


class _CodesStandIn:
    """Stands in for a ``codes_landing.CodesLanding`` (which needs a quantized
    vLLM model): layer ``a``'s tensors land straight in the served ones."""

    def __init__(self, model: TinyNet) -> None:
        self.views = {"a.weight": model.a.weight.data, "a.bias": model.a.bias.data}
        self.names = frozenset(self.views)
        self.nbytes = sum(v.numel() * v.element_size() for v in self.views.values())
        self.landed_at: list[str] = []

    def still_bound(self) -> bool:
        return True

    def slices(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def land_slices(self, name: str, pieces: list[torch.Tensor]) -> None:
        self.landed_at.append(name)
        self.views[name].copy_(pieces[0])

    def land(self, name: str, tensor: torch.Tensor) -> None:
        raise AssertionError("a staged update lands codes at the commit only")

    def check_whole(self, received) -> None:
        pass


def test_fp8_codes_are_staged_and_land_at_the_commit(monkeypatch):
    """Trainer-side FP8 codes in a staged update: only this worker's pieces
    are staged, the old weights serve until the commit, and the commit copies
    the pieces straight into the served tensors (the rest through the
    reload)."""
    from vllm.distributed.weight_transfer.landing import codes as codes_landing

    target, trainer = reload_ready(0), TinyNet(1)
    before = state(target)
    engine = staged_engine(target)
    stand_in = _CodesStandIn(target)
    monkeypatch.setattr(
        codes_landing.CodesLanding, "plan", classmethod(lambda cls, *a, **k: stand_in)
    )
    client = ServingClient(engine)
    trainer_for(client, trainer).send_weights()
    assert client.seen, "no forward ran before the commit"
    for seen in client.seen:
        for name, value in before.items():
            assert torch.equal(seen[name], value), name
    assert sorted(stand_in.landed_at) == ["a.bias", "a.weight"]
    assert_state(target, state(trainer))
    assert engine.fence_status["state"] == "committed"


def test_a_name_sent_twice_is_refused_before_the_commit():
    target, before, _, session = open_update()
    session.load([("a.weight", torch.ones(6, 4))])
    with pytest.raises(ValueError, match="more than once"):
        session.load([("a.weight", torch.zeros(6, 4))])
    assert_state(target, before)


def test_a_layer_lacking_a_tensor_is_refused_before_the_commit():
    """Layers load into their shadows while staging, so a layer the update
    touches without all of its tensors is found at prepare: refused, the old
    weights serving, nothing fenced."""
    target, before, engine, session = open_update()
    session.load(
        [
            ("a.bias", torch.ones(6)),
            ("b.weight", torch.ones(3, 6)),
            ("b.bias", torch.ones(3)),
        ]
    )
    assert session.layers_processed_while_staging == 1  # b, not a
    with pytest.raises(Exception, match="a.weight"):
        engine.finish_weight_update()
    assert engine.fence_status["state"] != "fenced"
    assert_state(target, before)


def test_a_failure_inside_the_commit_fences():
    """The one failure staging cannot undo: the commit itself. Through the
    reload commit (no shadow layers), a layer that lacks a parameter is only
    found by the model's loader, inside the commit."""
    _, _, engine, session = open_update()
    session._shadow = None  # the commit vLLM's layerwise reload runs
    session.load([("a.bias", torch.ones(6)), ("b.weight", torch.ones(3, 6))])
    with pytest.raises(Exception, match="without all of their parameters"):
        engine.finish_weight_update()
    status = engine.fence_status
    assert status["state"] == "fenced", status


def test_a_failure_while_swapping_in_the_shadow_layers_fences(monkeypatch):
    _, _, engine, session = open_update()

    def fail() -> None:
        raise RuntimeError("injected at the swap")

    session.load([(n, torch.ones_like(t)) for n, t in state(engine.model).items()])
    monkeypatch.setattr(session._shadow, "commit", fail)
    with pytest.raises(RuntimeError, match="injected at the swap"):
        engine.finish_weight_update()
    assert engine.fence_status["state"] == "fenced"


def test_twenty_failed_syncs_leave_no_staging_behind():
    target, trainer = reload_ready(0), TinyNet(1)
    engine = staged_engine(target)
    sessions = []
    for _ in range(20):
        with pytest.raises(RuntimeError, match="injected"):
            trainer_for(FailsAtMessage(engine, 2), trainer).send_weights()
        sessions.append(engine._session)
    assert all(getattr(s, "staged_bytes", 0) == 0 for s in sessions)
    assert engine.fence_status["state"] != "fenced"
    trainer_for(EngineClient(engine), trainer).send_weights()
    assert_state(target, state(trainer))


def test_host_staging_lives_in_host_memory_and_device_staging_on_the_model():
    model = reload_ready(0)
    host = StagedUpdate(model, None, where="host", model_device=torch.device("cpu"))
    host.start()
    assert host.stage(torch.ones(3)).device.type == "cpu"
    on_model = StagedUpdate(
        model, None, where="device", model_device=torch.device("cpu")
    )
    assert on_model.device == torch.device("cpu")


def test_weights_after_the_prepare_are_refused_and_nothing_commits():
    target, before, engine, session = open_update()
    session.load([("a.weight", torch.ones(6, 4)), ("a.bias", torch.ones(6))])
    engine.update_weights({PREPARE_FIELD: "p"})
    with pytest.raises(ValueError, match="after the trainer's prepare message"):
        engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
    engine.finish_weight_update()  # the refusal closed the update
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"


def test_a_deadline_between_prepare_and_commit_drops_the_update_unfenced():
    target, before, engine, session = open_update(timeout_s=5.0)
    session.load([("a.weight", torch.ones(6, 4)), ("a.bias", torch.ones(6))])
    engine.update_weights({PREPARE_FIELD: "p"})
    session._calls.last_call -= 10.0  # the trainer went silent before finishing
    with pytest.raises(TimeoutError, match="without a call from the trainer"):
        engine.finish_weight_update()
    assert session.staged_bytes == 0 and not session.is_open
    assert_state(target, before)
    assert engine.fence_status["state"] != "fenced"


def test_the_deadline_does_not_run_while_background_work_does():
    import threading

    model = reload_ready(0)
    update = StagedUpdate(
        model, None, where="host", model_device=torch.device("cpu"), timeout_s=1.0
    )
    update.start()
    release = threading.Event()

    def slow_pull(stop: threading.Event) -> None:
        release.wait(10)

    update.in_background(slow_pull, name="slow-pull")
    update._calls.last_call -= 5.0  # longer than the deadline, but the pull runs
    update.check_deadline("prepare")  # no TimeoutError
    release.set()
    update.prepare()  # waits for the pull, then checks
    assert update.prepared
    update.abort("done")


def test_a_background_failure_is_raised_by_prepare():
    model = reload_ready(0)
    update = StagedUpdate(model, None, where="host", model_device=torch.device("cpu"))
    update.start()

    def pull(stop):
        raise RuntimeError("the producer went away")

    update.in_background(pull, name="failing-pull")
    with pytest.raises(RuntimeError, match="the producer went away"):
        update.prepare()
    update.abort("failed")
    assert not update.is_open


def test_an_engine_whose_staging_cannot_hold_its_weights_refuses_to_start(
    monkeypatch,
):
    """Staging that cannot hold one copy of the worker's weights (204 bytes
    for this model) is refused when the worker engine is created, naming the
    numbers; a staged engine that fits starts."""
    monkeypatch.setattr(staged_module, "free_bytes", lambda device: 100)
    with pytest.raises(StagingDoesNotFit, match="one copy of the weights this"):
        staged_engine(reload_ready(0))
    monkeypatch.setattr(staged_module, "free_bytes", lambda device: 10_000)
    staged_engine(reload_ready(0))  # fits
    off = staged_engine(reload_ready(0), where="off")  # never staged: no check
    assert off.staging == "off"


def test_the_kv_cache_still_to_come_counts_against_staging_at_start():
    """At the engine's creation the KV cache is not allocated yet: the bytes
    vLLM will take for it (``kv_cache_memory_bytes`` here) are not free for
    staging on the same device."""
    model, cpu = reload_ready(0), torch.device("cpu")
    kv = SimpleNamespace(kv_cache_memory_bytes=1_000)
    assert staged_module.reserved_later(cpu, kv) == 1_000
    assert staged_module.reserved_later(cpu, None) == 0
    with pytest.raises(StagingDoesNotFit, match="will still take 0.000 GiB"):
        staged_module.check_staging_fits_at_start(
            "host", model, cpu, kv, free_memory=lambda device: 1_100
        )
    needed = staged_module.check_staging_fits_at_start(
        "host", model, cpu, None, free_memory=lambda device: 1_100
    )
    assert needed == sum(p.numel() * 4 for p in model.parameters()) == 204
