# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checks on both ends of an update: the worker's manifest checker and the
trainer's receipt verification."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

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

from .samples import METAS, header, manifest


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


# -- whole messages checked once per layout (``whole_tensors``) ----------------


def views(metas=METAS):
    """What a message lists: name, dtype, shape and bytes of each tensor."""
    return [
        SimpleNamespace(
            name=m.name,
            dtype=m.dtype,
            shape=m.shape,
            nbytes=m.dtype.itemsize * math.prod(m.shape),
        )
        for m in metas
    ]


def test_whole_tensors_checked_once_serve_later_publications_of_that_manifest():
    m = manifest()
    whole = ManifestChecker(header(), m).whole_tensors(views())
    for _ in range(2):  # a later publication with the same manifest object
        checker = ManifestChecker(header(), m)
        checker.admit_whole(whole)
        checker.landed_whole(whole)
        r = checker.receipt(worker_rank=0, worker_device="cpu:host:0")
        assert (r.tensors_landed, r.complete) == (3, True)
        assert r.bytes_landed == m.total_bytes
        assert r.coverage == coverage_digest((e.name, e.nbytes) for e in m.entries)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": torch.float16}, "arrives as float16 but .* float32"),
        ({"shape": (4, 5)}, "shape \\[4, 5\\] but .* \\[4, 4\\]"),
        ({"nbytes": 60}, "arrives as 60 bytes but the manifest says 64"),
        ({"name": "layers.9.w"}, "'layers.9.w' is not in publication"),
        (
            {"name": "layers.1.w", "shape": (4,), "nbytes": 16},
            "'layers.1.w' arrives a second time",
        ),
    ],
)
def test_whole_tensors_refuses_what_admit_refuses(change, message):
    listed = views()
    vars(listed[1]).update(change)
    checker = ManifestChecker(header(), manifest())
    with pytest.raises(ManifestMismatch, match=message):
        checker.whole_tensors(listed)
    assert checker.bytes_landed == 0 and not checker.tensors_landed


def test_admit_whole_refuses_a_second_arrival_and_another_manifest():
    m = manifest()
    first, rest = views()[:1], views()[1:]
    checker = ManifestChecker(header(), m)
    checker.admit_whole(checker.whole_tensors(rest))
    with pytest.raises(ManifestMismatch, match="'layers.0.w' arrives a second time"):
        checker.admit_whole(checker.whole_tensors(views()))
    other = ManifestChecker(header(), Manifest.from_params(METAS))
    with pytest.raises(ValueError, match="another manifest"):
        other.admit_whole(checker.whole_tensors(first))


def test_landed_whole_takes_the_checked_path_when_not_admitted_in_full():
    checker = ManifestChecker(header(), manifest())
    whole = checker.whole_tensors(views())
    with pytest.raises(ManifestMismatch, match="call admit first"):
        checker.landed_whole(whole)
    assert checker.bytes_landed == 0


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
