# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A manifest against the served checkpoint's structure: dtypes must be of the
same kind (floating point, integer, bool) as the checkpoint's tensors; a cast
within a kind (bf16 for a stored fp32) is allowed."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.checkpoint_structure import (
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
        (torch.float8_e4m3fn, "float"),
        ("int32", "int"),
        (torch.uint8, "int"),
        (torch.bool, "bool"),
        ("BF16", "float"),
        ("F8_E4M3", "float"),
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
