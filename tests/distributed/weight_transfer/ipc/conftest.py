# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA data-plane tests' reader: one second process per test module that
reads every update as a worker engine does (``cuda_rig._reader``)."""

import multiprocessing as mp

import pytest

from .cuda_rig import _reader


@pytest.fixture(scope="module")
def reader():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send(None)
    assert parent.recv()[0] == "closed"
    proc.join(60)
