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


@pytest.fixture(autouse=True)
def _short_failure_receipt_wait(monkeypatch):
    """A failed sync waits up to ``FAILURE_RECEIPT_WAIT_S`` (2 s) for the
    workers' failure receipts before it fences. The loopback worker of these
    tests sends none, so that wait always runs out and only its length
    changes: 0.05 s here keeps the same outcome without 2 s per failure."""
    from vllm.distributed.weight_transfer.verification import publication

    monkeypatch.setattr(publication, "FAILURE_RECEIPT_WAIT_S", 0.05)
