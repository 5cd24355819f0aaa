# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side quantizers: the trainer sends quantized codes and their scales
instead of full-precision weights, and both sides check the values.

- ``fp8``: float8 codes per channel or per block (``Fp8ChannelCodes``, ...);
- ``int8``: int8 codes for engines that serve a pre-quantized int8 checkpoint;
- ``row_kernel``: one fused Triton kernel for the per-row quantizers on CUDA;
- ``values``: what quantized weights must hold before they land (finite,
  positive scales; finite float8 codes), checked on both sides.
"""
