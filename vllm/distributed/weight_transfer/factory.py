# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Name -> engine-class registries for both sides of a weight transfer.

`WeightTransferEngineFactory` builds the worker-side engine named by
`WeightTransferConfig.backend`; `WeightTransferTrainerFactory` builds the trainer-side
engine named by the trainer init info's ``backend``. A backend is registered either by
module path and class name, imported on first use so that unused backends (and their
optional dependencies) cost nothing, or directly by class.

Each factory's ``_registry`` is what upstream code reads: a plain ``dict`` from
backend name to a loader, where ``_registry[name]()`` returns the engine class.
Code that copies it (``dict(_registry)``), iterates it, or puts a saved copy back
keeps working, because the factories only ever use it as a mapping.
"""

from __future__ import annotations

# Upstream's tests reach ``importlib`` through this module and patch its
# ``import_module`` (which common.registry calls) to see what a lookup imports.
import importlib  # noqa: F401
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from vllm.distributed.weight_transfer.base import (
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.common.messages import MessageKind
from vllm.distributed.weight_transfer.common.registry import (
    NameRegistry,
    import_attribute,
)
from vllm.distributed.weight_transfer.worker.handlers import register_message_handler
from vllm.logger import init_logger

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig, WeightTransferConfig

logger = init_logger(__name__)

_PACKAGE = "vllm.distributed.weight_transfer"

E = TypeVar("E")


def _lazy_loader(module_path: str, class_name: str) -> Callable[[], Any]:
    """A loader that imports ``module_path`` when called and returns its
    ``class_name``."""

    def missing() -> AttributeError:
        return AttributeError(
            f"weight transfer backend module {module_path!r} has no class "
            f"{class_name!r}"
        )

    return lambda: import_attribute(module_path, class_name, missing)


class _EngineFactory(Generic[E]):
    """Register, list and look up engine classes by backend name in the
    subclass's own ``_registry``; ``_what`` and ``_available`` word its
    errors."""

    _registry: dict[str, Callable[[], type[E]]]
    _what: str
    _available: str

    @classmethod
    def _names(cls) -> NameRegistry[Callable[[], type[E]]]:
        return NameRegistry(
            cls._registry,
            taken=lambda name: f"{cls._what} '{name}' is already registered.",
            unknown=lambda name, known: (
                f"Invalid weight transfer backend: {name}. {cls._available}: {known}"
            ),
        )

    @classmethod
    def register_engine(
        cls,
        name: str,
        module_path_or_cls: str | type,
        class_name: str | None = None,
    ) -> None:
        """Register a backend by ``(module_path, class_name)`` (imported on first
        use) or by class. Registering a taken name raises `ValueError`."""
        names = cls._names()
        names.check_free(name)
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError(
                    "class_name is required when registering with module path "
                    f"({name!r} -> {module_path_or_cls!r})"
                )
            names.add(name, _lazy_loader(module_path_or_cls, class_name))
            return
        if class_name is not None:
            raise ValueError(
                f"class_name={class_name!r} is only valid when registering "
                f"{name!r} by module path"
            )
        engine_cls = module_path_or_cls
        names.add(name, lambda: engine_cls)

    @classmethod
    def available_backends(cls) -> list[str]:
        return cls._names().names()

    @classmethod
    def get_engine_class(cls, name: str) -> type[E]:
        return cls._names().get(name)()


class WeightTransferEngineFactory(_EngineFactory[WeightTransferEngine]):
    """Worker side: creates the engine that receives weights inside a vLLM worker.

    An engine class is anything constructed as ``cls(config, vllm_config, device,
    model)``; subclassing `WeightTransferEngine` is the usual way, not a
    requirement."""

    _registry: dict[str, Callable[[], type[WeightTransferEngine]]] = {}

    _what = "Weight transfer engine"
    _available = "Available engines"

    @classmethod
    def create_engine(
        cls,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> WeightTransferEngine:
        engine_cls = cls.get_engine_class(config.backend)
        logger.info(
            "Creating weight transfer engine %r (%s.%s)",
            config.backend,
            getattr(engine_cls, "__module__", "?"),
            getattr(engine_cls, "__qualname__", engine_cls),
        )
        return engine_cls(config, vllm_config, device, model)


class WeightTransferTrainerFactory(_EngineFactory[TrainerWeightTransferEngine]):
    """Trainer side: builds the engine that sends weights, chosen by
    ``init_info.backend``.

    An engine class is anything with a ``trainer_init(init_info=..., client=...,
    source=...)`` classmethod; subclassing `TrainerWeightTransferEngine` is the
    usual way, not a requirement."""

    _registry: dict[str, Callable[[], type[TrainerWeightTransferEngine]]] = {}

    _what = "Weight transfer trainer engine"
    _available = "Available trainer engines"

    @classmethod
    def trainer_init(
        cls,
        init_info: Any,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TrainerWeightTransferEngine:
        """Build a ready-to-send trainer engine on this rank.

        ``init_info`` is usually a `TrainerInitInfo` subclass, whose ``backend``
        class attribute names the engine; any object with a string ``backend``
        attribute is accepted. Every trainer rank calls this; the engine decides
        from ``init_info.rank`` whether this rank also drives the control plane.
        """
        backend = getattr(init_info, "backend", None)
        if not isinstance(backend, str):
            raise TypeError(
                "init_info needs a string `backend` naming a trainer engine (a "
                "TrainerInitInfo subclass sets it as a class attribute), got "
                f"{type(init_info).__name__} with backend={backend!r}"
            )
        engine_cls = cls.get_engine_class(backend)
        return engine_cls.trainer_init(
            init_info=init_info, client=client, source=source
        )


# Built-in backends: (name, worker module, worker class, trainer module, trainer class).
# A backend without a trainer engine in vLLM has None for the trainer side.
BUILTIN_BACKENDS: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("nccl", "nccl_engine", "NCCLWeightTransferEngine",
     "nccl_engine", "NCCLTrainerWeightTransferEngine"),
    ("ipc", "ipc.worker", "IPCWeightTransferEngine",
     "ipc.trainer", "IPCTrainerWeightTransferEngine"),
    ("sparse_nccl", "sparse_nccl_engine", "SparseNCCLWeightTransferEngine",
     "sparse_nccl_engine", "SparseNCCLTrainerWeightTransferEngine"),
    ("sharded_rdt", "sharded_rdt.worker", "ShardedRDTWeightTransferEngine",
     "sharded_rdt.trainer", "ShardedRDTTrainerWeightTransferEngine"),
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
# LoRA adapter pushes: trainer side only (any ipc or sharded_rdt engine with
# enable_lora takes them; lora/trainer.py).
WeightTransferTrainerFactory.register_engine(
    "lora", f"{_PACKAGE}.lora.trainer", "LoRATrainerWeightTransferEngine"
)

# Message kinds the worker lifecycle hands to a feature (``worker.handlers``).
register_message_handler(
    MessageKind.ADAPTER, f"{_PACKAGE}.lora.worker_handler", "AdapterMessages"
)
