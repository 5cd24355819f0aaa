# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pre-quantized int8 checkpoints for tests: a tiny model's folder with its
weights replaced by what a trainer source yields (``int8_codes``) and a
compressed-tensors W8A8 int8 quantization config, so that vLLM starts an
engine that serves int8 codes it never quantized itself."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.quant.fp8 import is_linear_weight

# Weights symmetric int8 per output channel, activations int8 per token at
# run time; the LM head stays in the model's dtype.
W8A8_INT8_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def save_int8_checkpoint(
    model_dir: str | os.PathLike[str],
    weights: Iterable[tuple[str, torch.Tensor]],
    directory: str | os.PathLike[str],
    dtype: str = "bfloat16",
    strategy: str = "channel",
    activations: str = "dynamic",
    ignore: Sequence[str] = (),
) -> Path:
    """Write ``model_dir``'s config and tokenizer with ``weights`` (checkpoint
    names: int8 codes and ``*.weight_scale`` for the linear layers, the rest in
    ``dtype``) and ``W8A8_INT8_CONFIG`` into ``directory``; ``strategy`` is the
    weights' (``"channel"``: ``Int8ChannelCodes``; ``"tensor"``:
    ``Int8TensorCodes``). ``activations="static"`` declares activations
    quantized per tensor with fixed parameters, which ``weights`` must then
    hold (``<layer>.input_scale``, float32 ``[1]``, for every quantized
    layer: ``static_input_scales`` computes some). ``ignore`` adds
    compressed-tensors ignore patterns (``"re:.*mlp\\.experts.*"``) for layers
    served in ``dtype`` next to the LM head."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    torch_dtype = getattr(torch, dtype)
    tensors = {
        name: (
            t
            if not t.is_floating_point() or name.endswith("_scale")
            else t.to(torch_dtype)
        )
        .detach()
        .contiguous()
        .cpu()
        for name, t in weights
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    quantization = copy.deepcopy(W8A8_INT8_CONFIG)
    quantization["ignore"] = [*quantization["ignore"], *ignore]
    group = quantization["config_groups"]["group_0"]
    group["weights"]["strategy"] = strategy
    if activations == "static":
        group["input_activations"].update(strategy="tensor", dynamic=False)
    elif activations != "dynamic":
        raise ValueError(f"activations must be 'dynamic' or 'static': {activations!r}")
    config["quantization_config"] = quantization
    config["torch_dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2))
    return out


@torch.no_grad()
def static_input_scales(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    quantized: Callable[[str, tuple[int, ...]], bool] = is_linear_weight,
) -> dict[str, torch.Tensor]:
    """Calibrated symmetric int8 activation scales for ``model``'s quantized
    linear layers (``<layer>.input_scale``: the largest input magnitude seen
    over a forward of ``input_ids``, over 127, as float32 ``[1]``): what a
    calibration tool would store in a static-activation checkpoint."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or weight is None:
            continue
        if not quantized(f"{name}.weight", tuple(weight.shape)):
            continue

        def record(_m: Any, args: tuple[Any, ...], key: str = name) -> None:
            seen = args[0].detach().abs().amax().float().reshape(1)
            amax[key] = torch.maximum(amax.get(key, seen), seen)

        hooks.append(module.register_forward_pre_hook(record))
    try:
        model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return {f"{name}.input_scale": a / 127.0 for name, a in amax.items()}
