# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side block FP8 codes (``fp8_codes.Fp8BlockCodes``) for engines that
serve DeepSeek-style FP8 checkpoints (``weight_scale_inv``, 128x128 tiles).

vLLM CPU starts no engine that serves block FP8, so these run without one:
the trainer's quantizer equals, bit for bit, the quantizer vLLM's
``fp8_per_block`` online scheme runs on the worker (``per_block_cast_to_fp8``,
called here on the CPU); the source sends codes and ``weight_scale_inv`` in
checkpoint names; tensor-parallel shards and fused layers give the same codes
only along whole tiles; and a trainer quantizing with another block size is
refused by the manifest check every update runs against the checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm.distributed.weight_transfer import ModuleSource
from vllm.distributed.weight_transfer.landing.checkpoint_structure import (
    check_manifest_shapes,
    checkpoint_shapes,
)
from vllm.distributed.weight_transfer.quant.fp8 import (
    FP8_CODES,
    Fp8BlockCodes,
    quantize_fp8_per_block,
    tile_aligned,
)
from vllm.distributed.weight_transfer.verification import Manifest, ManifestMismatch


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(256, 384), (300, 130)], ids=["whole", "cut"])
def test_trainer_quantizer_equals_vllms_online_block_quantizer(shape):
    # vLLM's own quantizer (absent where only the fork's modules are, as on
    # the GPU machine the device tests run on).
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    per_block_cast_to_fp8 = deep_gemm.per_block_cast_to_fp8

    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.rand(shape[0], 1) * 4
    weight[:3] = 0.0  # an all-zero row band still gets a positive scale
    codes, scale = quantize_fp8_per_block(weight, torch.bfloat16)
    expected_codes, expected_scale = per_block_cast_to_fp8(
        weight.to(torch.bfloat16), block_size=[128, 128], use_ue8m0=False
    )
    assert codes.shape == weight.shape and codes.dtype == FP8_CODES
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert _same_codes(codes, expected_codes)
    assert torch.equal(scale, expected_scale)


def test_the_source_sends_codes_and_scale_inv_in_checkpoint_names():
    net = torch.nn.Module()
    net.q_proj = torch.nn.Linear(200, 256, bias=False)
    net.norm = torch.nn.LayerNorm(200)
    source = Fp8BlockCodes(ModuleSource(net), dtype=torch.float32)
    metas = {m.name: (m.dtype, tuple(m.shape)) for m in source.metadata()}
    assert metas == {
        "q_proj.weight": (FP8_CODES, (256, 200)),
        "q_proj.weight_scale_inv": (torch.float32, (2, 2)),
        "norm.weight": (torch.float32, (200,)),
        "norm.bias": (torch.float32, (200,)),
    }
    sent = dict(iter(source))
    assert list(sent) == list(metas)
    codes, scale = quantize_fp8_per_block(net.q_proj.weight, torch.float32)
    assert _same_codes(sent["q_proj.weight"], codes)
    assert torch.equal(sent["q_proj.weight_scale_inv"], scale)
    held = source.held_names()
    assert held is None or "q_proj.weight_scale_inv" in held


def test_shards_along_whole_tiles_equal_slices_of_the_whole_tensor():
    torch.manual_seed(1)
    weight = torch.randn(512, 256)
    codes, scale = quantize_fp8_per_block(weight)
    # Two row shards of 256 rows (two tiles each): what each TP rank computes.
    assert tile_aligned(512, 2)
    for rank in range(2):
        rows = slice(rank * 256, (rank + 1) * 256)
        part_codes, part_scale = quantize_fp8_per_block(weight[rows])
        assert _same_codes(part_codes, codes[rows])
        assert torch.equal(part_scale, scale[rank * 2 : (rank + 1) * 2])
    # Four shards of 128 rows are still whole tiles; eight of 64 are not, and
    # a half tile's amax is not the whole tile's.
    assert tile_aligned(512, 4) and not tile_aligned(512, 8)
    weight[0, 0] = 1000.0
    codes, scale = quantize_fp8_per_block(weight)
    half_codes, half_scale = quantize_fp8_per_block(weight[64:128])
    assert not torch.equal(half_scale, scale[:1, :])
    assert not _same_codes(half_codes, codes[64:128])


def test_codes_of_another_block_size_are_refused_against_the_checkpoint(tmp_path):
    net = torch.nn.Module()
    net.o_proj = torch.nn.Linear(256, 256, bias=False)
    served = dict(iter(Fp8BlockCodes(ModuleSource(net))))
    save_file(
        {name: t.contiguous() for name, t in served.items()},
        str(tmp_path / "model.safetensors"),
    )
    shapes = checkpoint_shapes(SimpleNamespace(model=str(tmp_path), revision=None))
    assert shapes is not None and shapes["o_proj.weight_scale_inv"] == (2, 2)
    same = Manifest.from_params(Fp8BlockCodes(ModuleSource(net)).metadata())
    check_manifest_shapes(same, shapes, "p0")
    other = Fp8BlockCodes(ModuleSource(net), block=(64, 64))
    with pytest.raises(ManifestMismatch, match=r"o_proj\.weight_scale_inv \[4, 4\]"):
        check_manifest_shapes(Manifest.from_params(other.metadata()), shapes, "p1")
