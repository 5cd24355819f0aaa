# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contracts of the two backend registries and of WeightTransferConfig."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.factory import (
    BackendRegistry,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)


class _Base:
    pass


class _Impl(_Base):
    pass


def test_lazy_registration_imports_on_first_lookup():
    reg: BackendRegistry = BackendRegistry("worker", object)
    reg.register("od", "collections", "OrderedDict")
    from collections import OrderedDict

    assert reg.resolve("od") is OrderedDict


def test_direct_class_registration():
    reg: BackendRegistry = BackendRegistry("worker", _Base)
    reg.register("impl", _Impl)
    assert reg.resolve("impl") is _Impl


def test_duplicate_name_is_rejected():
    reg: BackendRegistry = BackendRegistry("worker", _Base)
    reg.register("impl", _Impl)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("impl", _Impl)


def test_module_path_without_class_name_is_rejected():
    reg: BackendRegistry = BackendRegistry("worker", _Base)
    with pytest.raises(ValueError, match="class_name"):
        reg.register("x", "some.module")


def test_class_that_is_not_an_engine_is_rejected():
    reg: BackendRegistry = BackendRegistry("worker", _Base)
    with pytest.raises(TypeError, match="subclass of _Base"):
        reg.register("x", int)
    reg.register("lazy", "collections", "OrderedDict")
    with pytest.raises(TypeError, match="subclass of _Base"):
        reg.resolve("lazy")


def test_missing_class_in_module_names_both():
    reg: BackendRegistry = BackendRegistry("worker", _Base)
    reg.register("x", "collections", "NoSuchThing")
    with pytest.raises(ValueError, match="'collections' has no class 'NoSuchThing'"):
        reg.resolve("x")


def test_unknown_backend_error_lists_available_ones():
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend.*'ipc'"):
        WeightTransferEngineFactory.get_engine_class("no-such-backend")
    with pytest.raises(ValueError, match=r"Available trainer engines: \[.*'nccl'"):
        WeightTransferTrainerFactory.get_engine_class("no-such-backend")


def test_trainer_init_dispatches_on_init_info_backend():
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
    try:
        info = EchoInitInfo(rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(
            info,
            client="client",  # type: ignore[arg-type]
            source=None,
        )
        assert isinstance(engine, EchoTrainer)
        assert calls == [(info, "client", None)]
    finally:
        WeightTransferTrainerFactory._registry.unregister("test_echo")


def test_trainer_init_rejects_objects_without_a_backend():
    with pytest.raises(TypeError, match="TrainerInitInfo subclass"):
        WeightTransferTrainerFactory.trainer_init(
            object(),  # type: ignore[arg-type]
            client=None,  # type: ignore[arg-type]
        )


def test_config_accepts_builtin_and_plugin_names():
    assert WeightTransferConfig(backend="ipc").backend == "ipc"
    assert WeightTransferConfig(backend="my_plugin").backend == "my_plugin"
    assert WeightTransferConfig().backend == "nccl"


def test_config_rejects_an_empty_backend():
    with pytest.raises(ValueError, match="non-empty backend name"):
        WeightTransferConfig(backend=" ")
