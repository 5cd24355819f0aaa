# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Verified publication through real vLLM engines on CPU, with the ``ipc`` backend.

One offline ``LLM`` (dense Qwen3, fp32, TP=1) is shared by the offline
scenarios, and one ``vllm serve`` by the HTTP one:

* the served version changes only after every receipt verified;
* a byte flipped in the shared-memory buffer after packing is caught by the
  payload checksums, the engine is fenced, and a full resync recovers;
* a trainer model with one tensor of another shape than the served model is
  rejected before any weight loads: the output is unchanged;
* a worker failing mid-update leaves the engine fenced and refusing updates
  with the resync message; the trainer gets the error; a full resync recovers
  output equal to a fresh load of the trainer's weights (and to HF);
* over HTTP, a committed sync and a rejected one show on ``/metrics`` and
  ``/weight_info``, and the server keeps serving;
* hostile headers (a version a day ahead, a receipt directory outside the
  receipt root, another backend) are refused at the first message, naming
  the field, and a prepare naming another publication attests nothing.

Each test first pushes the state it starts from, so tests do not depend on
order.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm.distributed.weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.clients import (
    OfflineLLMWeightSyncClient,
)
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.testing import (
    FreshLoadOracle,
    GreedyResult,
    assert_bit_identical,
    assert_same_greedy,
    assert_serves_weights,
    hf_greedy,
    load_hf_model,
    logprob_atol,
    offline_worker_call,
    randomize_weights_,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.ipc_faults import (
    INJECTED_FAILURE,
    ByteFlippingClient,
    fail_load_once,
    worker_fence_status,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    PublicationHeader,
    is_fenced_version,
)

pytestmark = pytest.mark.slow

# A small cap so every push spans several chunks (the model is ~2 MB).
CHUNK_CAP = 256 * 1024
RESYNC = "full resync is required"


@dataclass
class Rig:
    llm: Any
    model: torch.nn.Module  # the trainer's model
    # Feed the oracle prompts one at a time (engines with plain CPU linear
    # layers: MKL's float32 GEMM is not batch-invariant).
    one_at_a_time: bool = False

    def greedy(self) -> GreedyResult:
        return vllm_greedy(self.llm, one_at_a_time=self.one_at_a_time)

    def client(self) -> OfflineLLMWeightSyncClient:
        return OfflineLLMWeightSyncClient(self.llm)

    def trainer(
        self, client: Any = None, source: WeightSource | None = None, **kwargs: Any
    ) -> IPCTrainerWeightTransferEngine:
        kwargs.setdefault("packed_buffer_size_bytes", CHUNK_CAP)
        return WeightTransferTrainerFactory.trainer_init(  # type: ignore[return-value]
            IPCTrainerInitInfo(rank=0, **kwargs),
            client=client or self.client(),
            source=source or ModuleSource(self.model),
        )

    def push(self, seed: int, version: str) -> None:
        """Randomize the trainer's model and push it; vLLM then matches HF."""
        randomize_weights_(self.model, seed=seed)
        self.trainer().send_weights(weight_version=version)
        assert self.llm.get_weight_version() == version
        self.assert_serves_trainer()

    def assert_serves_trainer(self) -> None:
        oracle = FreshLoadOracle(offline_worker_call(self.llm), self.greedy)
        assert_serves_weights(oracle, self.model, dtype="float32")

    def fence(self) -> dict[str, Any]:
        (status,) = self.llm.collective_rpc(worker_fence_status)
        return status


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path) -> Iterator[Rig]:

    # collective_rpc(fn) pickles fn (test-only fault injection and status).
    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = tiny_llm(tiny_model_dir, in_process=True)
    try:
        yield Rig(llm, load_hf_model(tiny_model_dir, "float32"))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        if saved is None:
            os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        else:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved


class ResizedSource(WeightSource):
    """``inner`` with one tensor one element longer (metadata agrees)."""

    def __init__(self, inner: WeightSource, name: str) -> None:
        self.inner, self.name = inner, name

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, m.dtype, (*m.shape[:-1], m.shape[-1] + 1))
            if m.name == self.name
            else m
            for m in self.inner.metadata()
        ]

    def __iter__(self):
        for name, tensor in self.inner:
            if name == self.name:
                tensor = torch.cat([tensor, tensor[..., :1]], dim=-1)
            yield name, tensor


class VersionAtCommit:
    """Records, at the commit (``finish_weight_update``), the served version
    before it and whether the trainer had verified the receipts by then."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[tuple[str, bool]] = []
        self.trainer: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pub = self.trainer._pub
        verified = pub is not None and pub.verified is not None
        self.seen.append((self.inner.llm.get_weight_version(), verified))
        self.inner.finish_weight_update(weight_version)


def test_an_llm_configured_for_weight_transfer_serves_the_checkpoint(
    rig, tiny_model_dir
):
    """``LLM(weight_transfer_config=ipc)`` starts and, before any update,
    serves what a Hugging Face forward of the checkpoint gives (fp32)."""
    expected = hf_greedy(load_hf_model(tiny_model_dir, "float32"))
    assert_same_greedy(vllm_greedy(rig.llm), expected, atol=logprob_atol("float32"))


def test_version_becomes_visible_only_after_receipts_verify(rig):
    rig.push(seed=1, version="step-1")
    randomize_weights_(rig.model, seed=2)
    client = VersionAtCommit(rig.client())
    trainer = rig.trainer(client, verify_checksums=True)
    client.trainer = trainer
    trainer.send_weights(weight_version="step-2")
    # The commit came after every receipt verified, with the old version
    # served until then.
    assert client.seen == [("step-1", True)]
    assert rig.llm.get_weight_version() == "step-2"
    pub = trainer.last_publication
    assert pub is not None and pub.verified is not None
    assert pub.verified.workers == (0,)
    assert pub.verified.checksums_verified == len(trainer.last_plan.chunks) > 1
    status = rig.fence()
    assert status["state"] == "committed"
    assert status["publication_id"] == pub.header.publication_id
    rig.assert_serves_trainer()


def test_flipped_byte_in_transit_is_caught_by_checksums(rig):
    rig.push(seed=3, version="step-3")
    randomize_weights_(rig.model, seed=4)
    client = ByteFlippingClient(rig.client(), message=1)  # the second chunk
    with pytest.raises(Exception, match="checksum") as info:
        rig.trainer(client, verify_checksums=True).send_weights(weight_version="step-4")
    assert client.flipped is not None
    assert "changed in transit" in str(info.value)
    version = rig.llm.get_weight_version()
    assert is_fenced_version(version) and "checksum" in version
    # the first chunk had landed: the engine is fenced until a full resync
    assert rig.fence()["state"] == "fenced"
    rig.push(seed=4, version="step-4")
    assert rig.fence()["state"] == "committed"


def test_manifest_mismatch_is_rejected_before_any_weight_loads(rig):
    rig.push(seed=5, version="step-5")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=6)  # would change the output if it landed
    # model.norm.weight comes after every layer: without the check against the
    # served checkpoint, earlier chunks would land first.
    source = ResizedSource(ModuleSource(rig.model), "model.norm.weight")
    with pytest.raises(Exception, match="disagrees with the served model"):
        rig.trainer(source=source).send_weights(weight_version="step-6")
    assert_bit_identical(vllm_greedy(rig.llm), before, what="vLLM after the rejection")
    assert rig.fence()["state"] == "committed"  # nothing landed: not fenced
    # The worker's failure receipt says its weights are intact, so the
    # trainer leaves the served version naming them.
    assert rig.llm.get_weight_version() == "step-5"
    rig.push(seed=6, version="step-6")


def test_worker_failing_mid_update_fences_until_a_full_resync(rig):
    rig.push(seed=7, version="step-7")
    randomize_weights_(rig.model, seed=8)
    rig.llm.collective_rpc(fail_load_once, args=(2,))
    with pytest.raises(Exception, match=INJECTED_FAILURE):
        rig.trainer().send_weights(weight_version="step-8")
    assert is_fenced_version(rig.llm.get_weight_version())
    status = rig.fence()
    assert status["state"] == "fenced" and INJECTED_FAILURE in status["reason"]

    # A publication announcing anything but the full scope is refused at parse
    # and cannot clear the fence.
    header = PublicationHeader.create(
        backend="ipc",
        model_version=time.time_ns() // 1000 + 1_000_000,  # newer than any
        manifest=Manifest.from_params(
            [ParamMeta("lm_head.weight", torch.float32, (1,))]
        ),
        trainer_devices=["cpu:test:0"],
    )
    partial = {**header.to_dict(), "scope": "partial"}
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match="scope is 'partial'"):
        rig.llm.update_weights({"update_info": {"names": [], "publication": partial}})
    assert rig.fence()["state"] == "fenced"
    # Nor can a finish without a single verified tensor.
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match=RESYNC):
        rig.llm.finish_weight_update()
    # vLLM's Worker keeps an update open while finish raises; an abort closes it.
    rig.llm.update_weights({"update_info": {"abort": "giving up on the resync"}})
    rig.llm.finish_weight_update()
    assert rig.fence()["state"] == "fenced"

    # A full resync clears the fence and serves the trainer's weights.
    rig.trainer().send_weights(weight_version="step-8")
    assert rig.llm.get_weight_version() == "step-8"
    assert rig.fence()["state"] == "committed"
    rig.assert_serves_trainer()


# ---------------------------------------------------------------------------
# HTTP


# ---------------------------------------------------------------------------
# The invariant under hostile or careless clients: the served model is the old
# weights, the trainer's new weights, or fenced with a named cause; the engine
# keeps answering.


class NamesSource(WeightSource):
    """Only ``names`` of ``inner``."""

    def __init__(self, inner: WeightSource, names: set[str]) -> None:
        self.inner, self.names = inner, names

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self.inner.metadata() if m.name in self.names]

    def __iter__(self):
        for name, tensor in self.inner:
            if name in self.names:
                yield name, tensor


class GeneratesAfterFirstChunk:
    """A client that runs generation on the engine after the first chunk: a
    rollout that was not paused for the update."""

    def __init__(self, inner: Any, llm: Any) -> None:
        self.inner, self.llm = inner, llm
        self.generated: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        if self.generated is None:
            self.generated = vllm_greedy(self.llm)


def test_a_partial_fused_layer_is_refused_not_committed(rig):
    rig.push(seed=31, version="step-31")
    before = vllm_greedy(rig.llm)
    layer = "model.layers.0.self_attn"
    partial = {f"{layer}.q_proj.weight", f"{layer}.v_proj.weight"}
    with pytest.raises(Exception, match="k_proj"):
        rig.trainer(source=NamesSource(ModuleSource(rig.model), partial)).send_weights(
            weight_version="step-31b"
        )
    # the incomplete layer was never committed: the output is the old one
    assert_bit_identical(vllm_greedy(rig.llm), before, what="vLLM after the refusal")
    rig.push(seed=32, version="step-32")  # a full update recovers


def test_a_whole_fused_group_may_travel_alone(rig):
    rig.push(seed=33, version="step-33")
    layer = "model.layers.1.self_attn"
    group = {f"{layer}.{p}_proj.weight" for p in "qkv"}
    with torch.no_grad():
        for name, p in rig.model.named_parameters():
            if name in group:
                p.mul_(1.5)
    rig.trainer(source=NamesSource(ModuleSource(rig.model), group)).send_weights(
        weight_version="step-33b"
    )
    rig.assert_serves_trainer()


def test_generation_between_start_and_the_first_weights_serves_the_old_model(rig):
    rig.push(seed=34, version="step-34")
    before = vllm_greedy(rig.llm)
    rig.llm.start_weight_update()
    assert_bit_identical(vllm_greedy(rig.llm), before, what="vLLM during start")
    rig.llm.finish_weight_update()
    assert_bit_identical(vllm_greedy(rig.llm), before, what="vLLM after finish")
    assert rig.fence()["state"] == "committed"


def test_malformed_updates_after_start_leave_the_engine_serving(rig):
    rig.push(seed=35, version="step-35")
    before = vllm_greedy(rig.llm)
    bad_updates: list[Any] = [[], {"abort": "x", "names": []}]
    for bad in bad_updates:
        rig.llm.start_weight_update()
        with pytest.raises(Exception):  # noqa: B017
            rig.llm.update_weights({"update_info": bad})
        assert_bit_identical(vllm_greedy(rig.llm), before, what=f"after {bad!r}")
        with contextlib.suppress(Exception):
            rig.llm.finish_weight_update()
    rig.push(seed=36, version="step-36")


def test_generation_while_weights_land_aborts_the_update_instead_of_the_engine(rig):
    rig.push(seed=37, version="step-37")
    randomize_weights_(rig.model, seed=38)
    client = GeneratesAfterFirstChunk(rig.client(), rig.llm)
    with pytest.raises(Exception, match="forward pass while the weight update"):
        rig.trainer(client=client).send_weights(weight_version="step-38")
    assert client.generated is not None  # the engine served the request
    status = rig.fence()
    assert status["state"] == "fenced"
    assert "generation was not paused" in status["reason"]
    vllm_greedy(rig.llm)  # and keeps serving
    rig.push(seed=38, version="step-38")  # a full resync clears the fence


class RecordsUpdates:
    """A client that records every update message it forwards."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.updates: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.updates.append(update_info)
        self.inner.update_weights(update_info)


def _send_headerless_expecting_refusal(rig: Rig, names: set[str], version: str) -> str:
    """Send only ``names`` of the trainer's model in raw update messages
    without a publication header (``verify_publication=False``); the update
    must be refused. Returns the refusal."""
    client = RecordsUpdates(rig.client())
    trainer = rig.trainer(
        client,
        source=NamesSource(ModuleSource(rig.model), names),
        verify_publication=False,
    )
    with pytest.raises(Exception) as info:  # the cause is checked below
        trainer.send_weights(weight_version=version)
    weights = [u for u in client.updates if "abort" not in u]
    assert weights, "no weights were sent"
    for update in weights:
        assert "publication" not in update  # raw: no header, no manifest
        assert set(update["names"]) <= names
    error = str(info.value)
    assert error.strip()
    return error


def _assert_refused_keeps_serving(rig: Rig, before: Any, cause: str) -> None:
    """The refused update left the old weights serving, the engine either
    not fenced or fenced naming ``cause``, and a full sync recovers."""
    assert_bit_identical(vllm_greedy(rig.llm), before, what="vLLM after the refusal")
    status = rig.fence()
    assert status["state"] in ("committed", "fenced"), status
    if status["state"] == "fenced":
        assert cause in status["reason"], status
    assert cause in (status["last_failure"] or ""), status


# (what travels alone, what the refusal must name)
PARTIAL_FUSED_GROUPS = {
    "q-without-k-and-v": (
        {"model.layers.0.self_attn.q_proj.weight"},
        [
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ],
    ),
    "gate-without-up": (
        {"model.layers.1.mlp.gate_proj.weight"},
        ["model.layers.1.mlp.up_proj.weight"],
    ),
}


@pytest.mark.parametrize(
    "names,missing", PARTIAL_FUSED_GROUPS.values(), ids=PARTIAL_FUSED_GROUPS.keys()
)
def test_a_headerless_update_of_part_of_a_fused_group_is_refused_at_finish(
    rig, names, missing
):
    rig.push(seed=41, version="step-41")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=42)  # would change the output if it landed
    error = _send_headerless_expecting_refusal(rig, names, "step-42-partial")
    assert "fused tensor group" in error
    for name in missing:
        assert name in error
    _assert_refused_keeps_serving(rig, before, missing[0])
    rig.push(seed=42, version="step-42")  # a full sync recovers
    assert rig.fence()["state"] == "committed"


def test_a_headerless_update_of_a_bias_without_its_weight_is_refused_at_finish(rig):
    biases = sorted(n for n, _ in rig.model.named_parameters() if n.endswith(".bias"))
    if not biases:
        pytest.skip("the tiny model has no biases; no layer has a part to send alone")
    bias = biases[0]
    weight = bias.removesuffix(".bias") + ".weight"
    rig.push(seed=43, version="step-43")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=44)
    error = _send_headerless_expecting_refusal(rig, {bias}, "step-44-partial")
    assert "without all of their parameters" in error and weight in error
    _assert_refused_keeps_serving(rig, before, weight)
    rig.push(seed=44, version="step-44")
    assert rig.fence()["state"] == "committed"


# ---------------------------------------------------------------------------
# Hostile publication headers and prepare messages


class RewritesHeader:
    """A client that overrides ``fields`` in every message's publication
    header: a client that claims what the trainer did not publish."""

    def __init__(self, inner: Any, **fields: Any) -> None:
        self.inner, self.fields = inner, fields

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        header = update_info.get("publication")
        if header is not None:
            update_info = {**update_info, "publication": {**header, **self.fields}}
        self.inner.update_weights(update_info)


class StrayPrepare:
    """A client after whose ``after``-th update message another client's
    prepare naming publication ``STRAY_ID`` reaches the engine; its refusal
    (None: accepted) is recorded, and the trainer's messages go on.
    ``publication_id`` is the trainer's publication, from its messages."""

    STRAY_ID = "0123456789abcdef"

    def __init__(self, inner: Any, after: int) -> None:
        self.inner, self.after = inner, after
        self.sent = 0
        self.refusal: str | None = None
        self.strayed = False
        self.publication_id: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        if self.sent == self.after and not self.strayed:
            self.strayed = True
            try:
                self.inner.update_weights({"prepare": self.STRAY_ID})
            except Exception as e:
                self.refusal = str(e)
        self.sent += 1
        header = update_info.get("publication")
        if header is not None:
            self.publication_id = header["publication_id"]
        self.inner.update_weights(update_info)


def test_hostile_publication_headers_are_refused_before_any_weight_lands(rig, tmp_path):
    """A version a day ahead of the clock (the default trainers' versions), a
    receipt directory outside the receipt root and another backend's header
    are each refused at the first message, naming the header field: the old
    weights serve, unfenced, and a default trainer is accepted after them."""
    rig.push(seed=51, version="step-51")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=52)  # would change the output if it landed
    day_ahead = time.time_ns() // 1000 + 23 * 3600 * 1_000_000
    outside = str(tmp_path / "vllm-wt-receipts-0123456789abcdef")
    hostile = {
        "model_version": rig.trainer(model_version=day_ahead),
        "receipt_dir": rig.trainer(RewritesHeader(rig.client(), receipt_dir=outside)),
        "backend": rig.trainer(RewritesHeader(rig.client(), backend="sharded_rdt")),
    }
    for field, trainer in hostile.items():
        with pytest.raises(Exception, match=rf"publication\.{field}"):
            trainer.send_weights(weight_version=f"hostile-{field}")
        assert_bit_identical(vllm_greedy(rig.llm), before, what=f"after {field}")
        status = rig.fence()
        assert status["state"] == "committed", status
        assert f"publication.{field}" in (status["last_failure"] or ""), status
    rig.push(seed=52, version="step-52")  # the new weights, exactly


def test_a_prepare_naming_another_publication_attests_nothing(rig):
    """Another client's prepare message inside a sync: before the first
    weights no publication is open and it prepares nothing, so the sync's
    weights are refused and the old ones serve, unfenced; after weights
    landed it is refused naming both publications, the update closes fenced
    with that cause, and a full sync recovers the trainer's weights."""
    rig.push(seed=53, version="step-53")
    before = vllm_greedy(rig.llm)
    randomize_weights_(rig.model, seed=54)
    early = StrayPrepare(rig.client(), after=0)
    with pytest.raises(Exception, match="after the trainer's prepare message"):
        rig.trainer(early).send_weights(weight_version="step-54-early")
    assert early.strayed and early.refusal is None
    assert_bit_identical(vllm_greedy(rig.llm), before, what="after the early prepare")
    assert rig.fence()["state"] == "committed"

    late = StrayPrepare(rig.client(), after=1)
    # vLLM's Worker closed the update at the refusal: the trainer's next
    # message is refused there.
    with pytest.raises(Exception, match="start_weight_update must be called"):
        rig.trainer(late).send_weights(weight_version="step-54-late")
    assert late.refusal is not None and late.publication_id is not None
    assert (
        f"names publication '{StrayPrepare.STRAY_ID}' but the open update is "
        f"publication {late.publication_id}"
    ) in late.refusal
    status = rig.fence()
    assert status["state"] == "fenced", status  # the first chunk had landed
    assert "update_info.prepare" in status["reason"], status
    assert is_fenced_version(rig.llm.get_weight_version())
    vllm_greedy(rig.llm)  # the engine keeps answering
    rig.push(seed=54, version="step-54")  # a full sync recovers exactly
    assert rig.fence()["state"] == "committed"
