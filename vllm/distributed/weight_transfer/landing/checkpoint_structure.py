# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The served model's checkpoint structure, for checking a manifest against it.

A worker that receives whole checkpoint-format tensors (``ipc``) hands them to
``model.load_weights``, which expects the shapes of the checkpoint the server
was started from. A trainer whose model differs (one tensor of another shape)
would otherwise be found out only when that tensor's layer loads, after
earlier layers already took new weights. ``checkpoint_shapes`` reads the
tensor shapes from the safetensors headers of the served checkpoint (no tensor
data is read), and ``check_manifest_shapes`` compares a publication's manifest
with them before anything lands.

Only names present in both are compared: a trainer may send names the
checkpoint lacks (a tied ``lm_head``) or omit some (a partial update). Exact
dtypes are not compared, since a checkpoint stored in bf16 may be served in
fp32, but their kind is (``dtype_kind``: floating point, integer, bool,
complex): the loader casts whatever it gets, so float32 bytes declared int32
would land as integers converted to floats. ``check_manifest_dtypes`` compares
kinds against ``checkpoint_dtype_kinds``, or, where the checkpoint is not at
hand, against the served module's parameters of the same name
(``module_dtype_kinds``). A checkpoint that is not a local folder of
safetensors files (nor in the Hugging Face cache) yields None, and the
checkpoint checks are skipped.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.verification import (
    Manifest,
    ManifestMismatch,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

Shapes = dict[str, tuple[int, ...]]
# Name -> dtype kind: "float", "int", "bool", "complex", or the exact name of
# a narrow float format ("float8_e4m3fn", ...).
Kinds = dict[str, str]
_LIST_LIMIT = 8


def _listed(wrong: list[str]) -> str:
    """The first ``_LIST_LIMIT`` of ``wrong`` joined by "; ", then how many more."""
    listed = "; ".join(wrong[:_LIST_LIMIT])
    if len(wrong) > _LIST_LIMIT:
        listed += f"; and {len(wrong) - _LIST_LIMIT} more"
    return listed


# safetensors' names of the float formats of 8 bits or fewer, as torch names
# them. Each is a kind of its own: a cast from or to one of them is never a
# change of precision only (float8 codes are meaningless without their
# scales, and bfloat16 values do not fit float8 without a quantizer).
_NARROW_SAFETENSORS = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}


# What every dtype refusal tells the trainer.
DTYPE_KIND_RULE = (
    "send each tensor in a dtype of the same kind as the served checkpoint "
    "(floating point of 16 bits or more, integer, bool; a float8 or float4 "
    "format only as itself: quantized codes need the checkpoint's own format "
    "and scales)"
)


def dtype_kind(dtype: torch.dtype | str) -> str | None:
    """The kind of a torch dtype, a torch dtype name, or a safetensors dtype
    (``"BF16"``, ``"I32"``, ``"BOOL"``); None if unknown.

    Floats of 16 bits or more share the kind ``"float"`` (a cast among them
    is allowed); a narrower float format is its own kind, named as torch
    names it."""
    if isinstance(dtype, str):
        found = getattr(torch, dtype, None) if not dtype.startswith("_") else None
        if isinstance(found, torch.dtype):
            dtype = found
        elif dtype in _NARROW_SAFETENSORS:
            return _NARROW_SAFETENSORS[dtype]
        elif dtype == "BOOL":
            return "bool"
        elif dtype[:1] in ("F", "B"):  # F16, F32, F64, BF16
            return "float" if dtype[1:] in ("16", "32", "64", "F16") else None
        elif dtype[:1] in ("I", "U"):
            return "int"
        elif dtype[:1] == "C":
            return "complex"
        else:
            return None
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float" if dtype.itemsize >= 2 else str(dtype).removeprefix("torch.")
    return "bool" if dtype == torch.bool else "int"


def checkpoint_shapes(model_config: Any) -> Shapes | None:
    """Tensor shapes by name of ``model_config``'s checkpoint, or None."""
    structure = _checkpoint_structure(model_config)
    return structure[0] if structure is not None else None


def checkpoint_dtype_kinds(model_config: Any) -> Kinds | None:
    """Tensor dtype kinds by name of ``model_config``'s checkpoint, or None."""
    structure = _checkpoint_structure(model_config)
    return structure[1] if structure is not None else None


def module_dtype_kinds(module: torch.nn.Module) -> Kinds:
    """Dtype kinds of ``module``'s parameters by name (the stand-in when no
    checkpoint is found). Parameters held in a narrow float format are left
    out: a layer quantized while loading holds float8 although its checkpoint,
    and so the trainer, sends wider floats, and the module cannot tell which."""
    return {
        name: kind
        for name, param in module.named_parameters(remove_duplicate=False)
        if (kind := dtype_kind(param.dtype)) is not None
        and not (param.dtype.is_floating_point and param.dtype.itemsize < 2)
    }


def _checkpoint_structure(model_config: Any) -> tuple[Shapes, Kinds] | None:
    model = getattr(model_config, "model", None)
    if not isinstance(model, str):
        return None
    return _structure_of(model, getattr(model_config, "revision", None))


@functools.cache
def _structure_of(model: str, revision: str | None) -> tuple[Shapes, Kinds] | None:
    folder = _local_folder(model, revision)
    if folder is None:
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes: Shapes = {}
    kinds: Kinds = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_slice(name)
                shapes[name] = tuple(tensor.get_shape())
                kind = dtype_kind(tensor.get_dtype())
                if kind is not None:
                    kinds[name] = kind
    return shapes, kinds


def _local_folder(model: str, revision: str | None) -> Path | None:
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model,
                revision=revision,
                allow_patterns=["*.safetensors"],
                local_files_only=True,
            )
        )
    except Exception as e:  # not cached, or not a hub id
        logger.debug("no local checkpoint for %s: %s", model, e)
        return None


def check_manifest_shapes(
    manifest: Manifest, shapes: Shapes, publication_id: str
) -> None:
    """``ManifestMismatch`` if a tensor the checkpoint also has differs in shape."""
    wrong = [
        f"{e.name} {list(e.shape)} (served model: {list(shapes[e.name])})"
        for e in manifest.entries
        if e.name in shapes and shapes[e.name] != e.shape
    ]
    if wrong:
        listed = _listed(wrong)
        raise ManifestMismatch(
            f"publication {publication_id}'s manifest disagrees with the served "
            f"model's checkpoint on {len(wrong)} tensor shape(s): "
            f"{listed}; the trainer and the server hold different "
            "models, so nothing was loaded"
        )


def wrong_dtype_kinds(
    declared: Iterable[tuple[str, torch.dtype | str]], kinds: Kinds
) -> list[str]:
    """``"<name> as <dtype> (served model: <kind>)"`` for every declared
    tensor the served model has with a dtype of another kind."""
    return [
        f"{name} as {str(dtype).removeprefix('torch.')} (served model: {kinds[name]})"
        for name, dtype in declared
        if name in kinds and dtype_kind(dtype) != kinds[name]
    ]


def check_manifest_dtypes(
    manifest: Manifest, kinds: Kinds, publication_id: str
) -> None:
    """``ManifestMismatch`` if a tensor the served model also has is declared
    with a dtype of another kind (float32 bytes declared int32)."""
    wrong = wrong_dtype_kinds(((e.name, e.dtype) for e in manifest.entries), kinds)
    if wrong:
        listed = _listed(wrong)
        raise ManifestMismatch(
            f"publication {publication_id}'s manifest declares {len(wrong)} "
            f"tensor(s) with a dtype the served model cannot take: {listed}; "
            f"{DTYPE_KIND_RULE}; nothing was loaded"
        )
