# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A small three-tensor model and its publication header, shared by the tests
of the verification wire types and of the checks built on them."""

from typing import Any

import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.verification.wire import (
    Manifest,
    PublicationHeader,
)

METAS = [
    ParamMeta("embed.weight", torch.bfloat16, (8, 4)),
    ParamMeta("layers.0.w", torch.float32, (4, 4)),
    ParamMeta("layers.1.w", torch.float32, (4,)),
]


def manifest() -> Manifest:
    return Manifest.from_params(METAS)


def header(**kw: Any) -> PublicationHeader:
    """A header over `manifest()`; ``kw`` overrides any field."""
    args: dict[str, Any] = dict(
        backend="ipc",
        model_version=3,
        manifest=manifest(),
        trainer_devices=["cpu:host:0"],
    )
    args.update(kw)
    return PublicationHeader.create(**args)
