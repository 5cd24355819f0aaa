# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checks on both ends of an update: the worker's manifest checker and the
trainer's receipt verification."""

import json

import pytest
import torch
from verification_samples import METAS, header, manifest

from vllm.distributed.weight_transfer.verification.checks import (
    ManifestChecker,
    verify_receipts,
)
from vllm.distributed.weight_transfer.verification.wire import (
    ChecksumMismatch,
    IncompleteUpdate,
    Manifest,
    ManifestMismatch,
    PublicationHeader,
    Receipt,
    ReceiptError,
    coverage_digest,
)


def land_all(checker: ManifestChecker) -> None:
    for m in METAS:
        entry = checker.admit(m.name, m.dtype, m.shape)
        checker.landed(m.name, entry.nbytes)


# -- worker-side checker -----------------------------------------------------


def test_full_update_lands_and_receipt_attests_everything():
    h = header()
    checker = ManifestChecker(h, manifest())
    land_all(checker)
    r = checker.receipt(worker_rank=1, worker_device="cpu:host:1", timings={"load": 1})
    assert (r.tensors_landed, r.bytes_landed, r.complete) == (3, h.manifest_bytes, True)
    assert r.coverage == manifest().full_coverage_digest()
    assert Receipt.from_dict(json.loads(json.dumps(r.to_dict()))) == r


@pytest.mark.parametrize(
    "name, dtype, shape, message",
    [
        ("layers.9.w", torch.float32, (4,), "'layers.9.w' is not in publication"),
        ("layers.0.w", torch.float16, (4, 4), "arrives as float16 but .* float32"),
        ("layers.0.w", torch.float32, (4, 5), "shape \\[4, 5\\] but .* \\[4, 4\\]"),
    ],
)
def test_checker_rejects_mismatch_before_landing(name, dtype, shape, message):
    checker = ManifestChecker(header(), manifest())
    with pytest.raises(ManifestMismatch, match=message):
        checker.admit(name, dtype, shape)
    assert checker.bytes_landed == 0


def test_checker_rejects_a_tensor_sent_twice():
    checker = ManifestChecker(header(), manifest())
    checker.admit("layers.1.w", torch.float32, (4,))
    with pytest.raises(ManifestMismatch, match="arrives a second time"):
        checker.admit("layers.1.w", torch.float32, (4,))


def test_checker_refuses_a_manifest_the_header_does_not_announce():
    with pytest.raises(ManifestMismatch, match="disagree"):
        ManifestChecker(header(), Manifest.from_params(METAS[:2]))


def test_landed_requires_admission():
    checker = ManifestChecker(header(), manifest())
    with pytest.raises(ManifestMismatch, match="call admit first"):
        checker.landed("layers.1.w", 16)


def test_incomplete_full_update_has_no_receipt():
    checker = ManifestChecker(header(), manifest())
    checker.admit("layers.1.w", torch.float32, (4,))
    checker.landed("layers.1.w", 16)
    with pytest.raises(IncompleteUpdate, match="2 of 3 tensors incomplete"):
        checker.receipt(0, "cpu:host:0")


def test_sliced_plan_tracks_bytes_per_name():
    h = header()
    plan = {"embed.weight": 32, "layers.0.w": 32}
    checker = ManifestChecker(h, manifest(), expected=plan)
    checker.admit_slice("embed.weight", torch.bfloat16, 32)
    checker.landed("embed.weight", 32)
    checker.admit_slice("layers.0.w", torch.float32, 16)
    with pytest.raises(ManifestMismatch, match="add up to 48 bytes"):
        checker.admit_slice("layers.0.w", torch.float32, 32)
    with pytest.raises(ManifestMismatch, match="whose plan does not include it"):
        checker.admit_slice("layers.1.w", torch.float32, 16)
    checker.landed("layers.0.w", 16)
    checker.admit_slice("layers.0.w", torch.float32, 16)
    checker.landed("layers.0.w", 16)
    r = checker.receipt(2, "cuda:GPU-x")
    assert r.complete and r.expected_bytes == 64 and r.tensors_landed == 2


def test_checksum_mismatch_names_the_chunk():
    checker = ManifestChecker(header(checksum="ws1"), manifest())
    checker.verify_checksum("chunk 0", "ws1:4:a", "ws1:4:a")
    with pytest.raises(ChecksumMismatch, match="chunk 3 .* changed in transit"):
        checker.verify_checksum("chunk 3", "ws1:4:a", "ws1:4:b")
    assert checker.checksums_verified == 1


# -- trainer-side verification -----------------------------------------------


def receipts_for(h: PublicationHeader, ranks) -> list[Receipt]:
    out = []
    for rank in ranks:
        checker = ManifestChecker(h, manifest())
        land_all(checker)
        out.append(checker.receipt(rank, f"cpu:host:{rank}"))
    return out


def test_verify_accepts_every_worker_attesting_everything():
    h = header()
    v = verify_receipts(h, receipts_for(h, [0, 1]), expected_workers=[0, 1])
    assert v.workers == (0, 1) and v.bytes_landed == 2 * h.manifest_bytes


def test_verify_lists_missing_and_unexpected_workers():
    h = header()
    with pytest.raises(ReceiptError, match="no receipt from worker\\(s\\) \\[2\\]"):
        verify_receipts(h, receipts_for(h, [0, 1]), expected_workers=[0, 1, 2])
    with pytest.raises(ReceiptError, match="unexpected worker\\(s\\) \\[5\\]"):
        verify_receipts(h, receipts_for(h, [0, 5]), expected_workers=[0])


def test_verify_rejects_a_receipt_of_another_publication():
    h = header()
    other = header()
    with pytest.raises(
        ReceiptError, match=f"attests publication {other.publication_id}"
    ):
        verify_receipts(h, receipts_for(other, [0]), expected_workers=[0])


def test_verify_rejects_short_full_delivery_and_reports_worker_errors():
    full = header()
    # A worker that was planned one tensor: complete by its own plan, short of
    # the full delivery the trainer expects.
    checker = ManifestChecker(full, manifest(), expected={"layers.1.w": 16})
    checker.admit("layers.1.w", torch.float32, (4,))
    checker.landed("layers.1.w", 16)
    short = checker.receipt(0, "cpu:host:0")
    failed = Receipt.failure(full, 1, "cpu:host:1", "boom")
    with pytest.raises(ReceiptError) as e:
        verify_receipts(full, [short, failed], expected_workers=[0, 1])
    assert "worker 0 (cpu:host:0) landed 1 tensors / 16 bytes" in str(e.value)
    assert "worker 1 (cpu:host:1) failed: boom" in str(e.value)


def test_verify_sliced_coverage_pins_what_was_sent():
    h = header()
    checker = ManifestChecker(h, manifest(), expected={"layers.1.w": 16})
    checker.admit_slice("layers.1.w", torch.float32, 16)
    checker.landed("layers.1.w", 16)
    r = checker.receipt(0, "cpu:host:0")
    sent = coverage_digest([("layers.1.w", 16)])
    verify_receipts(h, [r], [0], delivery="sliced", expected_coverage=sent)
    other = coverage_digest([("a", 1)])
    with pytest.raises(ReceiptError, match="coverage digest differs"):
        verify_receipts(h, [r], [0], delivery="sliced", expected_coverage=other)


def test_verify_requires_checksums_when_they_were_sent():
    h = header(checksum="ws1")
    with pytest.raises(ReceiptError, match="verified no checksums"):
        verify_receipts(h, receipts_for(h, [0]), expected_workers=[0])


def test_verify_sliced_delivery_requires_complete_plans():
    h = header()
    checker = ManifestChecker(h, manifest(), expected={"layers.1.w": 16})
    checker.admit_slice("layers.1.w", torch.float32, 16)
    checker.landed("layers.1.w", 16)
    good = checker.receipt(0, "cuda:GPU-a")
    verify_receipts(h, [good], [0], delivery="sliced")
    short = Receipt.from_dict({**good.to_dict(), "complete": False, "bytes_landed": 0})
    with pytest.raises(ReceiptError, match="incomplete: 0 of 16 planned bytes"):
        verify_receipts(h, [short], [0], delivery="sliced")
