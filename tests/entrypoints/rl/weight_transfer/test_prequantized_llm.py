# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine serving a pre-quantized checkpoint, updated by a trainer that
quantizes: compressed-tensors W8A8 int8 (weights int8 per output channel,
activations int8 per token), which vLLM CPU serves through its int8 oneDNN
GEMM.

The engine never quantizes weights itself, so the trainer sends int8 codes
and their scales in the checkpoint's names (``int8_codes.Int8ChannelCodes``)
through ``ipc`` (offline, TP 1 and 2, and a MoE model at TP 1 whose
attention is int8 and whose experts stay in bfloat16, vLLM CPU having no
int8 MoE backend) and ``sharded_rdt`` (``vllm serve`` over NIXL, staged,
TP 1). After every sync the engine must serve, bit for bit
(greedy tokens and logprobs), what the same engine serves when it loads a
checkpoint holding the same codes and scales (``testing.fresh_load``). A
push of what the engine already holds must change nothing: before the fork's
fix (``layerwise_session._hook_handles_over_processed_tensors``) such a push
left every int8 layer's oneDNN handle reading the freed weight scale of
vLLM's reload, and the engine served token 0 without an error. Full
precision for an int8 layer and scales of the wrong shape are refused before
anything lands.
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
from vllm.distributed.weight_transfer.quant.int8 import (
    Int8ChannelCodes,
    Int8TensorCodes,
    read_static_activations,
)
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
from vllm.distributed.weight_transfer.testing.int8_checkpoint import (
    save_int8_checkpoint,
    static_input_scales,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    served_weight_dtypes,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

pytestmark = pytest.mark.slow

# An int8 layer in every engine below (a MoE layer's MLP is its experts).
QUANTIZED = "model.layers.0.self_attn.o_proj.weight"
# A MoE checkpoint with int8 attention: vLLM CPU has no int8 MoE backend, so
# the experts and their router stay in the model's dtype.
FULL_PRECISION_EXPERTS = ("re:.*mlp\\.experts.*", "re:.*mlp\\.gate$")
# The trainer's codes source for each weight strategy of the checkpoint.
CODES = {"channel": Int8ChannelCodes, "tensor": Int8TensorCodes}


def _kernels(worker: Any) -> dict[str, str]:
    """For ``collective_rpc``: each linear layer's int8 kernel class."""
    model = worker.model_runner.model
    return {
        name: type(module.scheme.kernel).__name__
        for name, module in model.named_modules()
        if getattr(getattr(module, "scheme", None), "kernel", None) is not None
    }


@pytest.fixture(
    scope="module",
    params=[
        (1, "channel", "qwen3"),
        (2, "channel", "qwen3"),
        (2, "tensor", "qwen3"),
        (1, "channel", "qwen3_moe"),
    ],
    ids=["tp1", "tp2", "tp2-per-tensor", "moe-tp1"],
)
def int8_engine(request, tmp_path_factory):
    """An int8 engine, the tiny model's folder, the trainer's model, and the
    codes source for the checkpoint's strategy (per channel, or per tensor:
    one scale per shard of a fused layer). The MoE engine serves int8
    attention with full-precision experts (``FULL_PRECISION_EXPERTS``)."""
    tp, strategy, arch = request.param
    ignore = FULL_PRECISION_EXPERTS if arch == "qwen3_moe" else ()
    with pytest.MonkeyPatch.context() as env:
        if tp == 2:
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        else:
            env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        # collective_rpc(fn) pickles the function (reads the served kernels).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        base = build_tiny_model(TinyModelSpec(arch=arch))
        trainer_model = load_hf_model(base, "float32")

        def codes() -> WeightSource:
            return CODES[strategy](ModuleSource(trainer_model))

        def fresh_load(oracle: FreshLoadOracle) -> Any:
            with tempfile.TemporaryDirectory(prefix="int8-oracle-") as tmp:
                checkpoint = save_int8_checkpoint(
                    base, codes(), tmp, strategy=strategy, ignore=ignore
                )
                return oracle.from_checkpoint(checkpoint)

        checkpoint = save_int8_checkpoint(
            base,
            codes(),
            tmp_path_factory.mktemp(f"int8-tp{tp}-{strategy}-{arch}"),
            strategy=strategy,
            ignore=ignore,
        )
        llm = tiny_llm(
            checkpoint,
            dtype="bfloat16",
            tensor_parallel_size=tp,
            backend="ipc",
            in_process=True,
        )
        try:
            yield llm, trainer_model, tp, codes, fresh_load
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def _trainer(llm: Any, source: WeightSource) -> Any:
    return WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=OfflineLLMWeightSyncClient(llm),
        source=source,
    )


def test_ipc_updates_an_int8_w8a8_engine_exactly_like_a_fresh_load(int8_engine):
    llm, trainer_model, tp, codes, fresh_load = int8_engine
    if tp == 1:
        # At TP>1 a failed collective_rpc(fn) leaves stale replies behind
        # (see test_ipc_llm.py); one rank shows the checkpoint is int8.
        (dtypes,) = llm.collective_rpc(served_weight_dtypes)
        assert dtypes[QUANTIZED.replace(".weight", ".weight_scale")] == (
            "torch.float32"
        )
        (kernels,) = llm.collective_rpc(_kernels)
        assert set(kernels.values()) == {"CPUInt8ScaledMMLinearKernel"}, kernels
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    trainer = _trainer(llm, codes())

    # The codes the engine started from, pushed again: nothing changes.
    llm.reset_prefix_cache()
    before = vllm_greedy(llm)
    trainer.send_weights()
    llm.reset_prefix_cache()
    assert_bit_identical(vllm_greedy(llm), before, what="after a no-op int8 push")

    served: list[Any] = []
    for seed in (41, 42):  # two syncs, the trainer's weights changed in place
        randomize_weights_(trainer_model, seed=seed)
        trainer.send_weights()
        llm.reset_prefix_cache()
        got = vllm_greedy(llm)
        assert_bit_identical(
            got, fresh_load(oracle), what=f"vLLM after int8 sync {len(served) + 1}"
        )
        served.append(got)
    assert served[0].tokens != served[1].tokens, "both syncs served the same"
    assert before.tokens != served[0].tokens


class _FullPrecisionLayer(WeightSource):
    """Int8 codes for every linear layer but one, sent in full precision."""

    def __init__(self, codes: WeightSource, model: torch.nn.Module) -> None:
        self.codes = codes
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        full = dict(self.model.named_parameters())[QUANTIZED]
        return [
            ParamMeta(QUANTIZED, full.dtype, tuple(full.shape))
            if m.name == QUANTIZED
            else m
            for m in self.codes.metadata()
            if m.name != QUANTIZED + "_scale"
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        full = dict(self.model.named_parameters())[QUANTIZED]
        for name, tensor in self.codes:
            if name == QUANTIZED:
                yield name, full.detach()
            elif name != QUANTIZED + "_scale":
                yield name, tensor


class _WrongScaleShape(WeightSource):
    """Int8 codes with one layer's scale of a shape no strategy has (two
    values)."""

    def __init__(self, codes: WeightSource, model: torch.nn.Module) -> None:
        self.codes = codes

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, m.dtype, (2, 1)) if m.name == QUANTIZED + "_scale" else m
            for m in self.codes.metadata()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.codes:
            yield (
                name,
                tensor.amax().expand(2, 1).clone()
                if name.endswith(QUANTIZED + "_scale")
                else tensor,
            )


@pytest.mark.parametrize(
    "bad, message",
    [
        (_FullPrecisionLayer, r"o_proj\.weight as float32 \(served model: int\)"),
        (_WrongScaleShape, r"o_proj\.weight_scale \[2, 1\] \(served model: "),
    ],
    ids=["full-precision-weight", "per-tensor-scale"],
)
def test_bad_input_to_an_int8_engine_is_refused_before_it_lands(
    int8_engine, bad, message
):
    llm, trainer_model, _, codes, fresh_load = int8_engine
    llm.reset_prefix_cache()
    before = vllm_greedy(llm)
    with pytest.raises(Exception, match=message):
        _trainer(llm, bad(codes(), trainer_model)).send_weights()
    llm.reset_prefix_cache()
    assert_bit_identical(vllm_greedy(llm), before, what="after a refused push")
    # The next sync works.
    randomize_weights_(trainer_model, seed=43)
    _trainer(llm, codes()).send_weights()
    llm.reset_prefix_cache()
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    assert_bit_identical(
        vllm_greedy(llm), fresh_load(oracle), what="the sync after a refused push"
    )


class _WithoutOneScale(WeightSource):
    """Int8 codes with one layer's weight scale left out: the worker lands
    every other layer, then refuses the update at its finish."""

    def __init__(self, codes: WeightSource) -> None:
        self.codes = codes

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self.codes.metadata() if m.name != QUANTIZED + "_scale"]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.codes:
            if name != QUANTIZED + "_scale":
                yield name, tensor


def test_an_int8_update_refused_after_landing_keeps_the_engine_serving(
    int8_engine,
):
    """vLLM CPU's int8 kernel leaves ``weight`` registered as None once it has
    processed a layer; vLLM's reload put a layer back unprocessed without
    that name, and the next forward pass raised ``AttributeError``, which
    stopped the engine. Here every layer but one lands, the update is
    refused at its finish (one layer lacks its scale), the engine is fenced
    and keeps generating, and the next whole sync (which a fenced worker
    accepts only as a complete publication) serves the fresh load."""
    llm, trainer_model, _, codes, fresh_load = int8_engine
    randomize_weights_(trainer_model, seed=44)
    with pytest.raises(Exception, match=r"lacks .*o_proj\.weight_scale"):
        _trainer(llm, _WithoutOneScale(codes())).send_weights()
    assert llm.get_weight_version().startswith("fenced:")
    llm.reset_prefix_cache()
    vllm_greedy(llm)  # generates (a mixed model, fenced): the engine runs
    _trainer(llm, codes()).send_weights()
    llm.reset_prefix_cache()
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    assert_bit_identical(
        vllm_greedy(llm), fresh_load(oracle), what="the sync after a fenced one"
    )


def test_an_int8_engine_with_static_activation_scales_refuses_updates(tmp_path):
    """A W8A8 int8 checkpoint with static (calibrated) activation scales: vLLM
    CPU serves it, but after vLLM processes such a layer a second time the
    worker aborts with a heap corruption (vLLM's own ``reload_weights`` too).
    An update, with the checkpoint's scales sent along
    (``read_static_activations``), is refused before anything lands, naming
    the cause; the engine keeps serving the checkpoint, unfenced."""
    base = build_tiny_model(TinyModelSpec(arch="qwen3"))
    trainer_model = load_hf_model(base, "float32")
    calibration = torch.randint(
        0, 200, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    scales = static_input_scales(trainer_model, calibration)
    checkpoint = save_int8_checkpoint(
        base,
        Int8ChannelCodes(ModuleSource(trainer_model), static_activations=scales),
        tmp_path / "int8-static",
        activations="static",
    )
    llm = tiny_llm(checkpoint, dtype="bfloat16", backend="ipc", in_process=True)
    try:
        before = vllm_greedy(llm)
        version = llm.get_weight_version()
        randomize_weights_(trainer_model, seed=45)
        source = Int8ChannelCodes(
            ModuleSource(trainer_model),
            static_activations=read_static_activations(checkpoint),
        )
        with pytest.raises(Exception, match="static activation scales"):
            _trainer(llm, source).send_weights()
        assert llm.get_weight_version() == version
        llm.reset_prefix_cache()
        assert_bit_identical(vllm_greedy(llm), before, what="after a refused push")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def test_vllm_serve_int8_engine_updated_by_sharded_rdt_like_a_fresh_load(
    tmp_path,
):
    """``vllm serve`` on the int8 checkpoint with ``sharded_rdt`` over NIXL,
    driven over the RL HTTP routes with checksums on and staging (the pulls
    are staged while the server serves, then committed in one call, through
    vLLM's reload of the int8 layers): a no-op push changes nothing, and after
    each of two syncs the server serves, bit for bit, what it serves after
    loading a checkpoint of the same codes fresh."""
    pytest.importorskip("nixl")
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
        ShardedRDTTrainerInitInfo,
        ShardedRDTTrainerWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.testing.server import serve
    from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

    base = build_tiny_model(TinyModelSpec(arch="qwen3"))
    trainer_model = load_hf_model(base, "float32")

    def codes() -> Int8ChannelCodes:
        return Int8ChannelCodes(CheckpointNamesSource(trainer_model))

    checkpoint = save_int8_checkpoint(base, codes(), tmp_path / "int8")
    with serve(
        checkpoint,
        dtype="bfloat16",
        weight_transfer_backend="sharded_rdt",
        weight_transfer_options={"staging": "host"},
    ) as server:
        trainer = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=1, stall_timeout_s=60.0, verify_checksums=True, rank=0
            ),
            client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
            source=codes(),
        )
        assert isinstance(trainer, ShardedRDTTrainerWeightTransferEngine)
        oracle = server.fresh_load_oracle()
        try:
            before = server.greedy()
            trainer.send_weights()  # the codes the server started from
            assert_bit_identical(server.greedy(), before, what="after a no-op push")
            served = []
            for seed in (44, 45):
                randomize_weights_(trainer_model, seed=seed)
                trainer.send_weights()
                assert trainer.last_publication is not None
                verified = trainer.last_publication.verified
                assert verified is not None and verified.checksums_verified > 0
                got = server.greedy()
                with tempfile.TemporaryDirectory(prefix="int8-oracle-") as tmp:
                    expected = oracle.from_checkpoint(
                        save_int8_checkpoint(base, codes(), tmp)
                    )
                assert_bit_identical(got, expected, what=f"vLLM after sync {seed}")
                served.append(got)
            assert served[0].tokens != served[1].tokens, "both syncs served the same"
        finally:
            trainer.shutdown()
