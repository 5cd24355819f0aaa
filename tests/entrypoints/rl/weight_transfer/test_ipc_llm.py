# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end through an offline ``LLM`` on CPU: the ``ipc`` backend lands the
trainer's weights, and after every update vLLM serves bit for bit what a fresh
vLLM load of those weights serves (``testing.fresh_load``); in float32 its
greedy tokens and logprobs also equal a Hugging Face forward pass.

One engine per (model, dtype, TP) combination, shared by every scenario in this
file: dense bf16 and MoE fp32 at TP=1, dense fp32 and MoE bf16 at TP=2. The
two float32 engines run their linear layers plain (``cpu_linear="plain"``:
they keep their weight tensors, and their post-load processing keeps the
bytes) and land planned (``landing="planned"``: those layers' tensors are
copied straight into the served tensors, the MoE experts reload). Each test
first pushes the trainer state it checks, so tests do not depend on order.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch

from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
from vllm.distributed.weight_transfer.testing import (
    FreshLoadOracle,
    GreedyResult,
    TinyModelSpec,
    assert_bit_identical,
    assert_serves_weights,
    build_tiny_model,
    load_hf_model,
    offline_worker_call,
    randomize_weights_,
    save_checkpoint,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.ipc_faults import worker_fence_status
from vllm.distributed.weight_transfer.testing.multirank import (
    join_trainer_ranks,
    serve_relayed_calls,
    start_trainer_ranks,
    trainer_weights,
    worker_ipc_update_keys,
)
from vllm.distributed.weight_transfer.testing.served_layers import (
    chunk_program_state,
    kept_shared_segments,
    linear_layer_states,
    planned_landing_state,
    short_messages,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm
from vllm.distributed.weight_transfer.trainer.sources import CheckpointNamesSource

pytestmark = pytest.mark.slow

# A small cap so every push spans several chunks (the models are ~2 MB).
CHUNK_CAP = 256 * 1024


@dataclass(frozen=True)
class Combo:
    arch: str
    dtype: str
    tp: int
    # WeightTransferConfig.cpu_linear and .landing of the engine.
    cpu_linear: Literal["packed", "plain"] = "packed"
    landing: Literal["reload", "planned"] = "reload"

    @property
    def id(self) -> str:
        plain = "-plain" if self.cpu_linear == "plain" else ""
        planned = "-planned" if self.landing == "planned" else ""
        return f"{self.arch}-{self.dtype}-tp{self.tp}{plain}{planned}"


COMBOS = [
    Combo("qwen3", "bfloat16", 1),
    # Plain CPU linear layers (the fresh-load oracle uses the same setting);
    # the experts stay vLLM's.
    Combo("qwen3_moe", "float32", 1, cpu_linear="plain", landing="planned"),
    Combo("qwen3", "float32", 2, cpu_linear="plain", landing="planned"),
    Combo("qwen3_moe", "bfloat16", 2),
]


@dataclass
class Rig:
    combo: Combo
    llm: Any
    model_dir: Any
    trainer_model: torch.nn.Module

    @property
    def oracle(self) -> FreshLoadOracle:
        return FreshLoadOracle(offline_worker_call(self.llm), self.greedy)

    def source(self) -> WeightSource:
        if self.combo.arch == "qwen3_moe":
            return CheckpointNamesSource(self.trainer_model)
        return ModuleSource(self.trainer_model)

    def push(self, source: WeightSource | None = None, **init_kwargs) -> Any:
        engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, **init_kwargs),
            client=OfflineLLMWeightSyncClient(self.llm),
            source=source or self.source(),
        )
        engine.send_weights()
        return engine

    def greedy(self) -> GreedyResult:
        # MKL's float32 GEMM (plain linear layers) is not batch-invariant:
        # each prompt alone gives every step the same shapes every time.
        plain = self.combo.cpu_linear == "plain"
        return vllm_greedy(self.llm, one_at_a_time=plain)

    def assert_serves(self, model: torch.nn.Module | None = None) -> GreedyResult:
        """vLLM serves exactly what a fresh load of ``model`` (default: the
        trainer model) serves; in fp32 also the HF forward's output."""
        model = model if model is not None else self.trainer_model
        return assert_serves_weights(self.oracle, model, dtype=self.combo.dtype)


@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: c.id)
def rig(request):
    combo: Combo = request.param
    model_dir = build_tiny_model(TinyModelSpec(arch=combo.arch))  # type: ignore[arg-type]
    env = {
        # TP=2 on CPU binds one core per worker; collective_rpc(fn) needs the
        # function pickled (test-only: reads which buffers each worker used).
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if combo.tp == 2 else None,
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    llm = tiny_llm(
        model_dir,
        dtype=combo.dtype,
        tensor_parallel_size=combo.tp,
        weight_transfer_config=WeightTransferConfig(
            backend="ipc", cpu_linear=combo.cpu_linear, landing=combo.landing
        ),
        in_process=True,
    )
    try:
        yield Rig(combo, llm, model_dir, load_hf_model(model_dir, combo.dtype))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SubsetSource(WeightSource):
    """Only ``names`` of ``inner``, in its order."""

    def __init__(self, inner: WeightSource, names: set[str]) -> None:
        self.inner, self.names = inner, names

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self.inner.metadata() if m.name in self.names]

    def __iter__(self):
        for name, tensor in self.inner:
            if name in self.names:
                yield name, tensor


class BreakingSource(WeightSource):
    """``inner`` whose last tensor is yielded at a shape metadata() does not
    announce: the trainer finds out only after the earlier chunks were sent."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self):
        items = list(self.inner)
        name, last = items[-1]
        return iter(items[:-1] + [(name, last.unsqueeze(-1))])


def test_before_any_update_vllm_serves_the_checkpoint(rig):
    rig.assert_serves(load_hf_model(rig.model_dir, rig.combo.dtype))


def test_pushing_unchanged_weights_leaves_the_output_unchanged(rig):
    # Guards the reload path itself: CPU MoE experts must be prepacked again
    # after every reload, or pushing the very weights vLLM holds changes its
    # output. The first push establishes a state the oracle agrees with.
    randomize_weights_(rig.trainer_model, seed=5)
    rig.push()
    rig.assert_serves()
    before = rig.greedy()
    rig.push()
    assert_bit_identical(rig.greedy(), before, what="vLLM after a no-op push")


@pytest.mark.parametrize("overlap", [True, False])
def test_packed_update_serves_the_new_weights(rig, overlap):
    randomize_weights_(rig.trainer_model, seed=11 + overlap)
    # the 512 KiB embedding exceeds the 256 KiB buffer's halves: with overlap
    # it travels alone, the other chunks alternate halves
    engine = rig.push(
        packed=True, packed_buffer_size_bytes=CHUNK_CAP, overlap_chunks=overlap
    )
    assert len(engine.last_plan.chunks) > 2
    assert engine.last_plan.overlapped == overlap
    rig.assert_serves()


def test_unpacked_update_serves_the_new_weights(rig):
    randomize_weights_(rig.trainer_model, seed=12)
    rig.push(packed=False, packed_buffer_size_bytes=CHUNK_CAP)
    rig.assert_serves()


def test_second_update_after_in_place_change_uses_the_same_trainer_engine(rig):
    """The trainer keeps its packed buffer (the CPU default) and the workers
    keep it mapped: with the planned landing, each chunk's copies are bound
    to it at the first sync and run again at the second, not bound again."""
    randomize_weights_(rig.trainer_model, seed=13)
    engine = rig.push(packed_buffer_size_bytes=CHUNK_CAP)
    kept = rig.llm.collective_rpc(kept_shared_segments)
    assert engine._kept_buffer is not None
    assert kept == [[engine._kept_buffer.handle.name]] * rig.combo.tp
    first = rig.llm.collective_rpc(chunk_program_state)
    randomize_weights_(rig.trainer_model, seed=14)  # in place, like an optimizer
    engine.send_weights()
    rig.assert_serves()
    assert rig.llm.collective_rpc(kept_shared_segments) == kept
    again = rig.llm.collective_rpc(chunk_program_state)
    if rig.combo.landing != "planned":
        assert first == again == [{}] * rig.combo.tp
        return
    chunks = len(engine.last_plan.chunks)
    for before, after in zip(first, again, strict=True):
        assert after["binds"] == before["binds"], (before, after)
        assert after["reused"] - before["reused"] == chunks, (before, after)
        assert after["names"] > 0


def test_update_carrying_only_some_names(rig):
    randomize_weights_(rig.trainer_model, seed=15)
    rig.push()
    changed = {"lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"}
    gen = torch.Generator().manual_seed(16)
    with torch.no_grad():
        for name, p in rig.trainer_model.named_parameters():
            if name in changed:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
    rig.push(SubsetSource(rig.source(), changed))
    rig.assert_serves()


def _rejected_update_keeps_serving(rig) -> None:
    rig.llm.start_weight_update()
    with pytest.raises(Exception, match="offsets"):
        rig.llm.update_weights(
            {
                "update_info": {
                    "names": ["lm_head.weight"],
                    "dtype_names": [rig.combo.dtype],
                    "shapes": [[4]],
                    "tensor_sizes": [4 * getattr(torch, rig.combo.dtype).itemsize],
                    "offsets": [3],
                    "ipc_handles": {
                        "cpu:x:0": {"kind": "shm", "name": "vllm-wt-x", "nbytes": 64}
                    },
                }
            }
        )
    rig.assert_serves()


def test_a_failed_update_leaves_the_engine_serving(rig):
    randomize_weights_(rig.trainer_model, seed=17)
    rig.push()

    # worker-side rejection after start, while layers sit on the meta device.
    # At TP>1 every worker refuses: vLLM 0.32's executor would leave the other
    # workers' replies queued for the next RPC; the fork's rpc_replies plugin
    # keeps them in step, and the pushes below show it.
    _rejected_update_keeps_serving(rig)

    # trainer-side failure after several chunks went through: the trainer aborts
    with pytest.raises(ValueError, match="with shape"):
        rig.push(BreakingSource(rig.source()), packed_buffer_size_bytes=CHUNK_CAP)
    rig.assert_serves()

    # and the next update works
    randomize_weights_(rig.trainer_model, seed=18)
    rig.push()
    rig.assert_serves()


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "dtensor"])
def test_two_rank_trainer_feeds_each_worker_from_its_own_rank(rig, sharded):
    if (rig.combo.arch, rig.combo.dtype, rig.combo.tp) != ("qwen3", "float32", 2):
        pytest.skip("runs on the dense fp32 TP=2 engine only")
    """Two gloo ranks each send the whole model from a packed buffer they
    keep, twice (the weights change in place between the syncs); each worker
    maps its own rank's buffer once and, with the planned landing, binds
    each chunk's copies to it at the first sync and runs them again at the
    second: the path of trainers whose tensors are new at every sync.
    ``dtensor``: the ranks hold the model as DTensors (FSDP2's layout), and
    each rank gathers every tensor's shards into its slot of the buffer."""
    seed = 21
    spec = TinyModelSpec(arch="qwen3")
    before = rig.llm.collective_rpc(chunk_program_state)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    procs = start_trainer_ranks(
        spec,
        seed,
        world_size=2,
        conn=child,
        syncs=2,
        sharded=sharded,
        packed_buffer_size_bytes=CHUNK_CAP,
    )
    try:
        payloads = serve_relayed_calls(parent, OfflineLLMWeightSyncClient(rig.llm))
    finally:
        join_trainer_ranks(procs)
    chunks = [p for p in payloads if "ipc_handles" in p]  # not the prepare
    assert len(chunks) > 2 and len(chunks) % 2 == 0
    for payload in chunks:
        keys = sorted(payload["ipc_handles"])
        assert [k.rsplit(":", 1)[1] for k in keys] == ["0", "1"]
        assert all(h.get("persistent") for h in payload["ipc_handles"].values())
    # worker with local rank r read trainer rank r's buffers
    per_worker = rig.llm.collective_rpc(worker_ipc_update_keys)
    assert [[k.rsplit(":", 1)[1] for k in keys] for keys in per_worker] == [
        ["0"],
        ["1"],
    ]
    kept = rig.llm.collective_rpc(kept_shared_segments)
    assert len(kept[0]) == len(kept[1]) == 1 and kept[0] != kept[1]
    per_sync = len(chunks) // 2
    if rig.combo.landing == "planned":
        after = rig.llm.collective_rpc(chunk_program_state)
        for old, new in zip(before, after, strict=True):
            assert new["binds"] - old.get("binds", 0) == per_sync, (old, new)
            assert new["reused"] - old.get("reused", 0) == per_sync, (old, new)
    trainer_model = trainer_weights(spec, seed, syncs=2)
    rig.assert_serves(trainer_model)
    # keep the shared rig's trainer model in step with the engine
    rig.trainer_model.load_state_dict(trainer_model.state_dict())


class OneWrongByteSource(WeightSource):
    """``inner`` with one byte of tensor ``name`` flipped in a copy: the top
    mantissa bit of its first element (the trainer's tensor is untouched)."""

    def __init__(self, inner: WeightSource, name: str) -> None:
        self.inner, self.name = inner, name

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self):
        for name, tensor in self.inner:
            if name == self.name:
                tensor = tensor.detach().clone().contiguous()
                raw = tensor.view(-1).view(torch.uint8)
                raw[tensor.element_size() - 2] ^= 0x40
            yield name, tensor


def test_one_wrong_byte_of_one_expert_fails_the_oracle(rig):
    """The gate is sharp: a sync that lands one wrong byte of one expert (one
    MLP weight for dense models) does not pass it."""
    name = (
        "model.layers.0.mlp.experts.0.gate_proj.weight"
        if rig.combo.arch == "qwen3_moe"
        else "model.layers.0.mlp.gate_proj.weight"
    )
    randomize_weights_(rig.trainer_model, seed=19)
    rig.push(OneWrongByteSource(rig.source(), name))
    with pytest.raises(AssertionError, match="fresh load"):
        rig.oracle.assert_serves(rig.trainer_model)
    rig.push()
    rig.assert_serves()


def test_the_fresh_load_reference_equals_a_separately_started_engine(rig, tmp_path):
    """What ``FreshLoadOracle`` measures inside the engine under test is what
    a second engine, started on a checkpoint of the trainer's weights, serves.
    Run on the combination whose HF comparison depends on the CPU (MoE, bf16,
    TP=2); the other combinations share its code path."""
    if (rig.combo.arch, rig.combo.dtype, rig.combo.tp) != ("qwen3_moe", "bfloat16", 2):
        pytest.skip("one separately started engine is enough")
    import shutil

    randomize_weights_(rig.trainer_model, seed=11)
    rig.push()
    served = rig.assert_serves()
    checkpoint = save_checkpoint(rig.trainer_model, tmp_path / "checkpoint")
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (rig.model_dir / extra).exists():
            shutil.copy(rig.model_dir / extra, checkpoint / extra)
    fresh = tiny_llm(
        checkpoint,
        dtype=rig.combo.dtype,
        tensor_parallel_size=rig.combo.tp,
        backend=None,
        worker_extension_cls="",  # a plain engine, nothing of the fork's
    )
    try:
        assert_bit_identical(
            vllm_greedy(fresh), served, what="a separately started engine"
        )
    finally:
        fresh.llm_engine.engine_core.shutdown()
        del fresh


def test_linear_layers_keep_their_tensors_only_when_plain(rig):
    """``cpu_linear="plain"``: every linear layer keeps its weight tensor, runs
    torch's linear, and its post-load processing keeps the loaded bytes (on a
    copy, with marker values), on every TP rank, after the syncs above too.
    Packed layers hand their bytes to a kernel handle, where nothing can land
    in place (when vLLM CPU has oneDNN)."""
    from vllm import _custom_ops

    plain = rig.combo.cpu_linear == "plain"
    rig.push()
    for states in rig.llm.collective_rpc(linear_layer_states):
        assert states, "no linear layer found"
        for name, state in states.items():
            if plain:
                assert state == {
                    "weight_numel": state["weight_numel"],
                    "plain": True,
                    "keeps_bytes": True,
                }, name
                assert state["weight_numel"] > 0, name
            elif _custom_ops._supports_onednn:
                assert not state["plain"] and not state["keeps_bytes"], (name, state)
    rig.assert_serves()


def test_planned_landing_copies_straight_into_the_served_tensors(rig):
    """``landing="planned"``: after a sync every linear layer, norm and
    embedding took its bytes straight from the trainer's tensors on every TP
    rank; only the MoE experts (which vLLM CPU repacks) went through the
    layerwise reload, each for the reason it names. Reload engines keep no
    plan. With checksums on, every worker read the planned landing back
    (each landed region equals the trainer's slice) before its receipt."""
    randomize_weights_(rig.trainer_model, seed=21)
    rig.push(verify_checksums=True)
    states = rig.llm.collective_rpc(planned_landing_state)
    if rig.combo.landing != "planned":
        assert states == [{}] * rig.combo.tp
        return
    for state in states:
        assert state["still_bound"]
        direct = state["direct_names"]
        assert any(n.endswith("q_proj.weight") for n in direct), direct
        assert any(n.endswith("input_layernorm.weight") for n in direct), direct
        for module, reason in state["reloaded"].items():
            assert rig.combo.arch == "qwen3_moe" and ".experts" in module, (
                module,
                reason,
            )
        if rig.combo.arch == "qwen3_moe":
            assert state["reloaded"], "the MoE experts must reload"
            assert not any(".experts." in n for n in direct)
    rig.assert_serves()


def test_trainer_parameters_in_shared_memory_are_read_in_place(rig):
    """A trainer whose parameters live in shared memory
    (``SharedParameters``) sends them unpacked: with the planned landing each
    byte is copied once, from the trainer's tensor into the served one. The
    workers keep the segment mapped for the next sync, which follows an
    in-place change, as an optimizer step makes; the dense trainer sends
    with ``shared.source(model)``, so that second sync names the layout the
    workers parsed at the first instead of repeating it. (The MoE source
    renames expert tensors; whatever it yields outside the segment is
    packed.) The parameters are placed in three segments or so, which every
    message names together and the workers keep mapped."""
    import copy

    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    dense = rig.combo.arch == "qwen3"
    model = copy.deepcopy(rig.trainer_model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shared = SharedParameters.place(model, max_segment_bytes=total // 3)
    assert shared.num_segments >= 3
    try:
        randomize_weights_(model, seed=31)
        source = shared.source(model) if dense else CheckpointNamesSource(model)
        # Checksums on: the landings through the bound programs are read back.
        engine = rig.push(source, verify_checksums=True)
        rig.assert_serves(model)
        kept = rig.llm.collective_rpc(kept_shared_segments)
        if dense:
            assert engine._kept_buffer is None, "nothing was packed"
            assert kept == [sorted(shared.shm_names)] * rig.combo.tp
        programs = rig.llm.collective_rpc(chunk_program_state)
        randomize_weights_(model, seed=32)
        engine.send_weights()
        rig.assert_serves(model)
        assert rig.llm.collective_rpc(kept_shared_segments) == kept
        if dense:
            assert rig.llm.collective_rpc(short_messages) == [1] * rig.combo.tp
        # With the planned landing, each chunk read from the segment landed
        # through a copy program bound at the first sync and run again at
        # the second (not bound again).
        again = rig.llm.collective_rpc(chunk_program_state)
        if rig.combo.landing != "planned":
            assert programs == again == [{}] * rig.combo.tp
        elif dense:
            for state, later in zip(programs, again, strict=True):
                assert state["binds"] >= 1 and state["names"] > 0, state
                assert later["binds"] == state["binds"], (state, later)
                assert later["reused"] > state["reused"], (state, later)
        if dense:
            # The second sync checked its source while the workers landed
            # the short form (check_while_landing). A parameter re-allocated
            # after it is found the same way at the third: that update is
            # aborted before its commit and the same send_weights goes whole
            # (the moved tensor packed), serving exactly the new weights,
            # nothing left fenced.
            assert engine.checked_while_landing == 1
            first = next(model.parameters())
            first.data = first.data.clone()
            randomize_weights_(model, seed=33)
            engine.send_weights()
            rig.assert_serves(model)
            assert engine.checked_while_landing == 1
            assert engine._kept_buffer is not None, "the moved tensor was packed"
            states = rig.llm.collective_rpc(worker_fence_status)
            assert [s["state"] for s in states] == ["committed"] * rig.combo.tp
    finally:
        shared.close()


class RecordingLLMClient(OfflineLLMWeightSyncClient):
    """Keeps every update message sent (``sent``) and rewrites each short
    form with ``tamper`` when set."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm)
        self.sent: list[dict[str, Any]] = []
        self.tamper: Any = None

    def update_weights(self, update_info: Any) -> None:
        short = "layout" in update_info and "names" not in update_info
        if short and self.tamper is not None:
            update_info = self.tamper(dict(update_info))
        self.sent.append(update_info)
        super().update_weights(update_info)


Q_PROJ_0 = "model.layers.0.self_attn.q_proj.weight"
Q_PROJ_1 = "model.layers.1.self_attn.q_proj.weight"


def _hostile_copy(full: dict[str, Any]) -> dict[str, Any]:
    """The trainer's full message, headerless, under its layout id, with the
    two ``q_proj`` names swapped (same shapes) and a segment that does not
    exist."""
    hostile = {
        k: v for k, v in full.items() if k not in ("publication", "payload_checksums")
    }
    names = list(hostile["names"])
    i, j = names.index(Q_PROJ_0), names.index(Q_PROJ_1)
    names[i], names[j] = names[j], names[i]
    (key,) = hostile["ipc_handles"]
    handle = {**hostile["ipc_handles"][key], "name": "vllm-wt-no-such-segment"}
    return {**hostile, "names": names, "ipc_handles": {key: handle}}


def _assert_unfenced(rig) -> None:
    states = rig.llm.collective_rpc(worker_fence_status)
    assert all(s["state"] != "fenced" for s in states), states


def test_a_refused_message_under_the_layout_id_changes_no_later_short_form(rig):
    """A trainer on ``SharedParameters`` syncs twice (the second names the
    first's layout id). A client then sends, between start and finish, the
    trainer's full message under that id with two ``q_proj`` names swapped
    and a segment that does not exist: refused, nothing lands, not fenced.
    The trainer's next short form serves exactly its weights (the fresh-load
    oracle). A short form whose layout digest is not the one the workers
    hold is refused, unfenced, with the old weights serving; the next sync
    goes whole. (One engine: the layout memo is per worker, whatever the
    model or TP.)"""
    if rig.combo.id != "qwen3-bfloat16-tp1":
        pytest.skip("runs on the dense bf16 TP=1 engine only")
    import copy

    from vllm.distributed.weight_transfer.ipc.shared_params import SharedParameters

    model = copy.deepcopy(rig.trainer_model)
    shared = SharedParameters.place(model)
    client = RecordingLLMClient(rig.llm)
    try:
        randomize_weights_(model, seed=41)
        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, verify_checksums=True),
            client=client,
            source=shared.source(model),
        )
        trainer.send_weights()
        (shorts,) = rig.llm.collective_rpc(short_messages)
        randomize_weights_(model, seed=42)
        trainer.send_weights()
        assert rig.llm.collective_rpc(short_messages) == [shorts + 1]
        full = next(m for m in client.sent if "names" in m and "layout" in m)

        rig.llm.start_weight_update()
        with pytest.raises(Exception, match="vllm-wt-no-such-segment"):
            rig.llm.update_weights({"update_info": _hostile_copy(full)})
        # (vLLM's Worker closes an update whose update_weights raised.)
        _assert_unfenced(rig)
        rig.assert_serves(model)

        randomize_weights_(model, seed=43)
        trainer.send_weights()
        assert rig.llm.collective_rpc(short_messages) == [shorts + 2]
        rig.assert_serves(model)

        served = copy.deepcopy(model)
        client.tamper = lambda m: {**m, "layout_digest": "0" * 64}
        randomize_weights_(model, seed=44)
        with pytest.raises(Exception, match="update_info.layout_digest is 0000"):
            trainer.send_weights()
        _assert_unfenced(rig)
        rig.assert_serves(served)
        client.tamper = None
        before = len(client.sent)
        trainer.send_weights()
        after = [m for m in client.sent[before:] if "layout" in m]
        assert after and all("names" in m for m in after), "the sync went whole"
        rig.assert_serves(model)
    finally:
        shared.close()
