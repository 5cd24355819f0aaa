# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A manifest against the served checkpoint's structure: dtypes must be of the
same kind (floating point of 16 bits or more, integer, bool) as the
checkpoint's tensors; a cast within a kind (bf16 for a stored fp32) is allowed.
A float8 or float4 format is a kind of its own: codes cast to bf16 (or bf16
cast to codes) would load meaningless values."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.landing.checkpoint_structure import (
    check_manifest_dtypes,
    checkpoint_dtype_kinds,
    dtype_kind,
    module_dtype_kinds,
)
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    ManifestMismatch,
)


@pytest.mark.parametrize(
    "dtype, kind",
    [
        (torch.bfloat16, "float"),
        (torch.float8_e4m3fn, "float8_e4m3fn"),
        (torch.float8_e5m2, "float8_e5m2"),
        (torch.float4_e2m1fn_x2, "float4_e2m1fn_x2"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        (torch.float64, "float"),
        ("int32", "int"),
        (torch.uint8, "int"),
        (torch.bool, "bool"),
        ("BF16", "float"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
        ("F16", "float"),
        ("F32", "float"),
        ("F7", None),
        ("I64", "int"),
        ("U8", "int"),
        ("BOOL", "bool"),
        ("?", None),
    ],
)
def test_dtype_kind(dtype, kind):
    assert dtype_kind(dtype) == kind


def _manifest(**dtypes: torch.dtype) -> Manifest:
    return Manifest.from_params(
        [ParamMeta(n.replace("_", "."), d, (4,)) for n, d in dtypes.items()]
    )


def test_float_bytes_declared_int32_are_refused_against_the_checkpoint(tmp_path):
    save_file(
        {
            "model.norm.weight": torch.ones(4),
            "model.embed.weight": torch.ones(4, dtype=torch.bfloat16),
            "model.mask": torch.ones(4, dtype=torch.bool),
        },
        str(tmp_path / "model.safetensors"),
    )
    kinds = checkpoint_dtype_kinds(SimpleNamespace(model=str(tmp_path)))
    assert kinds == {
        "model.norm.weight": "float",
        "model.embed.weight": "float",
        "model.mask": "bool",
    }
    check_manifest_dtypes(  # casts within a kind are the loader's business
        _manifest(model_norm_weight=torch.bfloat16, model_mask=torch.bool),
        kinds,
        "pub-0001",
    )
    with pytest.raises(
        ManifestMismatch,
        match=r"model.norm.weight as int32 \(served model: float\).*nothing was loaded",
    ):
        check_manifest_dtypes(_manifest(model_norm_weight=torch.int32), kinds, "p")


def test_module_parameters_stand_in_for_a_missing_checkpoint():
    kinds = module_dtype_kinds(torch.nn.Linear(2, 2))
    assert kinds == {"weight": "float", "bias": "float"}
    with pytest.raises(ManifestMismatch, match="bias as bool"):
        check_manifest_dtypes(_manifest(bias=torch.bool), kinds, "pub-0001")


def test_float8_codes_for_a_wider_checkpoint_and_the_reverse_are_refused(tmp_path):
    """Trainer-side quantized codes sent to an engine that quantizes on load
    (its checkpoint is bf16), and bf16 sent where the checkpoint holds float8
    codes: both refused, naming the formats; the same format passes."""
    save_file(
        {
            "model.a.weight": torch.ones(4, dtype=torch.bfloat16),
            "model.b.weight": torch.ones(4).to(torch.float8_e4m3fn),
            "model.b.weight_scale": torch.ones(1, dtype=torch.float32),
        },
        str(tmp_path / "model.safetensors"),
    )
    kinds = checkpoint_dtype_kinds(SimpleNamespace(model=str(tmp_path)))
    assert kinds == {
        "model.a.weight": "float",
        "model.b.weight": "float8_e4m3fn",
        "model.b.weight_scale": "float",
    }
    with pytest.raises(
        ManifestMismatch,
        match=r"model.a.weight as float8_e4m3fn \(served model: float\).*scales",
    ):
        check_manifest_dtypes(
            _manifest(model_a_weight=torch.float8_e4m3fn), kinds, "pub-0002"
        )
    with pytest.raises(
        ManifestMismatch, match=r"model.b.weight as bfloat16 \(served model: float8"
    ):
        check_manifest_dtypes(_manifest(model_b_weight=torch.bfloat16), kinds, "p")
    check_manifest_dtypes(
        _manifest(model_a_weight=torch.float32, model_b_weight=torch.float8_e4m3fn),
        kinds,
        "pub-0003",
    )


def test_parameters_quantized_on_load_are_not_taken_for_the_checkpoint():
    layer = torch.nn.Linear(2, 2)
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    assert module_dtype_kinds(layer) == {"bias": "float"}
