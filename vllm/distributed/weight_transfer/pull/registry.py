# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Transports by name: the one place that maps a transport name to the code
that makes its consumer side (`ConsumerTransport`) and its producer side
(`ProducerServer`).

Each transport registers a module path and the names of two factories in
that module, a consumer factory taking `ConsumerSettings` and a server
factory taking `ServerSettings`. The module is imported on first lookup, so
registering imports neither NIXL nor Ray.

"auto" is not a transport; it resolves to one by these rules:

* a worker (`resolve_consumer_transport`): "rdt" under vLLM's Ray executor
  when the trainer spawned Ray producer actors; else, with producer
  endpoints, "inprocess" when every endpoint is in-process and "nixl"
  otherwise; else "rdt" when there are actor names; with neither, an error;
* a trainer (`resolve_server_transport`): "nixl".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.weight_transfer.common.registry import (
    NameRegistry,
    import_attribute,
)
from vllm.distributed.weight_transfer.pull.routing import PRODUCE_METHOD_NAME

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.pull.transport import (
        ConsumerTransport,
        ProducerServer,
    )

AUTO = "auto"


@dataclass(frozen=True)
class ConsumerSettings:
    """What a consumer factory may use; each transport reads its own."""

    consumer_id: int
    stall_timeout_s: float
    namespace: str | None = None  # Ray namespace of the producer actors
    produce_method_name: str = PRODUCE_METHOD_NAME


@dataclass(frozen=True)
class ServerSettings:
    """What a server factory may use; each transport reads its own."""

    producer_kwargs: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"  # the address consumers reach a NIXL producer at
    namespace: str | None = None  # Ray namespace of the producer actor
    max_concurrency: int = 1  # calls the producer actor serves at once


@dataclass(frozen=True)
class TransportEntry:
    """One registered transport. ``actor_endpoints``: its producers are
    reached by Ray actor name (the init info's ``trainer_actor_names``)
    rather than by ``producer_endpoints``. ``preflight``: the name of a
    function in the module, called before a worker plans anything with this
    transport (None: nothing to check)."""

    name: str
    module_path: str
    consumer: str
    server: str
    actor_endpoints: bool = False
    preflight: str | None = None

    def _load(self, attr: str) -> Any:
        return import_attribute(
            self.module_path,
            attr,
            lambda: ImportError(
                f"transport {self.name!r}: module {self.module_path!r} has no {attr!r}"
            ),
        )

    def consumer_factory(self) -> Callable[[ConsumerSettings], ConsumerTransport]:
        return self._load(self.consumer)

    def server_factory(self) -> Callable[[ServerSettings], ProducerServer]:
        return self._load(self.server)

    def check_ready(self) -> None:
        if self.preflight is not None:
            self._load(self.preflight)()


_TRANSPORTS: dict[str, TransportEntry] = {}


def _unknown_transport(name: str, names: list[str]) -> str:
    known = ", ".join(repr(n) for n in names)
    return (
        f"unknown sharded_rdt transport {name!r}; known transports: {known} "
        f"(or {AUTO!r}, which resolves to one of them)"
    )


_NAMES = NameRegistry(
    _TRANSPORTS,
    taken=lambda name: f"transport {name!r} is already registered",
    unknown=_unknown_transport,
)


def register_transport(entry: TransportEntry) -> None:
    """Register a transport under ``entry.name``: the path of its module and
    the names of its factories there; nothing is imported until a lookup."""
    if entry.name == AUTO:
        raise ValueError(f"{AUTO!r} names the resolution rule, not a transport")
    _NAMES.add(entry.name, entry)


def transport_names() -> list[str]:
    return _NAMES.names()


def transport_entry(name: str) -> TransportEntry:
    """The entry registered under ``name``; a ValueError that lists the known
    names when there is none."""
    return _NAMES.get(name)


def make_consumer(name: str, settings: ConsumerSettings) -> ConsumerTransport:
    return transport_entry(name).consumer_factory()(settings)


def make_server(name: str, settings: ServerSettings) -> ProducerServer:
    return transport_entry(name).server_factory()(settings)


def resolve_consumer_transport(
    requested: str,
    *,
    executor: Any,
    actor_names: Sequence[str],
    endpoints: Sequence[Any],
) -> str:
    """The transport a worker uses; see the module docstring for "auto"."""
    if requested != AUTO:
        return requested
    if executor == "ray" and actor_names:
        return "rdt"
    if endpoints:
        if all(e.get("transport") == "inprocess" for e in endpoints):
            return "inprocess"
        return "nixl"
    if actor_names:
        return "rdt"
    raise ValueError(
        "sharded_rdt init_info names no producers (trainer_actor_names and "
        "producer_endpoints are empty); pass the trainer's "
        "get_worker_init_payload()"
    )


def resolve_server_transport(requested: str) -> str:
    """The transport a trainer serves its producers over; "auto" is NIXL."""
    return "nixl" if requested == AUTO else requested


_PULL = "vllm.distributed.weight_transfer.pull"
register_transport(
    TransportEntry(
        "inprocess",
        f"{_PULL}.transport",
        consumer="inprocess_consumer",
        server="inprocess_server",
    )
)
register_transport(
    TransportEntry(
        "nixl", f"{_PULL}.nixl", consumer="nixl_consumer", server="nixl_server"
    )
)
register_transport(
    TransportEntry(
        "rdt",
        f"{_PULL}.ray",
        consumer="rdt_consumer",
        server="rdt_server",
        actor_endpoints=True,
        preflight="check_ray_rdt_version",
    )
)
