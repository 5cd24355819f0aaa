# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters for tests: a PEFT LoRA over a copy of a base model, with
both halves drawn at random from a seed (PEFT starts lora_B at zero, which
would make every adapter the identity)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch


def random_lora(
    base: torch.nn.Module,
    seed: int,
    rank: int,
    target_modules: Sequence[str],
    std: float = 0.05,
) -> Any:
    """A PEFT ``LoraConfig(r=rank, lora_alpha=2 * rank)`` model over a copy
    of ``base`` (eval mode), every LoRA tensor drawn from N(0, std)."""
    import peft

    model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(target_modules),
            lora_dropout=0.0,
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()
