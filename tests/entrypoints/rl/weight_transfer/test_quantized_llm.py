# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Worker-side online quantization: a full-precision trainer updates an engine
that quantizes its weights as it loads them.

The engine runs a dense model in bfloat16 with ``quantization=
"fp8_per_channel"``, the online scheme vLLM CPU can run: every linear layer is
served as float8 (e4m3) codes with one float32 scale per output channel. The
trainer sends its float32 weights unchanged; each worker lands them in
checkpoint format and vLLM's per-layer processing quantizes them, as it does at
start-up. After every sync the engine must serve bit for bit what the same
engine serves when it loads the trainer's weights fresh from a checkpoint
(``testing.fresh_load`` builds that model with the engine's own quantization),
for ``ipc`` at TP 1 and 2 and ``sharded_rdt`` at TP 1. There is no Hugging
Face comparison: the served model is the quantized one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.testing import (
    FreshLoadOracle,
    TinyModelSpec,
    assert_bit_identical,
    build_tiny_model,
    load_hf_model,
    offline_worker_call,
    randomize_weights_,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    served_weight_dtypes,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

pytestmark = pytest.mark.slow

QUANTIZATION = "fp8_per_channel"
# A linear layer the scheme quantizes and a layer it leaves alone.
QUANTIZED = "model.layers.0.mlp.down_proj.weight"
UNQUANTIZED = "model.norm.weight"


def _assert_quantized(dtypes: dict[str, str]) -> None:
    assert dtypes[QUANTIZED] == "torch.float8_e4m3fn", dtypes[QUANTIZED]
    assert dtypes[UNQUANTIZED] == "torch.bfloat16", dtypes[UNQUANTIZED]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ipc_engine(request):
    tp = request.param
    with pytest.MonkeyPatch.context() as env:
        if tp == 2:
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        else:
            env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        # collective_rpc(fn) pickles the function (reads the served dtypes).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
        llm = tiny_llm(
            model_dir,
            dtype="bfloat16",
            tensor_parallel_size=tp,
            backend="ipc",
            quantization=QUANTIZATION,
        )
        try:
            yield llm, model_dir, tp
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def test_ipc_updates_an_fp8_engine_exactly_like_a_fresh_load(ipc_engine):
    llm, model_dir, tp = ipc_engine
    if tp == 1:
        # At TP>1 a failed collective_rpc(fn) leaves stale replies behind
        # (see test_ipc_llm.py); one rank shows the scheme is active.
        for dtypes in llm.collective_rpc(served_weight_dtypes):
            _assert_quantized(dtypes)
    trainer_model = load_hf_model(model_dir, "float32")
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=OfflineLLMWeightSyncClient(llm),
        source=ModuleSource(trainer_model),
    )
    served: list[Any] = []
    for seed in (31, 32):  # two syncs, the trainer's weights changed in place
        randomize_weights_(trainer_model, seed=seed)
        trainer.send_weights()
        llm.reset_prefix_cache()
        served.append(oracle.assert_serves(trainer_model))
    assert served[0].tokens != served[1].tokens, "both syncs served the same"
    # Pushing the weights the engine already holds changes nothing: each
    # layer is quantized again from the landed weights, not twice.
    trainer.send_weights()
    llm.reset_prefix_cache()
    assert_bit_identical(vllm_greedy(llm), served[-1], what="after a no-op push")
    if tp == 1:
        for dtypes in llm.collective_rpc(served_weight_dtypes):
            _assert_quantized(dtypes)


class Float8Codes(WeightSource):
    """The trainer's weights, one quantized linear layer's weight sent as
    float8 codes: trainer-side quantization without the checkpoint's format
    or scales."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.inner = ModuleSource(module)

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, torch.float8_e4m3fn, m.shape)
            if m.name == QUANTIZED
            else m
            for m in self.inner.metadata()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner:
            yield name, tensor.to(torch.float8_e4m3fn) if name == QUANTIZED else tensor


def test_float8_codes_for_an_engine_that_quantizes_on_load_are_refused(ipc_engine):
    """The engine's checkpoint is bfloat16, so it expects full precision: codes
    cast to bfloat16 would load meaningless weights. Refused before anything
    lands, naming the tensor and the format; the next sync works."""
    llm, model_dir, _ = ipc_engine
    trainer_model = load_hf_model(model_dir, "float32")
    client = OfflineLLMWeightSyncClient(llm)
    llm.reset_prefix_cache()
    before = vllm_greedy(llm)
    codes = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=Float8Codes(trainer_model)
    )
    with pytest.raises(
        Exception, match=r"down_proj.weight as float8_e4m3fn \(served model: float\)"
    ):
        codes.send_weights()
    llm.reset_prefix_cache()
    assert_bit_identical(vllm_greedy(llm), before, what="after refused float8 codes")

    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=ModuleSource(trainer_model)
    ).send_weights()
    llm.reset_prefix_cache()
    oracle.assert_serves(trainer_model)


def test_sharded_rdt_updates_an_fp8_engine_exactly_like_a_fresh_load():
    ray = pytest.importorskip("ray")
    pytest.importorskip("nixl")
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        TrainerRank,
    )

    model_dir = str(build_tiny_model(TinyModelSpec(arch="qwen3")))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        llm = ray.remote(num_cpus=0)(LLMHost).remote(
            model_dir, tp=1, dtype="bfloat16", quantization=QUANTIZATION
        )
        (dtypes,) = ray.get(llm.weight_dtypes.remote())
        _assert_quantized(dtypes)
        rank = ray.remote(num_cpus=0)(TrainerRank).remote(model_dir, 0, 1, 0)
        ray.get(rank.init.remote(llm, num_consumers=1))
        served = []
        for seed in (33, 34):
            ray.get(rank.randomize.remote(seed))
            ray.get(rank.send.remote())
            ray.get(llm.reset_prefix_cache.remote())
            got = ray.get(llm.greedy.remote())
            with tempfile.TemporaryDirectory(prefix="fresh-load-") as checkpoint:
                ray.get(rank.save_checkpoint.remote(checkpoint))
                expected = ray.get(llm.fresh_load_greedy.remote(checkpoint))
            assert_bit_identical(got, expected, what=f"vLLM after sync {seed}")
            served.append(got)
        assert served[0].tokens != served[1].tokens, "both syncs served the same"
        (dtypes,) = ray.get(llm.weight_dtypes.remote())
        _assert_quantized(dtypes)
        ray.get(rank.shutdown.remote())
    finally:
        ray.shutdown()


def test_vllm_serve_fp8_engine_updated_over_http_like_a_fresh_load():
    """``vllm serve --quantization fp8_per_channel`` updated over the RL HTTP
    routes through ``ipc``: after each of two syncs (the trainer's weights
    changed in place) the server serves, bit for bit, what the same server
    serves after loading the trainer's weights fresh from a checkpoint, with
    its quantization; a no-op push changes nothing."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
    from vllm.distributed.weight_transfer.testing.server import serve

    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    with serve(
        model_dir,
        dtype="bfloat16",
        weight_transfer_backend="ipc",
        extra_args=["--quantization", QUANTIZATION],
    ) as server:
        call = http_worker_call(server.base_url)

        def served_dtypes() -> dict[str, str]:
            (dtypes,) = call("served_weight_dtypes", [])["results"]
            return dtypes

        _assert_quantized(served_dtypes())
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
        _assert_quantized(served_dtypes())
        trainer.shutdown()
