# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A staged ``sharded_rdt`` sync behind ``vllm serve``: dense model, TP 2,
``--weight-transfer-config '{"backend": "sharded_rdt", "staging": "host"}'``,
driven over the RL HTTP routes by a trainer in this process, each worker
pulling its half over NIXL with checksums on.

* While a sync pulls (its source waits before each tensor), completions keep
  being answered with exactly the old weights' output, then the new weights'
  once the commit happened (a request the commit fell inside gives the old
  output up to a token and the new weights' continuation of that prefix),
  never anything else and never back, and
  ``GET /weight_update_status`` names the old version as serving and the new
  publication as open (staged); after the commit it names the new version and
  that publication as committed.
* A byte flipped in transit after its checksum was taken fails the sync
  before the commit: the old weights keep serving with the old version, the
  failed publication is not shown as committed, and the next sync serves the
  trainer's weights (the fresh-load oracle, bit for bit, and Hugging Face's
  fp32 forward).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import requests

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.testing import (
    DEFAULT_PROMPTS,
    GreedyResult,
    TinyModelSpec,
    assert_bit_identical,
    assert_serves_weights,
    build_tiny_model,
)
from vllm.distributed.weight_transfer.testing.oracle import switch_point
from vllm.distributed.weight_transfer.testing.server import ServerProcess, serve

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")


def _status(server: ServerProcess) -> dict[str, Any]:
    answer = requests.get(f"{server.base_url}/weight_update_status", timeout=30)
    answer.raise_for_status()
    return answer.json()


def _publication_id(rank: Any) -> str:
    assert rank.engine.last_publication is not None
    return rank.engine.last_publication.header.publication_id


# What one request answered during a sync saw, in the order they can happen.
_OLD, _MIXED, _NEW = 0, 1, 2


def _versions_seen(
    server: ServerProcess,
    results: list[GreedyResult],
    before: GreedyResult,
    after: GreedyResult,
) -> list[int]:
    """For each request (each prompt of each result, in the order they were
    sent): ``_OLD`` when it is the old weights' output bit for bit, ``_NEW``
    when it is the new weights', ``_MIXED`` when the commit fell inside it
    (the old output up to a token, then the new weights' continuation of that
    prefix); anything else fails."""
    seen = []
    for result in results:
        for i, prompt in enumerate(DEFAULT_PROMPTS):
            got = (result.tokens[i], result.logprobs[i])
            if got == (before.tokens[i], before.logprobs[i]):
                seen.append(_OLD)
            elif got == (after.tokens[i], after.logprobs[i]):
                seen.append(_NEW)
            else:
                k = switch_point(
                    server.base_url, server.model, prompt, got[0], before.tokens[i]
                )
                assert 0 < k < len(got[0]), (k, got, before.tokens[i])
                seen.append(_MIXED)
    return seen


def test_staged_sharded_rdt_over_http_serves_the_old_weights_until_the_commit():
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        TrainerRank,
    )

    model_dir = str(build_tiny_model(TinyModelSpec(arch="qwen3")))
    with serve(
        model_dir,
        weight_transfer_backend="sharded_rdt",
        weight_transfer_options={"staging": "host"},
        tensor_parallel_size=2,
    ) as server:
        oracle = server.fresh_load_oracle()
        rank = TrainerRank(model_dir, rank=0, world=1, port=0)
        rank.init(
            None,
            num_consumers=2,
            verify_checksums=True,
            stall_timeout_s=30.0,
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        )
        try:
            rank.randomize(301)
            rank.send(weight_version="step-301")
            first = _publication_id(rank)
            status = _status(server)
            assert status["weight_version"] == "step-301"
            assert status["staging"] == "host" and status["open"] is None
            assert status["committed"]["publication_id"] == first
            before = server.greedy()

            # A sync whose source waits before each tensor; requests and
            # status calls are answered all the while it pulls.
            rank.randomize(302)
            errors: list[BaseException] = []

            def send_slowly() -> None:
                try:
                    rank.send_slowly(0.1, weight_version="step-302")
                except BaseException as e:  # reported below
                    errors.append(e)

            sending = threading.Thread(target=send_slowly, name="staged-sync")
            sending.start()
            during, statuses = [], []
            while sending.is_alive():
                statuses.append(_status(server))
                during.append(server.greedy())
            sending.join()
            assert not errors, errors
            after = server.greedy()
            assert_serves_weights(oracle, rank.model, dtype="float32")
            second = _publication_id(rank)
            seen = _versions_seen(server, during, before, after)
            assert seen == sorted(seen), f"the served weights went back: {seen}"
            assert seen.count(_MIXED) <= 1, seen
            assert seen.count(_OLD) >= 2 * len(before.tokens), (
                f"the sync should outlast a few requests: {seen}"
            )
            staged = [
                s
                for s in statuses
                if s["open"] is not None and s["open"]["publication_id"] == second
            ]
            assert staged, f"no status call saw the staged publication: {statuses}"
            # While staged, the old version is the one that serves.
            assert all(s["weight_version"] == "step-301" for s in staged), staged
            assert all(s["open"]["backend"] == "sharded_rdt" for s in staged)
            status = _status(server)
            assert status["weight_version"] == "step-302" and status["open"] is None
            assert status["committed"]["publication_id"] == second

            # A fault in transit: refused before the commit, nothing fenced.
            rank.randomize(303)
            rank.flip_byte_after_checksum(seq=1)
            error = rank.send_expecting_failure(weight_version="step-303")
            assert "checksum" in error, error
            status = _status(server)
            assert status["weight_version"] == "step-302", status
            assert status["open"] is None
            assert status["committed"]["publication_id"] == second
            assert_bit_identical(server.greedy(), after, what="after the failed sync")

            rank.send(weight_version="step-303")
            assert_serves_weights(oracle, rank.model, dtype="float32")
            assert _status(server)["weight_version"] == "step-303"
        finally:
            rank.shutdown()
