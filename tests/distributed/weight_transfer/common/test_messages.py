# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``common.messages``: the one rule that says what an ``update_weights``
body asks of the workers, which the guard, the sync metrics and the worker
engines all read."""

from __future__ import annotations

import pytest

from vllm.distributed.weight_transfer.common.messages import (
    ADAPTER_KEY,
    MessageKind,
    UnclassifiableUpdate,
    classify_update,
    expected_messages,
    message_kind,
    update_kind,
    worker_index,
)

WEIGHTS = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]}


@pytest.mark.parametrize(
    "message, kind",
    [
        (WEIGHTS, MessageKind.WEIGHTS),
        ({}, MessageKind.WEIGHTS),
        ({"abort": "why"}, MessageKind.ABORT),
        # A malformed abort or prepare is still of that kind: the worker
        # refuses it, and no weight lands from it.
        ({"abort": "why", "names": []}, MessageKind.ABORT),
        ({"prepare": "p" * 8, **WEIGHTS}, MessageKind.PREPARE),
        ({ADAPTER_KEY: {}, **WEIGHTS}, MessageKind.ADAPTER),
        ({"abort": "x", ADAPTER_KEY: {}}, MessageKind.ABORT),
        (None, MessageKind.MALFORMED),
        ([WEIGHTS], MessageKind.MALFORMED),
        ("weights", MessageKind.MALFORMED),
    ],
)
def test_each_message_has_one_kind_in_the_workers_order(message, kind):
    assert message_kind(message) is kind


def test_one_message_per_worker_of_one_kind_is_that_kind():
    assert classify_update(WEIGHTS, workers=4) is MessageKind.WEIGHTS
    assert classify_update([WEIGHTS, WEIGHTS], workers=2) is MessageKind.WEIGHTS
    abort = {"abort": "x"}
    assert classify_update([abort, abort], workers=2) is MessageKind.ABORT


@pytest.mark.parametrize(
    "update_info, cause",
    [
        ([WEIGHTS, {"abort": "decoy"}], r"mixes message kinds .*\[1\] abort"),
        ([WEIGHTS, {"prepare": "p" * 8}], r"\[0\] weights, \[1\] prepare"),
        ([WEIGHTS, {ADAPTER_KEY: {}}], r"\[1\] adapter"),
        ([WEIGHTS, WEIGHTS, WEIGHTS], "list of 3 messages but the server runs 2"),
        ([], "list of 0 messages"),
        ([WEIGHTS, 5], r"update_info\[1\] is a int, not a JSON object"),
        ("weights", "update_info is a str"),
    ],
)
def test_a_body_workers_would_read_differently_is_unclassifiable(update_info, cause):
    with pytest.raises(UnclassifiableUpdate, match=cause):
        classify_update(update_info, workers=2)
    assert update_kind(update_info) in (MessageKind.MALFORMED, MessageKind.WEIGHTS)


def test_update_kind_never_raises_and_skips_the_length():
    assert update_kind([WEIGHTS, {"abort": "x"}]) is MessageKind.MALFORMED
    assert update_kind([WEIGHTS, WEIGHTS, WEIGHTS]) is MessageKind.WEIGHTS


def test_the_element_a_worker_reads_is_vllms_rule():
    assert worker_index(data_parallel_index=1, world_size=4, rank=2) == 6


def test_expected_messages_counts_every_worker_of_every_replica():
    from types import SimpleNamespace

    across = SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=6))
    assert expected_messages(across) == 6
    parts = SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=2, data_parallel_size=3)
    )
    assert expected_messages(parts) == 6
    assert expected_messages(SimpleNamespace()) == 1


def test_the_vocabulary_is_the_one_the_workers_use():
    from vllm.distributed.weight_transfer.lora import wire as lora_adapters
    from vllm.distributed.weight_transfer.verification import fence

    assert lora_adapters.ADAPTER_KEY == ADAPTER_KEY
    assert fence.abort_reason({"abort": "why"}) == "why"
    assert fence.is_prepare_request({"prepare": "p" * 8})
