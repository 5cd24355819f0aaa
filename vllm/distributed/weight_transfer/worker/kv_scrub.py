# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Non-finite values left in the attention KV cache are zeroed when an
update commits.

Weights that produce NaN or infinity (a NaN in a weight, a NaN scale) write
those values into every KV block their requests use. Resetting the prefix
cache frees the blocks but leaves their bytes, and a block is handed to the
next request as it is: the request writes only the slots of its own tokens,
and vLLM CPU's attention kernel reads a whole block, weighting the slots past
the request's length by zero; zero times NaN is NaN. The first requests after
the weights are repaired then still answer NaN, until every poisoned block has
been overwritten (vLLM zeroes new blocks itself only for Mamba layers and
mixed-precision caches, ``KVCacheConfig.needs_kv_cache_zeroing``).

``zero_non_finite_kv`` replaces every NaN and infinity in the floating KV
caches of the worker's attention layers with zero, in place. A finite value
is never touched, so the KV of running requests and of cached prefixes stays
as it was: only values that were already meaningless change. The worker runs
it after each committed update, between two engine steps. A KV cache held as
bytes (``uint8``, as float8 KV caches are) is left alone: its dtype does not
say which values are non-finite.

Cost: the scan finds the chunks to repair from their bits. An IEEE float is
non-finite exactly when its exponent bits are all set, that is when its bit
pattern with the sign cleared is at least the infinity's; numpy's one-thread
AND into a scratch and ``max`` test a chunk that way at about 7 GB/s on a
2-core x86 VM, where torch's float32 ``sum`` of bfloat16 (the scan before)
read 0.8-1.3 GB/s: a 1 GiB KV cache took it 1.3 s at every commit. A clean
cache costs one read; dtypes without a bit rule here (none of vLLM's floating
KV dtypes) fall back to that sum, non-finite when any addend is. It runs only
on caches in host memory:
the attention kernels of vLLM's GPU backends bound their reads by each
sequence's length, so a stale slot never enters a GPU result, and a scan
there would only add a read of the whole cache to every commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger

logger = init_logger(__name__)

# Elements read per step: bounds the scratch to 16 Mi elements.
_CHUNK = 16 << 20

# dtype -> (the integer view of its bits, the mask that clears the sign, the
# bit pattern of +infinity): a value is NaN or infinite exactly when its
# masked bits are at least the last.
_NON_FINITE_BITS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def kv_caches(vllm_config: Any) -> Iterator[torch.Tensor]:
    """Each distinct KV cache tensor of the attention layers in
    ``vllm_config``'s forward context (layers that share one are given once)."""
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", {}
    )
    seen: set[int] = set()
    for layer in (context or {}).values():
        cache = getattr(layer, "kv_cache", None)
        tensors = cache if isinstance(cache, list | tuple) else [cache]
        for kv in tensors:
            if (
                isinstance(kv, torch.Tensor)
                and kv.numel()
                and kv.data_ptr() not in seen
            ):
                seen.add(kv.data_ptr())
                yield kv


@torch.no_grad()
def zero_non_finite(kv: torch.Tensor) -> int:
    """Set every NaN and infinity of floating tensor ``kv`` to zero, in
    place; the number of chunks of ``_CHUNK`` elements that held any (0 when
    none did, or when ``kv`` is not floating or not contiguous)."""
    if not kv.dtype.is_floating_point or not kv.is_contiguous() or not kv.numel():
        return 0
    chunks = kv.view(-1).split(_CHUNK)
    bits = _NON_FINITE_BITS.get(kv.dtype)
    if bits is not None and kv.device.type == "cpu":
        flags = _non_finite_by_bits(chunks, *bits)
    else:
        # A chunk whose finite values overflow the sum is scrubbed too,
        # which changes none of them.
        sums = torch.stack([c.sum(dtype=torch.float32) for c in chunks])
        flags = (~torch.isfinite(sums)).tolist()
    bad = [c for c, flag in zip(chunks, flags, strict=True) if flag]
    for chunk in bad:
        chunk.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return len(bad)


def _non_finite_by_bits(
    chunks: tuple[torch.Tensor, ...], int_dtype: torch.dtype, mask: int, inf: int
) -> list[bool]:
    """Per chunk (host tensors): whether it holds a NaN or an infinity, from
    the bits of its values (see ``_NON_FINITE_BITS``)."""
    scratch = torch.empty(min(_CHUNK, chunks[0].numel()), dtype=int_dtype).numpy()
    flags = []
    for chunk in chunks:
        words = chunk.view(int_dtype).numpy()
        masked = scratch[: words.size]
        np.bitwise_and(words, mask, out=masked)
        flags.append(bool(masked.max() >= inf))
    return flags


def zero_non_finite_kv(vllm_config: Any) -> int:
    """``zero_non_finite`` over every KV cache of the worker (module
    docstring); the number of chunks it changed, logged when any."""
    changed = sum(
        zero_non_finite(kv) for kv in kv_caches(vllm_config) if kv.device.type == "cpu"
    )
    if changed:
        logger.warning(
            "the KV cache held NaN or infinite values (from weights that "
            "produced them); %d chunk(s) of it zeroed where they were",
            changed,
        )
    return changed
