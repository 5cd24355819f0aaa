# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The import paths upstream callers use keep their public names after the
fork's code moved into packages. The lists were captured from each module
before the move (classes and functions defined there, upper-case constants,
and ``__all__``); a kept path may gain names, never lose one."""

import importlib

import pytest

KEPT_NAMES = {
    "ipc_engine": [
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
        "DEFAULT_TIMEOUT_S",
        "IPCTrainerInitInfo",
        "IPCTrainerWeightTransferEngine",
        "IPCWeightTransferEngine",
        "IPCWeightTransferInitInfo",
        "IPCWeightTransferUpdateInfo",
    ],
    "sharded_rdt_engine": [
        "ShardedRDTWeightTransferEngine",
        "ShardedRDTWeightTransferInitInfo",
        "ShardedRDTWeightTransferUpdateInfo",
        "choose_transport",
        "make_consumer_transport",
        "planned_bytes",
    ],
    "sharded_rdt_trainer": [
        "DEFAULT_GATHER_LOOKAHEAD",
        "DEFAULT_NUM_RDT_BUFFERS",
        "DEFAULT_RECEIPT_TIMEOUT_S",
        "DEFAULT_STALL_TIMEOUT_S",
        "PRODUCE_METHOD_NAME",
        "ShardedRDTTrainerInitInfo",
        "ShardedRDTTrainerWeightTransferEngine",
        "TRANSPORTS",
        "metadata_digest",
        "ownership_table",
    ],
    "sharded_rdt_common": [
        "ALLOWED_OPS",
        "DEFAULT_GATHER_LOOKAHEAD",
        "DEFAULT_NUM_RDT_BUFFERS",
        "DEFAULT_STALL_TIMEOUT_S",
        "PRODUCE_METHOD_NAME",
        "RDT_MIN_RAY_VERSION",
        "RdtRouter",
        "SUPPORTED_OPS",
        "ShardedRDTWeightTransferInitInfo",
        "ShardedRDTWeightTransferUpdateInfo",
        "TRANSPORTS",
        "VIEW_OPS",
        "assign_producer_indices",
        "buffer_alloc_bytes",
        "check_ray_rdt_version",
        "register_nixl_memory",
        "serve_share_key",
    ],
    "factory": [
        "BUILTIN_BACKENDS",
        "WeightTransferEngineFactory",
        "WeightTransferTrainerFactory",
    ],
    "clients": [
        "COMMIT_HOLD_HEADER",
        "COMMIT_HOLD_VALUE",
        "DEFAULT_TIMEOUT_S",
        "HTTPVLLMWeightSyncClient",
        "OfflineLLMWeightSyncClient",
        "RayVLLMWeightSyncClient",
        "WeightSyncReadTimeout",
    ],
}


@pytest.mark.parametrize("module", sorted(KEPT_NAMES))
def test_a_kept_import_path_still_has_every_public_name(module):
    mod = importlib.import_module(f"vllm.distributed.weight_transfer.{module}")
    missing = [n for n in KEPT_NAMES[module] if not hasattr(mod, n)]
    assert missing == [], f"{module} lost {missing}"


# Private names upstream 0.32's own tests import from (or patch on) the kept
# paths.
UPSTREAM_TESTS_IMPORT = {
    "sharded_rdt_engine": ["_dtype_from_name"],
    "factory": ["importlib"],
}


@pytest.mark.parametrize("module", sorted(UPSTREAM_TESTS_IMPORT))
def test_a_kept_path_keeps_what_upstream_tests_import(module):
    mod = importlib.import_module(f"vllm.distributed.weight_transfer.{module}")
    missing = [n for n in UPSTREAM_TESTS_IMPORT[module] if not hasattr(mod, n)]
    assert missing == [], f"{module} lost {missing}"


def test_the_sharded_rdt_messages_are_one_class_on_every_kept_path():
    from vllm.distributed.weight_transfer import (
        sharded_rdt_common,
        sharded_rdt_engine,
    )
    from vllm.distributed.weight_transfer.sharded_rdt import wire

    for name in (
        "ShardedRDTWeightTransferInitInfo",
        "ShardedRDTWeightTransferUpdateInfo",
    ):
        assert getattr(sharded_rdt_common, name) is getattr(wire, name)
        assert getattr(sharded_rdt_engine, name) is getattr(wire, name)
