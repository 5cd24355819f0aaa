# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The parts of ``LayerwiseReloadSession`` that need no vLLM model: the update
deadline, duplicate names, and the untouched model before the first weights.
(Landing itself is tested end to end on real engines.)"""

import time
from typing import Any

import pytest
import torch

from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.landing.layerwise import LayerwiseReloadSession


def session(timeout_s=None, aborts=None) -> LayerwiseReloadSession:
    model = torch.nn.Linear(2, 2)
    s = LayerwiseReloadSession(
        model,
        None,
        on_abort=(lambda r, landed: aborts.append((r, landed)))
        if aborts is not None
        else None,
        timeout_s=timeout_s,
    )
    s.start()
    return s


def test_an_update_without_weights_never_touches_the_model():
    s = session()
    weight = s.model.weight
    s.finish()
    assert s.model.weight is weight and not s.is_open


def test_an_update_idle_past_its_deadline_is_aborted_with_the_reason():
    aborts: list = []
    s = session(timeout_s=0.01, aborts=aborts)
    time.sleep(0.05)
    with pytest.raises(TimeoutError, match="update_timeout_s=0.01"):
        s.finish()
    assert not s.is_open
    assert aborts and not aborts[0][1]  # nothing had landed
    with pytest.raises(RuntimeError, match="was aborted"):
        s.load([("weight", torch.zeros(2, 2))])


def test_a_name_repeated_within_one_message_is_refused_before_loading():
    s = session()
    w = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="'weight' more than once"):
        s.load([("weight", w), ("bias", w[0]), ("weight", w)])
    assert not s.landing


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError, match="update_timeout_s"):
        WeightTransferConfig(backend="ipc", update_timeout_s=0)


def test_direct_writes_count_as_landed_and_forward_passes_abort_them():
    """``writing_served``: copies bound to served tensors (``sharded_rdt``'s
    planned landing) touch the model without moving a layer aside, so an
    update past its deadline reports the model touched, and a forward pass
    during them aborts the update as it would during a reload."""
    aborts: list = []
    s = session(timeout_s=0.01, aborts=aborts)
    s.writing_served()
    assert s.touched_model and not s.landing
    time.sleep(0.05)
    with pytest.raises(TimeoutError):
        s.finish()
    assert aborts and aborts[0][1]  # served tensors had been written

    aborts.clear()
    s = session(aborts=aborts)
    s.writing_served()
    s.model(torch.zeros(1, 2))  # generation not paused
    assert not s.is_open
    assert aborts and "forward pass" in aborts[0][0] and aborts[0][1]
    s.start()
    s.writing_served()
    s.finish()  # the guard goes with the session
    s.model(torch.zeros(1, 2))
    assert not s.is_open and len(aborts) == 1


def test_layers_outside_a_partial_update_keep_their_weights_without_warnings():
    """vLLM warns "Failed to load weights" for every layer a reload did not
    reach; in the fork's updates those layers are left out by design (landed
    by a plan, in a shadow, or unchanged), so the warnings are dropped."""
    import logging

    from ..ipc.worker_rig import reload_ready

    model = reload_ready(0)
    kept = model.b.weight.detach().clone()
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    reload_logger = logging.getLogger(
        "vllm.model_executor.model_loader.reload.layerwise"
    )
    handler = Collect(level=logging.DEBUG)
    reload_logger.addHandler(handler)
    try:
        s = LayerwiseReloadSession(model, None)
        s.start()
        s.load([("a.weight", torch.ones(6, 4)), ("a.bias", torch.ones(6))])
        s.finish()
    finally:
        reload_logger.removeHandler(handler)
    assert torch.equal(model.a.weight, torch.ones(6, 4))
    assert torch.equal(model.b.weight, kept)
    assert not [r for r in records if "Failed to load weights" in r.getMessage()]


def test_parameters_registered_as_none_are_put_back_when_the_session_closes():
    """vLLM CPU's int8 kernel leaves ``weight`` registered as None; vLLM's
    reload keeps aside only the tensors that are set, so a layer it put back
    unprocessed lost the name and its next forward raised. The session notes
    such names before the layers move aside and registers them again."""
    s = session()
    s.model.register_parameter("weight_packed", None)
    s._note_empty_slots()
    del s.model._parameters["weight_packed"]  # what putting the layer back does
    s.abort("test")
    assert "weight_packed" in s.model._parameters
    assert s.model.weight_packed is None


def test_static_activation_int8_layers_are_named_as_unreloadable():
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer.landing.layerwise import (
        UnreloadableLayersError,
        refuse_unreloadable_layers,
        unreloadable_layers,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUInt8ScaledMMLinearKernel,
    )

    def layer(static: bool) -> torch.nn.Module:
        kernel: Any = object.__new__(CPUInt8ScaledMMLinearKernel)
        kernel.config = SimpleNamespace(is_static_input_scheme=static)
        module = torch.nn.Linear(2, 2)
        module.__dict__["scheme"] = SimpleNamespace(kernel=kernel)
        return module

    model = torch.nn.Module()
    model.dynamic = layer(static=False)
    model.static = layer(static=True)
    assert unreloadable_layers(model) == ["static"]
    refuse_unreloadable_layers([])
    with pytest.raises(
        UnreloadableLayersError, match=r"1 layer\(s\) \(first: static\)"
    ):
        refuse_unreloadable_layers(unreloadable_layers(model))
