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
checkpoint lacks (a tied ``lm_head``) or omit some (a partial update). Dtypes
are not compared, since a checkpoint stored in bf16 may be served in fp32. A
checkpoint that is not a local folder of safetensors files (nor in the Hugging
Face cache) yields None, and the check is skipped.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.publication import Manifest, ManifestMismatch
from vllm.logger import init_logger

logger = init_logger(__name__)

Shapes = dict[str, tuple[int, ...]]
_LIST_LIMIT = 8


def checkpoint_shapes(model_config: Any) -> Shapes | None:
    """Tensor shapes by name of ``model_config``'s checkpoint, or None."""
    model = getattr(model_config, "model", None)
    if not isinstance(model, str):
        return None
    return _shapes_of(model, getattr(model_config, "revision", None))


@functools.cache
def _shapes_of(model: str, revision: str | None) -> Shapes | None:
    folder = _local_folder(model, revision)
    if folder is None:
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    shapes: Shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


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
        listed = "; ".join(wrong[:_LIST_LIMIT])
        if len(wrong) > _LIST_LIMIT:
            listed += f"; and {len(wrong) - _LIST_LIMIT} more"
        raise ManifestMismatch(
            f"publication {publication_id}'s manifest disagrees with the served "
            f"model's checkpoint on {len(wrong)} tensor shape(s): "
            f"{listed}; the trainer and the server hold different "
            "models, so nothing was loaded"
        )
