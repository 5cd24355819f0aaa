# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Name -> engine-class registries for both sides of a weight transfer.

`WeightTransferEngineFactory` builds the worker-side engine named by
`WeightTransferConfig.backend`; `WeightTransferTrainerFactory` builds the trainer-side
engine named by `TrainerInitInfo.backend`. A backend is registered either by module
path and class name, imported on first use so that unused backends (and their
optional dependencies) cost nothing, or directly by class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig, WeightTransferConfig

logger = init_logger(__name__)

EngineT = TypeVar("EngineT")

_PACKAGE = "vllm.distributed.weight_transfer"


class BackendRegistry(Generic[EngineT]):
    """Maps backend names to engine classes, importing lazily registered ones on
    first lookup and caching the result."""

    def __init__(self, side: str, base: type) -> None:
        self.side = side
        self.base = base
        self._loaders: dict[str, Callable[[], type[EngineT]]] = {}
        self._resolved: dict[str, type[EngineT]] = {}

    def names(self) -> list[str]:
        return sorted(self._loaders)

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def register(
        self,
        name: str,
        module_path_or_cls: str | type[EngineT],
        class_name: str | None = None,
    ) -> None:
        if name in self._loaders:
            raise ValueError(
                f"{self.side} weight transfer engine {name!r} is already registered"
            )
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError(
                    f"registering {name!r} by module path "
                    f"{module_path_or_cls!r} also needs class_name"
                )
            self._loaders[name] = self._lazy_loader(
                name, module_path_or_cls, class_name
            )
            return
        if class_name is not None:
            raise ValueError(
                f"class_name={class_name!r} is only valid when registering {name!r} "
                "by module path"
            )
        cls = module_path_or_cls
        self._check_subclass(name, cls)
        self._loaders[name] = lambda: cls

    def unregister(self, name: str) -> None:
        """Remove a backend (tests and plugins that replace a built-in)."""
        self._loaders.pop(name, None)
        self._resolved.pop(name, None)

    def resolve(self, name: str) -> type[EngineT]:
        if name not in self._loaders:
            raise ValueError(
                f"Invalid weight transfer backend: {name!r}. Available "
                f"{self.side} engines: {self.names()}"
            )
        cls = self._resolved.get(name)
        if cls is None:
            cls = self._loaders[name]()
            self._resolved[name] = cls
        return cls

    def _lazy_loader(
        self, name: str, module_path: str, class_name: str
    ) -> Callable[[], type[EngineT]]:
        def load() -> type[EngineT]:
            module = importlib.import_module(module_path)
            try:
                cls = getattr(module, class_name)
            except AttributeError as e:
                raise ValueError(
                    f"weight transfer backend {name!r}: module {module_path!r} "
                    f"has no class {class_name!r}"
                ) from e
            self._check_subclass(name, cls)
            return cls

        return load

    def _check_subclass(self, name: str, cls: object) -> None:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(
                f"{self.side} weight transfer backend {name!r} must be a subclass "
                f"of {self.base.__name__}, got {cls!r}"
            )


class _FactoryBase(Generic[EngineT]):
    """Class-level registration and lookup shared by both factories."""

    _registry: BackendRegistry[EngineT]

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type[EngineT],
        class_name: str | None = None,
    ) -> None:
        """Register a backend by ``(module_path, class_name)`` (imported on first
        use) or by class. Registering a taken name raises `ValueError`."""
        cls._registry.register(name, module_path_or_cls, class_name)

    @classmethod
    def available_backends(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_engine_class(cls, name: str) -> type[EngineT]:
        return cls._registry.resolve(name)


class WeightTransferEngineFactory(_FactoryBase[WeightTransferEngine]):
    """Worker side: creates the engine that receives weights inside a vLLM worker."""

    _registry = BackendRegistry("worker", WeightTransferEngine)

    @classmethod
    def create_engine(
        cls,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> WeightTransferEngine:
        engine_cls = cls._registry.resolve(config.backend)
        logger.info(
            "Creating weight transfer engine %r (%s.%s)",
            config.backend,
            engine_cls.__module__,
            engine_cls.__qualname__,
        )
        return engine_cls(config, vllm_config, device, model)


class WeightTransferTrainerFactory(_FactoryBase[TrainerWeightTransferEngine]):
    """Trainer side: builds the engine that sends weights, chosen by
    ``init_info.backend``."""

    _registry = BackendRegistry("trainer", TrainerWeightTransferEngine)

    @classmethod
    def trainer_init(
        cls,
        init_info: TrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine:
        """Build a ready-to-send trainer engine on this rank.

        Every trainer rank calls this; the engine decides from ``init_info.rank``
        whether this rank also drives the control plane.
        """
        backend = getattr(type(init_info), "backend", None)
        if not isinstance(backend, str):
            raise TypeError(
                "init_info must be a TrainerInitInfo subclass with a `backend` "
                f"class attribute, got {type(init_info).__name__}"
            )
        engine_cls = cls._registry.resolve(backend)
        return engine_cls.trainer_init(init_info, client=client, source=source)


# Built-in backends: (name, worker module, worker class, trainer module, trainer class).
# A backend without a trainer engine in vLLM has None for the trainer side.
BUILTIN_BACKENDS: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("nccl", "nccl_engine", "NCCLWeightTransferEngine",
     "nccl_engine", "NCCLTrainerWeightTransferEngine"),
    ("ipc", "ipc_engine", "IPCWeightTransferEngine",
     "ipc_engine", "IPCTrainerWeightTransferEngine"),
    ("sparse_nccl", "sparse_nccl_engine", "SparseNCCLWeightTransferEngine",
     "sparse_nccl_engine", "SparseNCCLTrainerWeightTransferEngine"),
    ("sharded_rdt", "sharded_rdt_engine", "ShardedRDTWeightTransferEngine",
     "sharded_rdt_trainer", "ShardedRDTTrainerWeightTransferEngine"),
    ("nccl_m2n", "m2n_engine", "M2NWeightTransferEngine",
     "m2n_trainer", "M2NTrainerWeightTransferEngine"),
    ("modelexpress", "modelexpress_engine", "ModelExpressWeightTransferEngine",
     None, None),
)  # fmt: skip

for _name, _wmod, _wcls, _tmod, _tcls in BUILTIN_BACKENDS:
    WeightTransferEngineFactory.register_engine(_name, f"{_PACKAGE}.{_wmod}", _wcls)
    if _tmod is not None:
        WeightTransferTrainerFactory.register_engine(
            _name, f"{_PACKAGE}.{_tmod}", _tcls
        )
