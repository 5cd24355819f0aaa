# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Online FP8 quantization in an offline engine (``LLM``): a full-precision
trainer updates an engine that quantizes its weights as it loads them.

The engine runs a dense model in bfloat16 with ``quantization=
"fp8_per_channel"``, the online scheme vLLM CPU can run: every linear layer is
served as float8 (e4m3) codes with one float32 scale per output channel. The
trainer sends its float32 weights unchanged; each worker lands them in
checkpoint format and vLLM's per-layer processing quantizes them, as it does at
start-up. After every sync the engine must serve bit for bit what the same
engine serves when it loads the trainer's weights fresh from a checkpoint
(``testing.fresh_load`` builds that model with the engine's own quantization),
for ``ipc`` at TP 1 and 2 and ``sharded_rdt`` at TP 2. There is no Hugging
Face comparison: the served model is the quantized one.

Trainer-side quantization (``fp8_codes.Fp8ChannelCodes``: the trainer sends
float8 codes and per-row scales) must serve the same oracle through ``ipc``
at TP 1 and 2 and through ``sharded_rdt`` at TP 2, with every linear layer's
codes copied straight into the served tensors; codes or scales an engine
cannot take are refused before anything lands, and a codes sync whose trainer
fails midway leaves the engine fenced until a full sync.
``test_quantized_http.py`` proves the same through ``vllm serve`` at TP 1.
"""

from __future__ import annotations

import math
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
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.quant.fp8 import Fp8ChannelCodes
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
from vllm.distributed.weight_transfer.testing.fp8_sources import (
    FUSED_FROM,
    NAN_WEIGHT,
    QUANTIZATION,
    QUANTIZED,
    BadScale,
    assert_quantized,
    codes_digests,
    codes_or_skip,
    send_codes_or_skip,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    served_weight_dtypes,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

pytestmark = pytest.mark.slow


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
            in_process=True,
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
            assert_quantized(dtypes)
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
            assert_quantized(dtypes)


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
    """Offline at TP 2 (Ray actors, NIXL); TP 1 runs behind ``vllm serve`` in
    ``test_quantized_http.py``, so both sizes and both surfaces are covered
    without a fourth engine start."""
    tp = 2
    ray = pytest.importorskip("ray")
    pytest.importorskip("nixl")
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        LLMHost,
        TrainerRank,
        stop_llm_host,
    )

    model_dir = str(build_tiny_model(TinyModelSpec(arch="qwen3")))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        llm = ray.remote(num_cpus=0)(LLMHost).remote(
            model_dir, tp=tp, dtype="bfloat16", quantization=QUANTIZATION
        )
        for dtypes in ray.get(llm.weight_dtypes.remote()):
            assert_quantized(dtypes)
        rank = ray.remote(num_cpus=0)(TrainerRank).remote(model_dir, 0, 1, 0)
        # Each worker pulls only its TP shard; the row-parallel layers' scales
        # come from the row maximum vLLM shares across the ranks.
        ray.get(rank.init.remote(llm, num_consumers=tp))

        def sync_serves_the_oracle(seed: int, what: str) -> Any:
            """Change the trainer's weights in place, sync, and check the
            engine serves the fresh-load oracle of them."""
            ray.get(rank.randomize.remote(seed))
            ray.get(rank.send.remote())
            ray.get(llm.reset_prefix_cache.remote())
            got = ray.get(llm.greedy.remote())
            with tempfile.TemporaryDirectory(prefix="fresh-load-") as checkpoint:
                ray.get(rank.save_checkpoint.remote(checkpoint))
                expected = ray.get(llm.fresh_load_greedy.remote(checkpoint))
            assert_bit_identical(got, expected, what=f"vLLM after {what} {seed}")
            return got

        served = [sync_serves_the_oracle(seed, "sync") for seed in (33, 34)]
        assert served[0].tokens != served[1].tokens, "both syncs served the same"
        # Trainer-side codes: each worker pulls its shard of the codes (row
        # blocks of the column-parallel layers, column blocks of the
        # row-parallel ones) and their scales, straight into the served codes.
        codes_or_skip(
            lambda: ray.get(rank.init.remote(llm, num_consumers=tp, fp8_codes=True))
        )
        for seed in (35, 36):
            sync_serves_the_oracle(seed, "codes sync")
        for dtypes in ray.get(llm.weight_dtypes.remote()):
            assert_quantized(dtypes)
        ray.get(rank.shutdown.remote())
        stop_llm_host(llm)
    finally:
        ray.shutdown()


def test_trainer_side_fp8_codes_serve_what_worker_side_quantization_serves(
    ipc_engine,
):
    """The trainer quantizes (``Fp8ChannelCodes``: float8 codes and float32
    per-row scales, half the bytes) and the workers land the codes straight
    into the served float8 tensors: after each of two syncs the engine serves
    bit for bit what a fresh load of the trainer's full-precision weights
    serves with the engine's own quantization, every linear layer took codes
    (none went through the layerwise reload), and at TP 1 the served codes
    and scales are the trainer's, byte for byte. Payload checksums are on, so
    every worker also read the landed codes and scales back."""
    llm, model_dir, tp = ipc_engine
    trainer_model = load_hf_model(model_dir, "float32")
    call = offline_worker_call(llm)
    oracle = FreshLoadOracle(call, lambda: vllm_greedy(llm))
    source = Fp8ChannelCodes(ModuleSource(trainer_model))
    # The linear layers' codes and scales are about half their bfloat16 bytes.
    linear = [m for m in source.source.metadata() if m.name.endswith("_proj.weight")]
    sent = [m for m in source.metadata() if m.name.endswith(("_proj.weight", "_scale"))]
    assert _nbytes(sent) < 0.55 * _nbytes(_bf16(linear))
    # Checksums on: each worker also reads the served codes and scales back
    # against the trainer's after they land.
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, verify_checksums=True),
        client=OfflineLLMWeightSyncClient(llm),
        source=source,
    )
    layers = {
        f"model.layers.{i}.{fused}"
        for i in range(trainer_model.config.num_hidden_layers)
        for fused in FUSED_FROM
    }
    served = []
    for seed in (41, 42):
        randomize_weights_(trainer_model, seed=seed)
        send_codes_or_skip(trainer)
        llm.reset_prefix_cache()
        served.append(oracle.assert_serves(trainer_model))
        states = call("fp8_codes_state", [])
        assert len(states) == tp
        for state in states:
            assert set(state["layers"]) == layers
        if tp == 1:
            assert states[0]["digests"] == codes_digests(trainer_model)
    assert served[0].tokens != served[1].tokens, "both syncs served the same"


def test_a_codes_sync_whose_trainer_fails_midway_is_fenced_until_a_full_sync(
    ipc_engine,
):
    """Codes land straight in the served tensors, so there is nothing to put
    back: a trainer that fails after some chunks of codes landed leaves the
    engine fenced, with the served version naming the cause, and refusing
    anything but a full resync; the next full codes sync serves the oracle."""
    from vllm.distributed.weight_transfer.testing.ipc_faults import (
        worker_fence_status,
    )
    from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
        FailingSource,
    )
    from vllm.distributed.weight_transfer.verification import is_fenced_version

    llm, model_dir, tp = ipc_engine
    trainer_model = load_hf_model(model_dir, "float32")
    client = OfflineLLMWeightSyncClient(llm)
    randomize_weights_(trainer_model, seed=44)
    codes = Fp8ChannelCodes(ModuleSource(trainer_model))
    # Small chunks: layer 0's codes have landed when the source fails at the
    # last layer's first tensor.
    names = [m.name for m in codes.metadata()]
    last_layer = trainer_model.config.num_hidden_layers - 1
    after = next(i for i, n in enumerate(names) if f"layers.{last_layer}." in n)
    dying = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=64 * 1024),
        client=client,
        source=FailingSource(codes, after=after),
    )
    try:
        dying.send_weights()
    except Exception as e:
        if "repacks the codes after loading" in str(e):
            pytest.skip(f"this CPU's FP8 kernel repacks codes, refused by design: {e}")
        assert "injected trainer failure" in str(e), e
    else:
        raise AssertionError("the failing codes sync went through")
    version = llm.get_weight_version()
    assert is_fenced_version(version) and "injected trainer failure" in version
    assert [s["state"] for s in llm.collective_rpc(worker_fence_status)] == [
        "fenced"
    ] * tp

    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=codes
    ).send_weights()
    assert [s["state"] for s in llm.collective_rpc(worker_fence_status)] == [
        "committed"
    ] * tp
    llm.reset_prefix_cache()
    oracle.assert_serves(trainer_model)


def _bf16(metas: list[ParamMeta]) -> list[ParamMeta]:
    return [ParamMeta(m.name, torch.bfloat16, m.shape) for m in metas]


def _nbytes(metas: list[ParamMeta]) -> int:
    return sum(m.dtype.itemsize * math.prod(m.shape) for m in metas)


class _WideScales(Fp8ChannelCodes):
    """Codes whose scale tensors have two columns (not per-channel scales)."""

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, m.dtype, (m.shape[0], 2))
            if m.name.endswith(".weight_scale")
            else m
            for m in super().metadata()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().__iter__():
            if name.endswith(".weight_scale"):
                tensor = tensor.expand(-1, 2).contiguous()
            yield name, tensor


@pytest.mark.parametrize(
    "case, match",
    [
        ("wide_scales", r"q_proj.weight_scale is float32 \[\d+, 2\]"),
        ("embedding", r"embed_tokens: it is not quantized per channel to FP8 online"),
        ("part_of_qkv", r"qkv_proj: the codes cover \d+ of its \d+ elements"),
    ],
)
def test_fp8_codes_an_engine_cannot_take_are_refused_before_anything_lands(
    ipc_engine, case, match
):
    """Scales that are not one per row, codes for a layer the engine does not
    quantize, codes for part of a fused layer: each refused before anything
    lands, naming the tensor or layer; the old weights keep serving, unfenced,
    and the next sync serves the oracle."""
    llm, model_dir, _ = ipc_engine
    trainer_model = load_hf_model(model_dir, "float32")
    client = OfflineLLMWeightSyncClient(llm)
    inner = ModuleSource(trainer_model)
    source: WeightSource
    if case == "wide_scales":
        source = _WideScales(inner)
    elif case == "embedding":
        source = Fp8ChannelCodes(
            inner, quantized=lambda n, s: n == "model.embed_tokens.weight"
        )
    else:
        source = Fp8ChannelCodes(inner, quantized=lambda n, s: "q_proj" in n)
    llm.reset_prefix_cache()
    before = vllm_greedy(llm)
    bad = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0), client=client, source=source
    )
    with pytest.raises(Exception, match=match):
        bad.send_weights()
    llm.reset_prefix_cache()
    assert_bit_identical(vllm_greedy(llm), before, what=f"after refused codes ({case})")

    randomize_weights_(trainer_model, seed=43)
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))
    send_codes_or_skip(
        WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0),
            client=client,
            source=Fp8ChannelCodes(ModuleSource(trainer_model)),
        )
    )
    llm.reset_prefix_cache()
    oracle.assert_serves(trainer_model)


def test_bad_fp8_scales_are_refused_and_nan_weights_do_not_outlive_the_resync(
    ipc_engine,
):
    """Scales of NaN, infinity, zero or below are refused by every worker
    before anything lands, naming the scale: the old weights keep serving,
    unfenced. Weights with a NaN are the trainer's to send (the engine serves
    NaN logprobs); the full sync after them serves the new oracle from its
    very first generation: the NaN the old weights left in the KV cache's
    blocks is zeroed at the commit."""
    llm, model_dir, tp = ipc_engine
    trainer_model = load_hf_model(model_dir, "float32")
    client = OfflineLLMWeightSyncClient(llm)
    oracle = FreshLoadOracle(offline_worker_call(llm), lambda: vllm_greedy(llm))

    def sync(source: WeightSource, weight_version: str | None = None) -> None:
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0), client=client, source=source
        )
        assert isinstance(trainer, IPCTrainerWeightTransferEngine)
        trainer.send_weights(weight_version=weight_version)

    randomize_weights_(trainer_model, seed=45)
    # Labelled, so the checks below do not read a label an earlier test of
    # this module's engine left (a fenced one, after its injected failure).
    sync(ModuleSource(trainer_model), weight_version="before-the-bad-scales")
    before = oracle.assert_serves(trainer_model)
    codes_land = True
    for value in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(Exception) as refused:
            sync(BadScale(ModuleSource(trainer_model), value))
        if "repacks the codes after loading" in str(refused.value):
            codes_land = False  # this CPU's FP8 kernel takes no codes at all
            break
        assert "q_proj.weight_scale (scale, float32" in str(refused.value)
        assert "every element must be finite and greater than zero" in str(
            refused.value
        )
        assert llm.get_weight_version() == "before-the-bad-scales"
        assert_bit_identical(
            vllm_greedy(llm), before, what=f"after a refused scale of {value}"
        )

    weight = dict(trainer_model.named_parameters())[NAN_WEIGHT]
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    sync(ModuleSource(trainer_model))
    poisoned = vllm_greedy(llm)
    assert any(math.isnan(lp) for row in poisoned.logprobs for lp in row)
    with torch.no_grad():
        weight.copy_(kept)
    randomize_weights_(trainer_model, seed=46)
    source = ModuleSource(trainer_model)
    sync(Fp8ChannelCodes(source) if codes_land else source)
    oracle.assert_serves(trainer_model, what="the first generation after the resync")
