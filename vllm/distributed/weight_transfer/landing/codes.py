# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side FP8 codes landed straight into an online-quantized engine.

An engine started with ``quantization="fp8_per_channel"`` serves each linear
layer as a float8 ``weight`` (the codes of its ``[rows, cols]`` checkpoint
weight, held transposed) and a float32 ``weight_scale`` (one per row). A
trainer that quantizes the same way (``fp8_codes.Fp8ChannelCodes``) sends
``<layer>.weight`` as float8 codes and ``<layer>.weight_scale`` as
``[rows, 1]`` float32. Both are the engine's own bytes, only cut into the
worker's shard and placed in fused layers, so they land in the served
tensors with no quantizing and no layerwise reload.

``CodesLanding.plan`` decides once per trainer layout, before anything lands:

1. which entries are codes (only in an engine with layers quantized per
   channel online): a ``float8_e4m3fn`` ``*.weight`` with a float32
   ``*.weight_scale`` of one value per row (a scale without its codes, or of
   another shape, is refused; float8 without a scale is left to the dtype
   check, which refuses it);
2. where the codes go: the sharded_rdt planner dry-runs the model's own
   loaders over the codes' names and shapes declared in the engine's dtype,
   which records the slice of each checkpoint tensor every loader copies into
   which region of which layer's checkpoint-format ``weight``. The codes take
   the same slices into the same regions of the served codes (a row of codes
   is a row of the weight), and a replay of each slice over row numbers gives
   the rows of the scale that go with them;
3. that each layer written takes codes as they are: its quantization method
   is vLLM's online per-channel FP8 method and has quantized it, its served
   tensors have the shapes the plan implies, and its FP8 kernel's own
   post-load processing keeps the bytes, tried on a copy holding marker codes
   (a kernel that repacks them, such as vLLM CPU's AMX-FP8 one, does not);
4. that every layer the codes write is written by codes alone: a fused layer
   sent partly as codes and partly in full precision is refused (the
   planner sees the codes cover only part of it).

The values are the worker's check before each message lands
(``quantized_values``: finite, positive scales and finite codes), not the
plan's: a plan holds no tensor.

``land`` copies a codes tensor's slices and a scale's rows into views of the
served tensors, bound at planning (a staged update stages the same pieces,
``slices``, and copies them at the commit, ``land_slices``);
``check_whole`` refuses a finish that wrote some of a layer's codes or
scales but not all; ``still_bound`` tells the worker to plan again when a
served tensor was replaced.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.landing.bound_places import RecordsPlaces
from vllm.distributed.weight_transfer.landing.completeness import (
    IncompleteUpdateError,
    first_few,
    partly_written,
)
from vllm.distributed.weight_transfer.plan.ops import (
    OpChain,
    SliceSpec,
    ViewOp,
    bit_pattern,
    dtype_name,
    replay,
)
from vllm.distributed.weight_transfer.plan.worker_plan import Region, SliceCopy
from vllm.distributed.weight_transfer.quant.fp8 import (
    FP8_CODES,
    SCALE_DTYPE,
    codes_name_of,
    scale_name,
)
from vllm.distributed.weight_transfer.verification import ManifestMismatch
from vllm.logger import init_logger

logger = init_logger(__name__)

# A layout entry: (name, dtype name, shape).
Entry = tuple[str, str, tuple[int, ...]]

_CODES_DTYPE = "float8_e4m3fn"
_SCALE_DTYPE = "float32"


class CodesRefused(ManifestMismatch):
    """Trainer-side codes this engine cannot take as they are; raised before
    anything lands."""


@dataclass(frozen=True)
class CodesCopy:
    """One loader copy of a codes tensor, as plain data: the view ops the
    model's loader takes of checkpoint tensor ``codes`` for this worker, the
    rows ``[row, row + rows)`` of the layer's served codes (in checkpoint
    orientation) they fill from column ``col``, and the rows of the trainer's
    scale that belong to them."""

    codes: str
    chain: OpChain
    module: str
    row: int
    rows: int
    col: int
    cols: int
    scale_rows: tuple[int, int]

    @property
    def scale(self) -> str:
        return scale_name(self.codes)


@dataclass(frozen=True)
class _Bound:
    """A copy bound to the live view it writes."""

    chain: OpChain | None  # None: a scale (rows ``pick`` of the trainer's)
    pick: tuple[int, int]
    view: torch.Tensor


@dataclass
class CodesLanding(RecordsPlaces):
    """Where a trainer layout's FP8 codes and scales land; see the module
    docstring. Build it with ``plan``."""

    copies: tuple[CodesCopy, ...]
    bound: dict[str, list[_Bound]]
    # Each layer written: the codes and scale names that write it.
    writers: dict[str, frozenset[str]]
    # (module, parameter name, tensor) of every served tensor written.
    targets: list[tuple[torch.nn.Module, str, torch.Tensor]]

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(self.bound)

    @property
    def nbytes(self) -> int:
        return sum(
            b.view.numel() * b.view.element_size()
            for bound in self.bound.values()
            for b in bound
        )

    @staticmethod
    def codes_entries(layout: Sequence[Entry]) -> dict[str, Entry]:
        """The layout's codes, by name: float8 ``*.weight`` entries that come
        with a float32 ``*.weight_scale`` of one value per row. ``CodesRefused``
        for a scale whose codes are missing or that does not fit them."""
        by_name = {e[0]: e for e in layout}
        found: dict[str, Entry] = {}
        wrong: list[str] = []
        for name, dtype, shape in layout:
            codes = codes_name_of(name)
            if codes is None:
                continue
            twin = by_name.get(codes)
            if twin is None or twin[1] != _CODES_DTYPE:
                wrong.append(
                    f"{name} comes without float8_e4m3fn codes {codes}"
                    + ("" if twin is None else f" (they are {twin[1]})")
                )
                continue
            rows = twin[2][0] if twin[2] else None
            if dtype != _SCALE_DTYPE or tuple(shape) not in ((rows, 1), (rows,)):
                wrong.append(
                    f"{name} is {dtype} {list(shape)}, but per-channel scales of "
                    f"{codes} {list(twin[2])} are float32 [{rows}, 1]"
                )
                continue
            found[codes] = twin
        if wrong:
            raise CodesRefused(
                f"{len(wrong)} FP8 scale tensor(s) cannot be used: "
                f"{first_few(wrong, 4, '; ')}; nothing was loaded"
            )
        return found

    @classmethod
    def plan(
        cls,
        model: torch.nn.Module,
        layout: Sequence[Entry],
        *,
        worker: str,
        vllm_config: Any,
    ) -> CodesLanding | None:
        """The landing of ``layout``'s codes (None when it has none), or
        ``CodesRefused`` naming each layer that cannot take them."""
        from vllm.distributed.weight_transfer.plan.bake import (
            bake_worker_plan,
        )

        if not any(codes_name_of(entry[0]) for entry in layout):
            return None
        if not any(_quantized_per_channel(m) for m in model.modules()):
            # No layer serves per-channel FP8 codes: tensors named like
            # codes are a pre-quantized checkpoint's own, for its loaders.
            return None
        codes = cls.codes_entries(layout)
        if not codes:
            return None
        # The loaders are planned as for the full-precision weights the
        # engine loads: the same names and shapes, in its dtype.
        served = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
        served = served if isinstance(served, torch.dtype) else torch.bfloat16
        plan = bake_worker_plan(
            model,
            [ParamMeta(name, served, shape) for name, _, shape in codes.values()],
            worker=worker,
            vllm_config=vllm_config,
            allow_partial=True,
        )
        problems = [
            f"{p.module}: the codes cover {p.covered} of its {p.expected} elements "
            "(send every shard of a layer as codes, or none)"
            for p in plan.partial_modules
        ]
        copies: list[CodesCopy] = []
        checked: dict[str, str | None] = {}
        probed: dict[Any, bool] = {}
        for copy_ in plan.copies:
            region = copy_.region
            if region.module not in checked:
                checked[region.module] = _why_not_codes(
                    model.get_submodule(region.module), vllm_config, probed
                )
            why = checked[region.module]
            if why is None and region.param != "weight":
                why = f"the loader of {copy_.slice.source} writes {region.param}"
            if why is None:
                placed = _placed(model.get_submodule(region.module), copy_, codes)
                if isinstance(placed, str):
                    why = placed
                else:
                    copies.append(placed)
                    continue
            problems.append(f"{region.module}: {why}")
        if problems:
            problems = sorted(set(problems))
            listed = first_few(problems, 4, "; ")
            raise CodesRefused(
                f"the trainer sends FP8 codes that {len(problems)} layer(s) of this "
                f"engine cannot take as they are: {listed}. "
                "Send those layers in full precision (the engine quantizes them "
                "itself); nothing was loaded"
            )
        return cls._bind(model, copies)

    @classmethod
    def _bind(cls, model: torch.nn.Module, copies: list[CodesCopy]) -> CodesLanding:
        bound: dict[str, list[_Bound]] = {}
        writers: dict[str, set[str]] = {}
        targets: dict[int, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        for c in copies:
            layer = model.get_submodule(c.module)
            weight, scale = _served(layer)
            codes = weight.t()  # checkpoint orientation: [rows, cols]
            scales = scale.view(-1)
            bound.setdefault(c.codes, []).append(
                _Bound(
                    c.chain,
                    (0, 0),
                    codes[c.row : c.row + c.rows, c.col : c.col + c.cols],
                )
            )
            bound.setdefault(c.scale, []).append(
                _Bound(None, c.scale_rows, scales[c.row : c.row + c.rows])
            )
            writers.setdefault(c.module, set()).update((c.codes, c.scale))
            for param in ("weight", "weight_scale"):
                tensor = getattr(layer, param)
                targets[id(tensor)] = (layer, param, tensor)
        landing = cls(
            copies=tuple(copies),
            bound=bound,
            writers={m: frozenset(n) for m, n in writers.items()},
            targets=list(targets.values()),
        )
        landing.record_places(landing.targets)
        logger.info(
            "FP8 codes land straight in %d served layer(s) (%d bytes per sync)",
            len(writers),
            landing.nbytes,
        )
        return landing

    def slice_copies(
        self, model: torch.nn.Module
    ) -> list[tuple[SliceCopy, torch.Tensor]]:
        """Every planned piece as a ``sharded_rdt`` copy, with the served view
        it is copied into: for each codes copy, the slice a producer cuts from
        the trainer's codes (the loader's view ops) and the rows it cuts from
        the trainer's scale (flattened, then narrowed), each with the region
        of the served tensor it fills. A ``sharded_rdt`` worker pulls exactly
        these bytes and copies them into the views (``ChunkLander``'s direct
        copies)."""
        out: list[tuple[SliceCopy, torch.Tensor]] = []
        for c in self.copies:
            weight, scale = _served(model.get_submodule(c.module))
            start, stop = c.scale_rows
            pieces = (
                (
                    c.codes,
                    c.chain,
                    "weight",
                    weight,
                    weight.t()[c.row : c.row + c.rows, c.col : c.col + c.cols],
                ),
                (
                    c.scale,
                    (
                        ViewOp("reshape", (-1,)),
                        ViewOp("narrow", (0, start, stop - start)),
                    ),
                    "weight_scale",
                    scale,
                    scale.view(-1)[c.row : c.row + c.rows],
                ),
            )
            for source, chain, param, served, view in pieces:
                dtype = dtype_name(view.dtype)
                spec = SliceSpec(source, chain, tuple(view.shape), dtype)
                region = Region(
                    c.module,
                    param,
                    int(view.storage_offset() - served.storage_offset()),
                    tuple(view.shape),
                    tuple(view.stride()),
                    dtype,
                )
                out.append((SliceCopy(spec, region), view))
        return out

    def still_bound(self) -> bool:
        """Whether every served tensor written is still the one its layer
        holds, in the memory the views were cut from."""
        return all(
            getattr(m, p, None) is t for m, p, t in self.targets
        ) and self.places_unchanged(self.targets)

    @torch.no_grad()
    def land(self, name: str, tensor: torch.Tensor) -> None:
        """Copy the planned slices of codes or scale ``name`` into the served
        tensors."""
        for b in self.bound[name]:
            b.view.copy_(self._piece(b, name, tensor))

    def slices(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of codes or scale ``name`` this worker keeps, in the
        order ``land_slices`` takes them (a staged update stages these)."""
        return [self._piece(b, name, tensor) for b in self.bound[name]]

    @torch.no_grad()
    def land_slices(self, name: str, pieces: Sequence[torch.Tensor]) -> None:
        """Copy pieces taken by ``slices`` (or copies of them) into the
        served tensors."""
        for b, piece in zip(self.bound[name], pieces, strict=True):
            b.view.copy_(piece)

    @torch.no_grad()
    def landed_differs(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A 0-dim bool tensor, true when a served region ``name`` wrote
        differs, bit for bit, from what ``land`` copies there."""
        flags = [
            torch.ne(
                bit_pattern(b.view), bit_pattern(self._piece(b, name, tensor))
            ).any()
            for b in self.bound[name]
        ]
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()

    @staticmethod
    def _piece(b: _Bound, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if b.chain is None:
            piece = tensor.reshape(-1)[b.pick[0] : b.pick[1]]
        else:
            piece = replay(tensor, b.chain)
        if piece.shape != b.view.shape or piece.dtype != b.view.dtype:
            raise ValueError(
                f"{name} as sent gives a {piece.dtype} {list(piece.shape)} slice "
                f"where the served layer holds {b.view.dtype} {list(b.view.shape)}"
            )
        return piece

    def check_whole(self, received: Iterable[str]) -> None:
        """``IncompleteUpdateError`` when ``received`` writes some of a layer's
        codes or scales but not all: the layer would serve old and new
        bytes together."""
        lacking = partly_written(self.writers, set(received))
        if lacking:
            raise IncompleteUpdateError(
                f"the update writes {len(lacking)} FP8 layer(s) without all of "
                f"their codes and scales: {first_few(lacking, 4, '; ')}. An "
                "update must carry every codes and scale tensor of each layer "
                "it touches"
            )


def _quantized_per_channel(layer: torch.nn.Module) -> bool:
    """Whether vLLM's online per-channel FP8 method quantizes ``layer``."""
    method = getattr(layer, "quant_method", None)
    key = getattr(method, "weight_quant_key", None)
    if key is None or not hasattr(method, "fp8_linear"):
        return False
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8StaticChannelSym,
    )

    return key == kFp8StaticChannelSym


def _why_not_codes(
    layer: torch.nn.Module, vllm_config: Any, probed: dict[Any, bool]
) -> str | None:
    """None when ``layer`` serves per-channel FP8 codes that a sync can
    overwrite in place; else the reason it cannot take codes. ``probed``
    keeps the kernel probe's answer per kernel class and weight shape."""
    method = getattr(layer, "quant_method", None)
    if not _quantized_per_channel(layer):
        return (
            f"it is not quantized per channel to FP8 online ({type(method).__name__})"
        )
    if not getattr(layer, "_already_called_process_weights_after_loading", False):
        return "it has not been quantized yet"
    weight = getattr(layer, "weight", None)
    scale = getattr(layer, "weight_scale", None)
    if not (
        isinstance(weight, torch.Tensor)
        and isinstance(scale, torch.Tensor)
        and weight.dtype == FP8_CODES
        and weight.dim() == 2
        and weight.t().is_contiguous()
        and scale.dtype == SCALE_DTYPE
        and scale.is_contiguous()
        and scale.numel() == weight.shape[1]
    ):
        return "its served weight is not float8 codes with one float32 scale per row"
    kernel: Any = getattr(method, "fp8_linear", None)
    key = (type(kernel), tuple(weight.shape))
    if key not in probed:
        probed[key] = _kernel_keeps_codes(layer, kernel, vllm_config)
    if not probed[key]:
        return (
            f"its FP8 kernel ({type(kernel).__name__}) repacks the codes after loading"
        )
    return None


def _kernel_keeps_codes(layer: torch.nn.Module, kernel: Any, vllm_config: Any) -> bool:
    """Whether ``kernel``'s post-load processing leaves a layer's codes and
    scales as loaded, tried on a copy of ``layer`` holding marker values:
    the same tensors (or tensors of the same layout) with the same bytes
    afterwards, and nothing else of the copy changed."""
    import contextlib

    from vllm.config import set_current_vllm_config

    weight, scale = _served(layer)
    n, k = weight.shape[1], weight.shape[0]
    # Bytes 0..250 repeating every 4093 elements (a prime, so rows differ),
    # built at the speed of a copy.
    period = torch.arange(4093, dtype=torch.int32).remainder_(251).to(torch.uint8)
    marks = period.repeat(-(-(n * k) // 4093))[: n * k]
    codes = marks.view(n, k).view(FP8_CODES)
    scales = (torch.arange(n, dtype=SCALE_DTYPE) + 1.0).view(scale.shape)
    probe = copy.copy(layer)
    probe.__dict__ = dict(layer.__dict__)
    probe._parameters = dict(layer._parameters)
    probe._buffers = dict(layer._buffers)
    probe._parameters["weight"] = torch.nn.Parameter(codes.clone().t(), False)
    probe._parameters["weight_scale"] = torch.nn.Parameter(scales.clone(), False)
    state = {k_: v for k_, v in probe.__dict__.items() if k_ != "_parameters"}
    context: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext()
        if vllm_config is None
        else set_current_vllm_config(vllm_config)
    )
    with context, torch.no_grad():
        kernel.process_weights_after_loading(probe)
    w, s = probe._parameters.get("weight"), probe._parameters.get("weight_scale")
    kept = (
        isinstance(w, torch.Tensor)
        and isinstance(s, torch.Tensor)
        and w.dtype == FP8_CODES
        and tuple(w.shape) == (k, n)
        and w.t().is_contiguous()
        and torch.equal(bit_pattern(w.t()), bit_pattern(codes))
        and s.dtype == SCALE_DTYPE
        and tuple(s.shape) == tuple(scale.shape)
        and torch.equal(bit_pattern(s), bit_pattern(scales))
    )
    now = {k_: v for k_, v in probe.__dict__.items() if k_ != "_parameters"}
    return (
        kept
        and probe._parameters.keys() == layer._parameters.keys()
        and now.keys() == state.keys()
        and all(now[key] is state[key] for key in state)
    )


def _placed(
    layer: torch.nn.Module, copy_: Any, codes: dict[str, Entry]
) -> CodesCopy | str:
    """``copy_`` (a planned copy into ``layer``'s checkpoint-format weight) as
    a ``CodesCopy``, or why the codes cannot follow it: the region must be a
    block of whole or partial rows of the ``[rows, cols]`` weight, and the
    slice must keep each row of the source a row."""
    weight, _ = _served(layer)
    rows_total, cols_total = weight.shape[1], weight.shape[0]
    region, spec = copy_.region, copy_.slice
    if (
        len(region.shape) != 2
        or region.stride[1] != 1
        or (region.shape[0] > 1 and region.stride[0] != cols_total)
    ):
        return f"the loader writes {spec.source} into a region that is not a row block"
    row, col = divmod(region.offset, cols_total)
    rows, cols = region.shape
    if row + rows > rows_total or col + cols > cols_total:
        return f"the loader writes {spec.source} outside the served codes"
    name, _, shape = codes[spec.source]
    # Replay the slice over row numbers: each row of the result must be one
    # source row, and the rows must be consecutive.
    numbers = torch.arange(shape[0], dtype=torch.int32).unsqueeze(1)
    numbers = numbers.expand(shape[0], shape[1]).contiguous()
    try:
        picked = replay(numbers, spec.chain)
    except Exception as e:  # a view op that rows of numbers cannot take
        return f"the loader's slice of {name} cannot be replayed on its rows ({e})"
    if tuple(picked.shape) != (rows, cols):
        return f"the loader's slice of {name} does not fill the region it writes"
    first = picked[:, :1]
    start = int(first[0, 0]) if rows else 0
    consecutive = torch.equal(
        first.view(-1), torch.arange(start, start + rows, dtype=torch.int32)
    )
    if not (consecutive and bool((picked == first).all())):
        return f"the loader's slice of {name} does not keep its rows whole"
    return CodesCopy(
        codes=name,
        chain=spec.chain,
        module=region.module,
        row=row,
        rows=rows,
        col=col,
        cols=cols,
        scale_rows=(start, start + rows),
    )


def _scale_rows_chain(start: int, stop: int) -> OpChain:
    """The view ops that cut rows ``[start, stop)`` of a ``[rows, 1]`` (or
    ``[rows]``) scale, flattened: what ``_piece`` takes of it."""
    return (ViewOp("reshape", (-1,)), ViewOp("narrow", (0, start, stop - start)))


def _served(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized layer's served codes (``[cols, rows]``) and scales."""
    return layer.get_parameter("weight"), layer.get_parameter("weight_scale")
