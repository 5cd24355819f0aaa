# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from a trainer's memory (``lora_trainer``) into a real
vLLM engine on CPU through the ``ipc`` backend: an offline ``LLM`` (dense
Qwen3, fp32, ``enable_lora=True``) at TP 1 and one at TP 2, each shared by
every scenario; and a ``sharded_rdt``-configured engine (TP 1), which takes
adapters only as pulls.

Oracles, for every adapter version served:

* the same engine loading the same adapter from a directory (PEFT's
  ``save_pretrained``) under another id serves bit for bit the same tokens
  and logprobs as the adapter pushed from memory;
* Hugging Face + PEFT's forward of base + adapter (fp32) gives the same
  greedy tokens, logprobs within the fp32 tolerance.

Scenarios: a first push, verified by the receipt of every worker (each TP
rank attests the whole adapter); a second after an in-place optimizer step;
the same pulled over NIXL from the trainer's producer (``transport="nixl"``,
the transport that crosses machines), and a pull no worker can make refused
with the cause while the version before keeps serving;
two adapters updated independently; bad adapters (rank above max_lora_rank, an
unknown module, a wrong shape, an id serving another name) refused with the
cause before anything changes; a push that fails at the finish leaves the
version before serving and the base weights unfenced; a base-weight sync
with an explicit version after adapter pushes versioned by the wall clock
(adapters order their versions apart) keeps pushed adapters serving on the
new base; base weights with an adapter
folded in (``LoRAAdapter.merged_into``) serve what base + adapter serves;
with ``label_outputs=True`` every output token's weight version label names
the version of each adapter pushed that way; the trainer-engine shape
(``trainer_init(LoRATrainerInitInfo, source=LoRASource...)``, then
``send_weights()`` each round) pushes a PEFT model as it is at each round.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.lora.pull import ADAPTER_PULL_KEY
from vllm.distributed.weight_transfer.lora.pusher import (
    LoRAAdapter,
    LoRAPusher,
    memory_path,
    push_lora_adapter,
)
from vllm.distributed.weight_transfer.lora.wire import AdapterConfig
from vllm.distributed.weight_transfer.testing import (
    GreedyResult,
    TinyModelSpec,
    assert_bit_identical,
    assert_same_greedy,
    build_tiny_model,
    hf_greedy,
    load_hf_model,
    logprob_atol,
    randomize_weights_,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.ipc_faults import (
    ByteFlippingClient,
    worker_fence_status,
)
from vllm.distributed.weight_transfer.testing.lora import random_lora
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

MAX_RANK = 8
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


class Rig:
    def __init__(self, llm: Any, model_dir: Any, tmp: Any) -> None:
        self.llm = llm
        self.model_dir = model_dir
        self.tmp = tmp
        self.client = OfflineLLMWeightSyncClient(llm)
        self.tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        # What the engine's base weights are now (HF, fp32).
        self.base = load_hf_model(model_dir, "float32")
        self.saved = 0

    def lora(self, name: str, lora_id: int, path: str | None = None) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, lora_id, path or memory_path(name))

    def greedy(self, lora_request: Any = None) -> GreedyResult:
        # Each prompt alone: whether prompts share a step depends on timing,
        # and vLLM CPU's LoRA kernels are not batch-invariant to the last bit
        # (one bench run under load saw a last-bit difference between two
        # batched generations of the same adapter).
        return vllm_greedy(self.llm, lora_request=lora_request, one_at_a_time=True)

    def peft_model(self, seed: int, rank: int = MAX_RANK) -> Any:
        """A PEFT LoRA over a copy of the current base, random A and B."""
        return random_lora(self.base, seed, rank, TARGETS)

    def from_disk(self, model: Any, name: str, lora_id: int) -> GreedyResult:
        """The same engine serving ``model``'s adapter loaded from a
        directory (PEFT's own files), under ``name`` and ``lora_id``."""
        self.saved += 1
        path = self.tmp / f"adapter-{self.saved}"
        model.save_pretrained(str(path))
        return self.greedy(self.lora(name, lora_id, str(path)))

    def assert_serves(self, model: Any, name: str, lora_id: int) -> GreedyResult:
        pushed = self.greedy(self.lora(name, lora_id))
        # A fresh id each time: the engine loads the directory anew.
        disk_id = 100 + self.saved
        assert_bit_identical(
            pushed,
            self.from_disk(model, f"{name}-disk-{self.saved}", disk_id),
            what="adapter pushed from memory vs the same adapter from disk",
        )
        assert_same_greedy(
            pushed, hf_greedy(model), atol=logprob_atol("float32"), what="vLLM+LoRA"
        )
        return pushed


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def rig(request, tmp_path_factory):
    """TP 1 and TP 2: at TP 2 each worker maps the trainer's buffer itself and
    vLLM's LoRA layers take each worker's slice of the whole adapter."""
    yield from lora_rig(
        tmp_path_factory, "adapters", tensor_parallel_size=request.param
    )


def lora_rig(tmp_path_factory, folder: str, tensor_parallel_size: int = 1, **engine):
    """A ``Rig`` over a tiny Qwen3 engine with LoRA (``engine`` adds to
    ``tiny_llm``'s arguments), shut down when the fixture ends."""
    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    with pytest.MonkeyPatch.context() as env:
        # collective_rpc(fn) pickles fn (the fence status read by a test).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if tensor_parallel_size > 1:
            # One core per TP worker (vLLM CPU binds per NUMA node otherwise).
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        llm = tiny_llm(
            model_dir,
            tensor_parallel_size=tensor_parallel_size,
            enable_lora=True,
            max_lora_rank=MAX_RANK,
            max_loras=2,
            max_cpu_loras=8,
            **engine,
        )
        try:
            yield Rig(llm, model_dir, tmp_path_factory.mktemp(folder))
        finally:
            llm.llm_engine.engine_core.shutdown()


def test_an_adapter_pushed_from_memory_serves_as_from_disk_and_a_second_push(rig):
    model = rig.peft_model(seed=1)
    adapter = LoRAAdapter.from_peft_model(model, name="policy", lora_id=1)
    assert adapter.config == AdapterConfig(
        rank=MAX_RANK, alpha=2.0 * MAX_RANK, target_modules=tuple(sorted(TARGETS))
    )
    verified = push_lora_adapter(
        rig.client, adapter, version="v1", verify_checksums=True
    )
    # Every worker (each TP rank) attested the whole adapter and its checksum.
    workers = rig.client.get_world_size()
    nbytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
    assert verified is not None and verified.workers == tuple(range(workers))
    assert verified.bytes_landed == workers * nbytes
    assert verified.checksums_verified == workers
    first = rig.assert_serves(model, "policy", 1)
    assert first != rig.greedy(), "the adapter changes the output"
    # A request with another id that names the adapter by its memory path
    # (as a server numbering adapters itself sends) gets the pushed one.
    alias = rig.lora("policy-alias", 50, memory_path("policy"))
    assert_bit_identical(rig.greedy(alias), first, what="by memory path")
    # An optimizer step changes the adapter in place; the next push serves it.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    # Pushed by a LoRAPusher, which keeps its buffer for the next push.
    pusher = LoRAPusher(rig.client)
    try:
        pusher.push(
            LoRAAdapter.from_peft_model(model, name="policy", lora_id=1), version="v2"
        )
        second = rig.assert_serves(model, "policy", 1)
        kept = pusher.last_publication
        assert kept is not None and kept.verified is not None
        assert kept.verified.workers == tuple(range(workers))
        assert kept.verified.model_version > verified.model_version
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.add_(0.01)
        pusher.push(
            LoRAAdapter.from_peft_model(model, name="policy", lora_id=1), version="v3"
        )
        third = rig.assert_serves(model, "policy", 1)
        assert third != second
    finally:
        pusher.close()
    assert second != first
    assert_bit_identical(rig.greedy(alias), third, what="by memory path, v3")


class WrongProducerKey(OfflineLLMWeightSyncClient):
    """Sends adapter pulls with a producer auth key that does not match, so
    every worker's connection to the trainer's producer is refused."""

    def update_weights(
        self, update_info: dict[str, Any] | list[dict[str, Any]]
    ) -> None:
        pull = (
            None if isinstance(update_info, list) else update_info.get(ADAPTER_PULL_KEY)
        )
        if pull is not None:
            assert isinstance(update_info, dict)
            endpoint = {**pull["endpoint"], "authkey": "00" * 16}
            update_info = {
                **update_info,
                ADAPTER_PULL_KEY: {**pull, "endpoint": endpoint},
            }
        super().update_weights(update_info)


def test_an_adapter_pulled_over_nixl_serves_and_a_failed_pull_changes_nothing(
    rig,
):
    """``transport="nixl"``: every worker pulls the packed adapter from the
    trainer's producer (what a trainer on another machine does) and its
    receipt comes back through the producer."""
    model = rig.peft_model(seed=13)
    workers = rig.client.get_world_size()
    pusher = LoRAPusher(rig.client, transport="nixl", verify_checksums=True)
    try:
        verified = pusher.push(
            LoRAAdapter.from_peft_model(model, "remote", 8), version="r1"
        )
        assert verified is not None and verified.workers == tuple(range(workers))
        assert verified.checksums_verified == workers
        first = rig.assert_serves(model, "remote", 8)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        # The same producer serves the next push.
        pusher.push(LoRAAdapter.from_peft_model(model, "remote", 8), version="r2")
        second = rig.assert_serves(model, "remote", 8)
        assert second != first
    finally:
        pusher.close()
    # No worker can reach the producer: refused with the cause, r2 serves.
    with pytest.raises(Exception, match="could not open a control connection"):
        push_lora_adapter(
            WrongProducerKey(rig.llm),
            LoRAAdapter.from_peft_model(rig.peft_model(seed=14), "remote", 8),
            transport="nixl",
            stall_timeout_s=10.0,
        )
    assert_bit_identical(
        rig.greedy(rig.lora("remote", 8)), second, what="after the failed pull"
    )
    status = rig.llm.collective_rpc(worker_fence_status)
    assert all(s["state"] != "fenced" for s in status), status


def test_two_adapters_are_updated_independently(rig):
    a, b = rig.peft_model(seed=2), rig.peft_model(seed=3)
    push_lora_adapter(rig.client, LoRAAdapter.from_peft_model(a, "a", 2))
    push_lora_adapter(rig.client, LoRAAdapter.from_peft_model(b, "b", 3))
    a_before = rig.assert_serves(a, "a", 2)
    rig.assert_serves(b, "b", 3)
    b = rig.peft_model(seed=4)
    push_lora_adapter(rig.client, LoRAAdapter.from_peft_model(b, "b", 3))
    rig.assert_serves(b, "b", 3)
    assert_bit_identical(rig.greedy(rig.lora("a", 2)), a_before, what="adapter a")


def test_the_trainer_engine_shape_pushes_a_peft_model_every_round(rig):
    """``trainer_init(LoRATrainerInitInfo(...), source=LoRASource...)`` then
    ``send_weights()`` after each optimizer step, as for base weights."""
    from vllm.distributed.weight_transfer.lora.trainer import (
        LoRASource,
        LoRATrainerInitInfo,
        LoRATrainerWeightTransferEngine,
    )

    model = rig.peft_model(seed=41)
    engine = WeightTransferTrainerFactory.trainer_init(
        LoRATrainerInitInfo(rank=0, verify_checksums=True),
        client=rig.client,
        source=LoRASource.from_peft_model(model, "by-engine", 41),
    )
    assert isinstance(engine, LoRATrainerWeightTransferEngine)
    try:
        engine.send_weights(weight_version="e-1")
        first = rig.assert_serves(model, "by-engine", 41)
        (verified,) = engine.last_publications
        assert verified is not None and len(verified.workers) == rig.tp
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        engine.send_weights(weight_version="e-2")
        assert rig.assert_serves(model, "by-engine", 41) != first
    finally:
        engine.shutdown()


def _labels_on_outputs(rig, lora_request: Any = None) -> list[str]:
    """The weight version labels on the tokens of one greedy generation."""
    from vllm import SamplingParams

    (out,) = rig.llm.generate(
        ["The weights of"],
        SamplingParams(max_tokens=4, temperature=0.0),
        lora_request=lora_request,
        use_tqdm=False,
    )
    spans = out.outputs[0].weight_versions
    assert spans is not None and spans[-1].end == 4, spans
    return [s.version for s in spans]


def test_outputs_name_the_adapter_versions_pushed_with_label_outputs(rig):
    from vllm.distributed.weight_transfer.lora.labels import (
        label_with_adapters,
        split_adapter_label,
    )

    before = rig.client.get_weight_version()
    base, adapters = split_adapter_label(before)
    pusher = LoRAPusher(rig.client, label_outputs=True)
    try:
        a = LoRAAdapter.from_peft_model(rig.peft_model(seed=21), "labelled-a", 31)
        pusher.push(a, version="a-1")
        expected = label_with_adapters(base, {**adapters, "labelled-a": "a-1"})
        assert rig.client.get_weight_version() == expected
        assert _labels_on_outputs(rig, rig.lora("labelled-a", 31)) == [expected]

        b = LoRAAdapter.from_peft_model(rig.peft_model(seed=22), "labelled-b", 32)
        pusher.push(b, version="b-1")
        pusher.push(a, version="a-2")
        label = rig.client.get_weight_version()
        # Every request reads the version of the adapter it named; a base
        # request sees the same label.
        for request in (rig.lora("labelled-a", 31), rig.lora("labelled-b", 32), None):
            (span_label,) = _labels_on_outputs(rig, request)
            assert span_label == label
            assert split_adapter_label(span_label) == (
                base,
                {**adapters, "labelled-a": "a-2", "labelled-b": "b-1"},
            )

        # Refused before anything is sent, and a refused push: the label stays.
        with pytest.raises(ValueError, match="needs a non-empty string"):
            pusher.push(a)
        wide = rig.peft_model(seed=23, rank=2 * MAX_RANK)
        with pytest.raises(Exception, match="max_lora_rank"):
            pusher.push(
                LoRAAdapter.from_peft_model(wide, "labelled-a", 31), version="a-3"
            )
        assert rig.client.get_weight_version() == label
    finally:
        pusher.close()
        rig.client.update_weight_version(before)


def _bad(adapter: LoRAAdapter, **changes: Any) -> LoRAAdapter:
    fields = {
        "name": adapter.name,
        "lora_id": adapter.lora_id,
        "config": adapter.config,
        "tensors": dict(adapter.tensors),
        **changes,
    }
    return LoRAAdapter(**fields)


def test_bad_adapters_are_refused_before_anything_changes(rig):
    model = rig.peft_model(seed=5)
    good = LoRAAdapter.from_peft_model(model, "guarded", 4)
    push_lora_adapter(rig.client, good)
    before = rig.greedy(rig.lora("guarded", 4))
    base_before = rig.greedy()

    first = next(n for n in good.tensors if "q_proj.lora_A" in n)
    unknown = first.replace("q_proj", "nope_proj")
    wide = rig.peft_model(seed=6, rank=2 * MAX_RANK)
    cases = {
        "above the engine's max_lora_rank": LoRAAdapter.from_peft_model(
            wide, "guarded", 4
        ),
        "not among target_modules": _bad(
            good, tensors={**good.tensors, unknown: good.tensors[first]}
        ),
        "does not have rank": _bad(
            good,
            tensors={**good.tensors, first: torch.zeros(MAX_RANK - 1, 128)},
        ),
        "already serves adapter 'guarded'": _bad(good, name="other"),
    }
    # A byte flipped in transit, caught by the checksum every worker checks.
    flipped = LoRAAdapter.from_peft_model(rig.peft_model(seed=12), "guarded", 4)
    with pytest.raises(Exception, match="checksum mismatch"):
        push_lora_adapter(
            ByteFlippingClient(rig.client), flipped, verify_checksums=True
        )
    for cause, adapter in cases.items():
        # The documented type, although the engine's process answers a
        # plain Exception.
        with pytest.raises(ValueError, match=cause):
            push_lora_adapter(rig.client, adapter)
        assert_bit_identical(
            rig.greedy(rig.lora("guarded", 4)), before, what=f"after '{cause}'"
        )
    assert_bit_identical(rig.greedy(), base_before, what="base weights")
    status = rig.llm.collective_rpc(worker_fence_status)
    assert all(s["state"] != "fenced" for s in status), status


class FailingFinish(OfflineLLMWeightSyncClient):
    """Raises on the first finish, before the engine sees it."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self.failed = False

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected finish failure")
        super().finish_weight_update(weight_version)


def test_a_memory_path_never_pushed_is_refused_by_add_lora_not_fatal(rig):
    """A memory path no push filled: vLLM's ``add_lora`` (what the OpenAI
    server's ``/v1/load_lora_adapter`` calls to preload) refuses it with the
    cause on every worker, and the engine keeps serving. (A ``LoRARequest``
    whose adapter fails to load inside a generation step stops an offline
    engine; upstream 0.32 does the same for a directory that does not exist.
    ``docs/training/weight_transfer/lora.md`` says to preload adapters you
    are not sure of.)"""
    base = rig.greedy()
    with pytest.raises(Exception, match="No adapter found for memory://never-pushed"):
        rig.llm.llm_engine.add_lora(rig.lora("ghost", 90, memory_path("never-pushed")))
    assert_bit_identical(rig.greedy(), base, what="base after the refusal")


def test_a_push_that_fails_leaves_the_previous_version_serving(rig):
    model = rig.peft_model(seed=7)
    push_lora_adapter(rig.client, LoRAAdapter.from_peft_model(model, "steady", 5))
    before = rig.assert_serves(model, "steady", 5)
    changed = rig.peft_model(seed=8)
    with pytest.raises(RuntimeError, match="injected finish failure"):
        push_lora_adapter(
            FailingFinish(rig.llm), LoRAAdapter.from_peft_model(changed, "steady", 5)
        )
    assert_bit_identical(rig.greedy(rig.lora("steady", 5)), before, what="steady")
    # The next push goes through.
    push_lora_adapter(rig.client, LoRAAdapter.from_peft_model(changed, "steady", 5))
    rig.assert_serves(changed, "steady", 5)


def test_a_base_weight_sync_keeps_pushed_adapters_serving_on_the_new_base(rig):
    adapter_model = rig.peft_model(seed=9)
    adapter = LoRAAdapter.from_peft_model(adapter_model, "kept", 6)
    push_lora_adapter(rig.client, adapter)
    # New base weights from the trainer (vLLM drops every adapter after a
    # base-weight update; the pushed one comes back from memory), with an
    # explicit version (1 unless a base sync came before) far below the
    # wall-clock versions of the adapter pushes: adapters order their
    # versions apart from the base weights', so it is accepted.
    status = rig.llm.collective_rpc(worker_fence_status)
    base_version = 1 + max(s["model_version"] or 0 for s in status)
    randomize_weights_(rig.base, seed=10)
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, model_version=base_version),
        client=rig.client,
        source=ModuleSource(rig.base),
    ).send_weights()
    status = rig.llm.collective_rpc(worker_fence_status)
    assert all(s["model_version"] == base_version for s in status), status
    on_new_base = rig.peft_model(seed=9)  # the same adapter over the new base
    rig.assert_serves(on_new_base, "kept", 6)


def test_base_weights_with_an_adapter_folded_in_serve_base_plus_adapter(rig):
    adapter_model = rig.peft_model(seed=11)
    adapter = LoRAAdapter.from_peft_model(adapter_model, "folded", 7)
    merged = copy.deepcopy(rig.base)
    merged.load_state_dict(adapter.merged_into(rig.base.state_dict()))
    WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0),
        client=rig.client,
        source=ModuleSource(merged),
    ).send_weights()
    rig.base = merged
    assert_same_greedy(
        rig.greedy(),
        hf_greedy(adapter_model),
        atol=logprob_atol("float32"),
        what="folded base",
    )


@pytest.fixture(scope="module")
def rdt_rig(tmp_path_factory):
    """A ``sharded_rdt``-configured engine (TP 1) with LoRA: the engine a
    trainer on another machine drives. Its workers map no trainer buffer, so
    adapters reach it only as pulls."""
    yield from lora_rig(tmp_path_factory, "rdt-adapters", backend="sharded_rdt")


def test_a_sharded_rdt_engine_serves_pulled_adapters_and_refuses_handles(rdt_rig):
    """Two verified pulls (the second after an in-place step) serve what the
    same adapter from disk serves; a colocated push, whose buffer such a
    worker does not map, is refused with the transport to use, and the
    pulled version keeps serving on unfenced base weights."""
    rig = rdt_rig
    model = rig.peft_model(seed=21)
    pusher = LoRAPusher(rig.client, transport="nixl", verify_checksums=True)
    try:
        verified = pusher.push(
            LoRAAdapter.from_peft_model(model, "remote", 5), version="r1"
        )
        assert verified is not None and verified.checksums_verified == 1
        first = rig.assert_serves(model, "remote", 5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        pusher.push(LoRAAdapter.from_peft_model(model, "remote", 5), version="r2")
        second = rig.assert_serves(model, "remote", 5)
        assert second != first
    finally:
        pusher.close()
    base = rig.greedy()
    with pytest.raises(Exception, match=r"LoRAPusher\(transport='nixl'\)"):
        push_lora_adapter(
            rig.client,
            LoRAAdapter.from_peft_model(rig.peft_model(seed=22), "remote", 5),
        )
    assert_bit_identical(
        rig.greedy(rig.lora("remote", 5)), second, what="after the refused push"
    )
    assert_bit_identical(rig.greedy(), base, what="base after the refused push")
    status = rig.llm.collective_rpc(worker_fence_status)
    assert all(s["state"] != "fenced" for s in status), status
