# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contracts of the two backend registries and of WeightTransferConfig, in the
shapes upstream 0.32 callers use."""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)


@pytest.fixture
def worker_registry(monkeypatch):
    """The worker factory's registry, restored after the test."""
    registry = dict(WeightTransferEngineFactory._registry)
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", registry)
    return registry


@pytest.fixture
def trainer_registry(monkeypatch):
    registry = dict(WeightTransferTrainerFactory._registry)
    monkeypatch.setattr(WeightTransferTrainerFactory, "_registry", registry)
    return registry


class _Impl:
    """Not a WeightTransferEngine subclass: registration is duck-typed, as upstream."""


def test_lazy_registration_imports_on_first_lookup(worker_registry):
    WeightTransferEngineFactory.register_engine("od", "collections", "OrderedDict")
    from collections import OrderedDict

    assert WeightTransferEngineFactory.get_engine_class("od") is OrderedDict


def test_direct_class_registration_accepts_any_class(worker_registry):
    WeightTransferEngineFactory.register_engine("impl", _Impl)
    assert WeightTransferEngineFactory.get_engine_class("impl") is _Impl


def test_registry_is_a_dict_of_loaders(worker_registry):
    """The shapes upstream callers use: ``[name]()``, ``in``, keys, iteration,
    ``dict()``, and a saved copy put back."""
    registry = WeightTransferEngineFactory._registry
    assert isinstance(registry, dict)
    assert "ipc" in registry and "sharded_rdt" in list(registry.keys())
    assert set(dict(registry)) == set(registry) == set(iter(registry))
    assert registry["nccl"]().__name__ == "NCCLWeightTransferEngine"
    saved = dict(registry)
    WeightTransferEngineFactory.register_engine("impl", _Impl)
    WeightTransferEngineFactory._registry = saved
    assert "impl" not in WeightTransferEngineFactory.available_backends()
    WeightTransferEngineFactory.register_engine("impl", _Impl)
    assert saved["impl"]() is _Impl


def test_duplicate_name_is_rejected(worker_registry, trainer_registry):
    with pytest.raises(ValueError, match="'ipc' is already registered"):
        WeightTransferEngineFactory.register_engine("ipc", _Impl)
    with pytest.raises(ValueError, match="'ipc' is already registered"):
        WeightTransferTrainerFactory.register_engine("ipc", _Impl)


def test_module_path_without_class_name_is_rejected(worker_registry):
    with pytest.raises(ValueError, match="class_name is required"):
        WeightTransferEngineFactory.register_engine("x", "some.module")


def test_missing_class_in_module_names_both(worker_registry):
    WeightTransferEngineFactory.register_engine("x", "collections", "NoSuchThing")
    with pytest.raises(AttributeError, match="'collections' has no class 'NoSuch"):
        WeightTransferEngineFactory.get_engine_class("x")


def test_unknown_backend_error_lists_available_ones():
    with pytest.raises(
        ValueError,
        match=r"Invalid weight transfer backend: no-such-backend\. "
        r"Available engines: \[.*'ipc'",
    ):
        WeightTransferEngineFactory.get_engine_class("no-such-backend")
    with pytest.raises(ValueError, match=r"Available trainer engines: \[.*'nccl'"):
        WeightTransferTrainerFactory.get_engine_class("no-such-backend")


def test_trainer_init_dispatches_on_init_info_backend(trainer_registry):
    calls = []

    @dataclass
    class EchoInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = "test_echo"

    class EchoTrainer(TrainerWeightTransferEngine):
        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            calls.append((init_info, client, source))
            return cls(client=client, source=source)

        def send_weights(self) -> None:
            pass

    WeightTransferTrainerFactory.register_engine("test_echo", EchoTrainer)
    info = EchoInitInfo(rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(
        info,
        client="client",  # type: ignore[arg-type]
        source=None,
    )
    assert isinstance(engine, EchoTrainer)
    # init_info travels by keyword, as upstream passes it.
    assert calls == [(info, "client", None)]


def test_trainer_init_accepts_a_duck_typed_init_info(trainer_registry):
    class Recorder:
        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            return (cls, init_info.backend, client)

    WeightTransferTrainerFactory.register_engine("test_duck", Recorder)
    info = SimpleNamespace(backend="test_duck", rank=0)
    assert WeightTransferTrainerFactory.trainer_init(
        init_info=info,
        client="c",  # type: ignore[arg-type]
    ) == (Recorder, "test_duck", "c")


def test_trainer_init_rejects_objects_without_a_backend():
    with pytest.raises(TypeError, match="string `backend`"):
        WeightTransferTrainerFactory.trainer_init(
            object(),
            client=None,  # type: ignore[arg-type]
        )


def test_config_accepts_builtin_and_plugin_names():
    assert WeightTransferConfig(backend="ipc").backend == "ipc"
    assert WeightTransferConfig(backend="my_plugin").backend == "my_plugin"
    assert WeightTransferConfig().backend == "nccl"


def test_an_empty_backend_fails_when_the_engine_is_created():
    config = WeightTransferConfig(backend="")
    with pytest.raises(ValueError, match="Invalid weight transfer backend"):
        WeightTransferEngineFactory.get_engine_class(config.backend)
