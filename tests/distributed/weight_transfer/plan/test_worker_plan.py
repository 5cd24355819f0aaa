# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan as plain data: grouping, byte counts, digest, JSON and dump."""

import json

import pytest

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.plan.worker_plan import (
    ParamCoverage,
    PartialModule,
    Region,
    SliceCopy,
    WorkerPlan,
    build_plan,
    with_direct_copies,
)

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def _copy(source, module, param, rows, offset=0, cols=4, dtype="bfloat16", start=0):
    return SliceCopy(
        slice=SliceSpec(
            source, (ViewOp("narrow", (0, start, rows)),), (rows, cols), dtype
        ),
        region=Region(module, param, offset, (rows, cols), (cols, 1), dtype),
    )


def _copies(rank=0):
    start = 2 * rank
    out = [_copy("model.embed_tokens.weight", "model.embed_tokens", "weight", 8)]
    for layer in (0, 1):
        prefix = f"model.layers.{layer}"
        qkv = f"{prefix}.self_attn.qkv_proj"
        out.append(
            _copy(f"{prefix}.self_attn.q_proj.weight", qkv, "weight", 2, 0, start=start)
        )
        out.append(
            _copy(f"{prefix}.self_attn.k_proj.weight", qkv, "weight", 2, 8, start=start)
        )
        out.append(
            SliceCopy(
                slice=SliceSpec(
                    f"{prefix}.input_layernorm.weight", (), (4,), "bfloat16"
                ),
                region=Region(
                    f"{prefix}.input_layernorm", "weight", 0, (4,), (1,), "bfloat16"
                ),
            )
        )
    out.append(_copy("lm_head.weight", "lm_head", "weight", 8))
    return out  # model.norm.weight is never copied


def test_groups_follow_layers_with_one_group_before_and_after():
    plan = build_plan(worker="tp0/2", names=NAMES, copies=_copies())
    assert [g.index for g in plan.groups] == [0, 1, 2, 3]
    assert plan.groups[0].names == ("model.embed_tokens.weight",)
    assert all(n.startswith("model.layers.0.") for n in plan.groups[1].names)
    assert all(n.startswith("model.layers.1.") for n in plan.groups[2].names)
    assert plan.groups[3].names == ("model.norm.weight", "lm_head.weight")
    assert [len(g.copies) for g in plan.groups] == [1, 3, 3, 1]


def test_names_without_copies_are_not_needed():
    plan = build_plan(worker="tp0/2", names=NAMES, copies=_copies())
    assert plan.unused_names == ("model.norm.weight",)
    assert "not needed on this worker: model.norm.weight" in plan.dump()


def test_completes_lists_each_module_in_the_group_of_its_last_copy():
    plan = build_plan(worker="w", names=NAMES, copies=_copies())
    assert plan.groups[1].completes == (
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.input_layernorm",
    )
    assert plan.groups[3].completes == ("lm_head",)


def test_byte_counts_sum_distinct_slices():
    copies = _copies()
    plan = build_plan(worker="w", names=NAMES, copies=[*copies, copies[0]])
    # embed 8x4 + 2 layers x (2x4 + 2x4 + 4) + lm_head 8x4, all bf16.
    assert plan.nbytes == 2 * (32 + 2 * (8 + 8 + 4) + 32)
    assert plan.groups[0].nbytes == 64
    assert len(plan.groups[0].copies) == 2 and len(plan.groups[0].slices) == 1
    assert plan.bytes_by_source()["model.layers.1.self_attn.k_proj.weight"] == 16


def test_digest_is_stable_and_tracks_content_not_label():
    a = build_plan(worker="tp0/2", names=NAMES, copies=_copies(0))
    b = build_plan(worker="another label", names=NAMES, copies=_copies(0))
    c = build_plan(worker="tp1/2", names=NAMES, copies=_copies(1))
    assert a.digest() == b.digest()
    assert len(a.digest()) == 32
    assert a.digest() != c.digest()


def test_plan_round_trips_through_json():
    partial = PartialModule("m", 3, 8, (ParamCoverage("weight", 3, 8),))
    plan = build_plan(
        worker="w", names=NAMES, copies=_copies(), partial_modules=[partial]
    )
    again = WorkerPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert again.digest() == plan.digest()


def test_dump_lists_every_copy_and_partial_module():
    partial = PartialModule(
        "model.layers.0.self_attn.qkv_proj", 16, 24, (ParamCoverage("weight", 16, 24),)
    )
    plan = build_plan(
        worker="tp0/2", names=NAMES, copies=_copies(), partial_modules=[partial]
    )
    text = plan.dump()
    assert plan.digest() in text
    assert "'model.layers.1.self_attn.k_proj.weight' -> narrow(0, 0, 2)" in text
    assert "model.layers.1.self_attn.qkv_proj.weight[offset 8" in text
    assert "PARTLY COVERED model.layers.0.self_attn.qkv_proj: 16/24" in text


def test_copy_from_unknown_name_is_refused():
    with pytest.raises(ValueError, match="'other.weight'"):
        build_plan(worker="w", names=NAMES, copies=[_copy("other.weight", "m", "w", 2)])


def test_slice_and_region_sizes_must_agree():
    with pytest.raises(ValueError, match="elements"):
        SliceCopy(
            slice=SliceSpec("w", (), (4,), "float32"),
            region=Region("m", "weight", 0, (2,), (1,), "float32"),
        )


def test_direct_copies_join_their_groups_and_are_never_processed():
    """Trainer-side FP8 codes of layer 1's q and k: planned with the layers'
    other copies by the group of their source, while their module is in no
    group's ``completes`` (nothing processes what they write)."""
    qkv = "model.layers.1.self_attn.qkv_proj"
    loaded = [
        c for c in _copies() if c.region.module != qkv
    ]  # the loaders' plan leaves the codes' module out
    plan = build_plan(worker="w", names=NAMES, copies=loaded)
    codes = [
        _copy(
            "model.layers.1.self_attn.q_proj.weight",
            qkv,
            "weight",
            2,
            0,
            dtype="float8_e4m3fn",
        ),
        _copy(
            "model.layers.1.self_attn.k_proj.weight",
            qkv,
            "weight",
            2,
            8,
            dtype="float8_e4m3fn",
        ),
    ]
    merged = with_direct_copies(plan, NAMES, codes)
    layer1 = merged.groups[2]
    assert set(codes) <= set(layer1.copies)
    assert qkv not in {m for g in merged.groups for m in g.completes}
    assert "model.layers.1.input_layernorm" in layer1.completes
    assert set(merged.copies) == set(loaded) | set(codes)


def test_a_module_with_processed_and_direct_copies_is_refused():
    plan = build_plan(worker="w", names=NAMES, copies=_copies())
    code = _copy(
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.qkv_proj",
        "weight",
        2,
        dtype="float8_e4m3fn",
    )
    with pytest.raises(ValueError, match="both processed and direct copies"):
        with_direct_copies(plan, NAMES, [code])
