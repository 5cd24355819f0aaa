# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight sources that yield checkpoint names for models whose in-memory
parameters differ from their checkpoint.

``CheckpointNamesSource(model)``: Hugging Face transformers (v5) keeps the
experts of a MoE block fused in memory, as two 3-D parameters of an experts
module::

    <prefix>.gate_up_proj   [E, 2*I, H]   (gate rows, then up rows)
    <prefix>.down_proj      [E, H, I]

while the checkpoint, and vLLM's ``load_weights``, name each expert::

    <prefix>.<e>.gate_proj.weight   [I, H]
    <prefix>.<e>.up_proj.weight     [I, H]
    <prefix>.<e>.down_proj.weight   [H, I]

This source yields the checkpoint form: per expert ``gate_proj``, ``up_proj``,
``down_proj``, each a view of the fused parameter (no copy). Every other
parameter passes through under its own name. ``metadata()`` is computed from
shapes only, so it never gathers. Under FSDP each fused parameter is gathered
once (``full_tensor()``) and its experts are yielded from that one tensor.

An experts module with ``is_transposed = True`` stores ``gate_up_proj`` as
``[E, H, 2*I]`` and ``down_proj`` as ``[E, I, H]``; its views are transposed
back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    materialize_full_tensor,
)

_FUSED = ("gate_up_proj", "down_proj")


def _fused_experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Experts modules holding fused 3-D ``gate_up_proj`` / ``down_proj``."""
    found = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if all(k in params and params[k].dim() == 3 for k in _FUSED):
            found[name] = module
    return found


def _fused_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    params = dict(module.named_parameters(recurse=False))
    return params["gate_up_proj"], params["down_proj"]


def _expert_views(
    prefix: str, module: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    transposed = bool(getattr(module, "is_transposed", False))
    if transposed:
        gate_up = gate_up.transpose(1, 2)
        down = down.transpose(1, 2)
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or down.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"{prefix}: gate_up_proj {list(gate_up.shape)} and down_proj "
            f"{list(down.shape)} (transposed={transposed}) are not the "
            "[E, 2*I, H] / [E, H, I] expert layout"
        )
    inter = two_i // 2
    out = []
    for e in range(num_experts):
        out.append((f"{prefix}.{e}.gate_proj.weight", gate_up[e, :inter]))
        out.append((f"{prefix}.{e}.up_proj.weight", gate_up[e, inter:]))
        out.append((f"{prefix}.{e}.down_proj.weight", down[e]))
    return out


class CheckpointNamesSource(WeightSource):
    """A module's weights under checkpoint names; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._experts = _fused_experts_modules(model)

    def _entries(self) -> Iterator[tuple[str, str | None]]:
        """(parameter name, experts prefix or None), in parameter order."""
        for name, _ in self._model.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if prefix in self._experts and leaf in _FUSED:
                if leaf == "gate_up_proj":
                    yield name, prefix
                continue  # down_proj is yielded with its gate_up_proj
            yield name, None

    def metadata(self) -> list[ParamMeta]:
        metas = []
        params = dict(self._model.named_parameters())
        for name, prefix in self._entries():
            if prefix is None:
                p = params[name]
                metas.append(ParamMeta(name, p.dtype, tuple(p.shape)))
                continue
            module = self._experts[prefix]
            fused_gate_up, fused_down = _fused_params(module)
            gate_up = torch.empty(fused_gate_up.shape, device="meta")
            down = torch.empty(fused_down.shape, device="meta")
            dtypes = {"d": fused_down.dtype, "g": fused_gate_up.dtype}
            for ck_name, view in _expert_views(prefix, module, gate_up, down):
                dtype = dtypes["d" if ck_name.endswith("down_proj.weight") else "g"]
                metas.append(ParamMeta(ck_name, dtype, tuple(view.shape)))
        return metas

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self._model.named_parameters())
        for name, prefix in self._entries():
            if prefix is None:
                yield name, materialize_full_tensor(params[name]).detach()
                continue
            module = self._experts[prefix]
            fused_gate_up, fused_down = _fused_params(module)
            gate_up = materialize_full_tensor(fused_gate_up).detach()
            down = materialize_full_tensor(fused_down).detach()
            yield from _expert_views(prefix, module, gate_up, down)
            del gate_up, down
