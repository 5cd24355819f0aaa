# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The transport registry: names, lookups, the "auto" rule, lazy imports."""

import subprocess
import sys

import pytest

from vllm.distributed.weight_transfer.pull.registry import (
    ConsumerSettings,
    TransportEntry,
    make_consumer,
    register_transport,
    resolve_consumer_transport,
    resolve_server_transport,
    transport_entry,
    transport_names,
)
from vllm.distributed.weight_transfer.pull.transport import InProcessTransport


def test_known_names_and_unknown_lookup_lists_them():
    assert transport_names() == ["inprocess", "nixl", "rdt"]
    with pytest.raises(ValueError, match="'inprocess', 'nixl', 'rdt'"):
        transport_entry("carrier-pigeon")
    with pytest.raises(ValueError, match="unknown sharded_rdt transport 'auto'"):
        transport_entry("auto")
    with pytest.raises(ValueError, match="already registered"):
        register_transport(TransportEntry("nixl", "x", consumer="a", server="b"))


def test_entries_and_factories():
    assert transport_entry("rdt").actor_endpoints
    assert not transport_entry("nixl").actor_endpoints
    made = make_consumer("inprocess", ConsumerSettings(0, 1.0))
    assert isinstance(made, InProcessTransport)


def test_auto_rule():
    nixl = [{"transport": "nixl"}]
    local = [{"transport": "inprocess"}]
    resolve = resolve_consumer_transport
    assert resolve("nixl", executor="ray", actor_names=["a"], endpoints=[]) == "nixl"
    assert resolve("auto", executor="ray", actor_names=["a"], endpoints=nixl) == "rdt"
    assert resolve("auto", executor="mp", actor_names=["a"], endpoints=nixl) == "nixl"
    assert resolve("auto", executor="mp", actor_names=[], endpoints=local) == (
        "inprocess"
    )
    assert resolve("auto", executor="mp", actor_names=["a"], endpoints=[]) == "rdt"
    with pytest.raises(ValueError, match="names no producers"):
        resolve("auto", executor="mp", actor_names=[], endpoints=[])
    assert resolve_server_transport("auto") == "nixl"
    assert resolve_server_transport("rdt") == "rdt"


def test_registering_imports_neither_nixl_nor_ray():
    code = (
        "import sys\n"
        "import vllm.distributed.weight_transfer.pull.registry as r\n"
        "r.transport_names()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'nixl')\n"
        "       or m.endswith(('pull.nixl', 'pull.ray'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
