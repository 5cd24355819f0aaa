# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Online FP8 quantization through ``vllm serve --quantization
fp8_per_channel``: a trainer in this process updates the server over the RL
HTTP routes, through ``ipc`` and through ``sharded_rdt`` (NIXL pulls), both at
TP 1 and both staging their updates, so every update is proven through a
staged commit.

After every sync of the trainer's float32 weights (the commit quantizes them)
the server serves bit for bit what the same server serves after loading the
trainer's weights fresh from a checkpoint with its quantization; the layers
stay quantized. A trainer that sends FP8 codes (``Fp8ChannelCodes``) gets the
same oracle, its codes staged and copied into the served codes at the commit.
Weights holding a NaN are answered with a ``500`` naming the served weight
version, and the resync serves the oracle from its first completions; scales
of NaN or below zero pulled over ``sharded_rdt`` are refused as they are
pulled, leaving the server unfenced and serving the last good sync.

Each test starts its own server. ``test_quantized_llm.py`` proves the same in
an offline engine at TP 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import WeightSource
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.quant.fp8 import Fp8ChannelCodes
from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_bit_identical,
    build_tiny_model,
    load_hf_model,
    randomize_weights_,
)
from vllm.distributed.weight_transfer.testing.fp8_sources import (
    NAN_WEIGHT,
    QUANTIZATION,
    BadScale,
    assert_quantized,
    codes_digests,
    codes_or_skip,
    send_codes_or_skip,
)

pytestmark = pytest.mark.slow


def test_vllm_serve_fp8_engine_updated_over_http_like_a_fresh_load():
    """``vllm serve --quantization fp8_per_channel`` updated over the RL HTTP
    routes through ``ipc`` with staging (``"staging": "host"``: each sync is
    staged, then committed in one call): after each of two syncs (the
    trainer's weights changed in place) the server serves, bit for bit, what
    the same server serves after loading the trainer's weights fresh from a
    checkpoint, with its quantization (the commit quantizes); a no-op push
    changes nothing; a trainer that sends FP8 codes (``Fp8ChannelCodes``)
    gets the same oracle, its pieces staged and copied into the served codes
    at the commit."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
    from vllm.distributed.weight_transfer.testing.server import serve

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    with serve(
        model_dir,
        dtype="bfloat16",
        weight_transfer_backend="ipc",
        weight_transfer_options={"staging": "host"},
        extra_args=["--quantization", QUANTIZATION],
    ) as server:
        call = http_worker_call(server.base_url)

        def served_dtypes() -> dict[str, str]:
            (dtypes,) = call("served_weight_dtypes", [])["results"]
            return dtypes

        assert_quantized(served_dtypes())
        trainer_model = load_hf_model(model_dir, "float32")
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=ModuleSource(trainer_model),
        )
        oracle = server.fresh_load_oracle()
        served = []
        for seed in (35, 36):
            randomize_weights_(trainer_model, seed=seed)
            trainer.send_weights()
            served.append(oracle.assert_serves(trainer_model))
        assert served[0].tokens != served[1].tokens, "both syncs served the same"
        trainer.send_weights()  # the weights it already holds
        assert_bit_identical(server.greedy(), served[-1], what="after a no-op push")
        assert_quantized(served_dtypes())
        nan_weights_answer_500_and_the_resync_serves_at_once(
            server, trainer, trainer_model, served[-1]
        )
        trainer.shutdown()
        # The trainer quantizes: codes and scales over the same routes land
        # straight in the served codes, and the fresh-load oracle holds.
        codes = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=Fp8ChannelCodes(ModuleSource(trainer_model)),
        )
        randomize_weights_(trainer_model, seed=37)
        send_codes_or_skip(codes)
        oracle.assert_serves(trainer_model)
        (state,) = call("fp8_codes_state", [])["results"]
        assert len(state["layers"]) == 4 * trainer_model.config.num_hidden_layers
        assert_quantized(served_dtypes())
        codes.shutdown()


def test_vllm_serve_fp8_engine_updated_by_sharded_rdt_like_a_fresh_load():
    """``vllm serve --quantization fp8_per_channel`` with ``sharded_rdt``: the
    trainer's full-precision weights are pulled over NIXL, driven over the RL
    HTTP routes with checksums on and staging (the pulls are staged while the
    server serves, then committed in one call); after each of two syncs the
    server serves the fresh-load oracle of the trainer's weights bit for bit,
    every worker's receipt came back, and the layers stay quantized. Then the
    trainer sends FP8 codes: staged, then copied into the served codes at the
    commit, the same oracle."""
    pytest.importorskip("nixl")
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
        ShardedRDTTrainerInitInfo,
        ShardedRDTTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
    from vllm.distributed.weight_transfer.testing.server import serve
    from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    trainer_model = load_hf_model(model_dir, "float32")
    with serve(
        model_dir,
        dtype="bfloat16",
        weight_transfer_backend="sharded_rdt",
        weight_transfer_options={"staging": "host"},
        extra_args=["--quantization", QUANTIZATION],
    ) as server:
        call = http_worker_call(server.base_url)
        (dtypes,) = call("served_weight_dtypes", [])["results"]
        assert_quantized(dtypes)
        trainer = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=1, stall_timeout_s=60.0, verify_checksums=True, rank=0
            ),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=CheckpointNamesSource(trainer_model),
        )
        assert isinstance(trainer, ShardedRDTTrainerWeightTransferEngine)
        oracle = server.fresh_load_oracle()
        try:
            served = []
            for seed in (38, 39):
                randomize_weights_(trainer_model, seed=seed)
                trainer.send_weights()
                assert trainer.last_publication is not None
                verified = trainer.last_publication.verified
                assert verified is not None and verified.workers == (0,)
                assert verified.checksums_verified > 0
                served.append(oracle.assert_serves(trainer_model))
            assert served[0].tokens != served[1].tokens, "both syncs served the same"
            (dtypes,) = call("served_weight_dtypes", [])["results"]
            assert_quantized(dtypes)
        finally:
            trainer.shutdown()

        # The trainer quantizes: the worker pulls codes and scales (about
        # half the linear layers' bytes) and copies them straight into the
        # served codes; the fresh-load oracle of the full-precision weights
        # holds, as for worker-side quantization.
        def codes_trainer(source: WeightSource) -> Any:
            """A ``sharded_rdt`` trainer of ``source``'s codes, its plan sent
            to the server (skips where this CPU's FP8 kernel takes none)."""
            return codes_or_skip(
                lambda: WeightTransferTrainerFactory.trainer_init(
                    ShardedRDTTrainerInitInfo(
                        num_consumers=1,
                        stall_timeout_s=60.0,
                        verify_checksums=True,
                        rank=0,
                    ),
                    client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
                    source=source,
                )
            )

        codes = codes_trainer(Fp8ChannelCodes(CheckpointNamesSource(trainer_model)))
        try:
            for seed in (40, 41):
                randomize_weights_(trainer_model, seed=seed)
                send_codes_or_skip(codes)
                oracle.assert_serves(trainer_model)
            (state,) = call("fp8_codes_state", [])["results"]
            assert state["digests"] == codes_digests(trainer_model)
            assert_quantized(call("served_weight_dtypes", [])["results"][0])
        finally:
            codes.shutdown()
        bad_scales_pulled_over_sharded_rdt_are_refused_unfenced(
            server, trainer_model, codes_trainer
        )


def bad_scales_pulled_over_sharded_rdt_are_refused_unfenced(
    server: Any, trainer_model: torch.nn.Module, codes_trainer: Callable[..., Any]
) -> None:
    """Over ``vllm serve`` with ``sharded_rdt`` and staging: codes whose
    ``q_proj.weight_scale`` holds a NaN, or is negated, after the trainer's
    own check are refused by the worker as it pulls them, naming the scale.
    The staged update is dropped, so the server is not fenced and serves
    exactly what the last good sync served (``trainer_model`` as it is on
    entry); the next good codes sync serves the new oracle."""
    import copy

    import requests

    from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource
    from vllm.distributed.weight_transfer.verification import is_fenced_version

    oracle = server.fresh_load_oracle()
    last_good = copy.deepcopy(trainer_model)
    # New weights with the bad scale: anything of them that landed would show.
    randomize_weights_(trainer_model, seed=42)
    for value in (float("nan"), -1.0):
        bad = codes_trainer(BadScale(CheckpointNamesSource(trainer_model), value))
        try:
            with pytest.raises(Exception) as refused:
                bad.send_weights(weight_version=f"bad-scale-{value}")
        finally:
            bad.shutdown()
        assert f"{NAN_WEIGHT}_scale" in str(refused.value), refused.value
        version = requests.get(f"{server.base_url}/weight_info", timeout=30).json()
        assert not is_fenced_version(version["weight_version"]), version
        oracle.assert_serves(last_good, what=f"after a refused scale of {value}")
    good = codes_trainer(Fp8ChannelCodes(CheckpointNamesSource(trainer_model)))
    try:
        send_codes_or_skip(good)
    finally:
        good.shutdown()
    oracle.assert_serves(trainer_model, what="the codes sync after the bad scales")


def nan_weights_answer_500_and_the_resync_serves_at_once(
    server: Any, trainer: Any, trainer_model: torch.nn.Module, expected: Any
) -> None:
    """Over HTTP: after a sync of weights holding a NaN, a completion is a
    ``500`` naming the served weight version (the output holds NaN, which
    JSON cannot carry; the request is not at fault); the sync that puts the
    weights back serves ``expected`` from its very first completions (no
    prefix-cache reset of the test's own in between)."""
    import requests

    from vllm.distributed.weight_transfer.testing.oracle import completions_greedy

    weight = dict(trainer_model.named_parameters())[NAN_WEIGHT]
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    trainer.send_weights()
    answer = requests.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": server.model,
            "prompt": [1, 17, 93, 255],
            "max_tokens": 2,
            "temperature": 0.0,
            "logprobs": 0,
        },
        timeout=60,
    )
    assert answer.status_code == 500, answer.text
    message = answer.json()["error"]["message"]
    assert "weight_version" in message and "served weights" in message, message
    with torch.no_grad():
        weight.copy_(kept)
    trainer.send_weights()
    assert_bit_identical(
        completions_greedy(server.base_url, server.model),
        expected,
        what="the first completions after the resync from NaN weights",
    )
