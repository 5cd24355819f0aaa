# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The wire data of a publication: manifest, header, receipt, and the fields
an update message carries."""

import json

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.verification.wire import (
    PUBLICATION_FIELD,
    Manifest,
    ManifestEntry,
    ManifestMismatch,
    PublicationHeader,
    Receipt,
    attach_publication,
    describe_error,
    pop_publication,
)

from .samples import METAS, header, manifest

# -- manifest -----------------------------------------------------------------


def test_manifest_counts_bytes_from_dtype_and_shape():
    m = manifest()
    assert m.count == 3
    assert m.total_bytes == 8 * 4 * 2 + 16 * 4 + 4 * 4
    assert m.by_name["embed.weight"].dtype == "bfloat16"


def test_manifest_digest_depends_on_order_dtype_and_shape():
    base = manifest().digest
    assert Manifest.from_params(list(reversed(METAS))).digest != base
    changed = [METAS[0], ParamMeta("layers.0.w", torch.float16, (4, 4)), METAS[2]]
    assert Manifest.from_params(changed).digest != base
    reshaped = [METAS[0], ParamMeta("layers.0.w", torch.float32, (2, 8)), METAS[2]]
    assert Manifest.from_params(reshaped).digest != base
    assert manifest().digest == base


def test_manifest_round_trips_through_json():
    m = manifest()
    again = Manifest.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m and again.digest == m.digest


def test_manifest_from_dict_rejects_tampered_entries():
    d = manifest().to_dict()
    d["entries"][1][2] = [4, 5]
    d["entries"][1][3] = 80
    with pytest.raises(ManifestMismatch, match="altered in transit"):
        Manifest.from_dict(d)


def test_a_manifest_parsed_again_is_the_same_object_and_a_changed_one_is_not():
    """A worker parses the same trainer manifest at every sync: the entries
    are compared with the one parsed before (never trusted by digest) and
    the checked object reused; a changed entry under the old digest is
    parsed afresh and refused. ``to_dict`` hands out a copy."""
    m = manifest()
    first = Manifest.from_dict(json.loads(json.dumps(m.to_dict())))
    again = Manifest.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again is first
    d = m.to_dict()
    d["entries"][1][2] = [4, 5]
    d["entries"][1][3] = 80
    with pytest.raises(ManifestMismatch, match="altered in transit"):
        Manifest.from_dict(d)
    # The copy handed out was changed; the manifest and its parse were not.
    assert Manifest.from_dict(m.to_dict()) is first
    assert m.to_dict() == first.to_dict() != d


def test_manifest_rejects_duplicate_names():
    with pytest.raises(ValueError, match="not unique.*'a'"):
        Manifest.from_params([ParamMeta("a", torch.float32, (1,))] * 2)


def test_manifest_entry_rejects_inconsistent_byte_count():
    with pytest.raises(ValueError, match="nbytes 7 but float32 \\[2\\] is 8 bytes"):
        ManifestEntry("x", "float32", (2,), 7)


def test_manifest_entry_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="'float99', which is not a torch dtype"):
        ManifestEntry("x", "float99", (2,), 8)


# -- header -------------------------------------------------------------------


def test_header_round_trips_with_and_without_manifest():
    h = header(checksum="ws1", receipt_channel="shm", receipt_dir="/dev/shm/x")
    again = PublicationHeader.from_dict(json.loads(json.dumps(h.to_dict())))
    assert again == h and again.manifest == h.manifest
    slim = h.without_manifest()
    assert "manifest" not in slim.to_dict()
    assert PublicationHeader.from_dict(slim.to_dict()) == h


def test_changed_fields_name_what_differs_apart_from_the_manifest_entries():
    h = header()
    assert h.changed_fields(h.without_manifest()) == []
    other = header(model_version=4, backend="sharded_rdt")
    assert h.changed_fields(other) == ["publication_id", "backend", "model_version"]


def test_header_rejects_manifest_it_does_not_announce():
    d = header().to_dict()
    d["manifest"] = Manifest.from_params(METAS[:2]).to_dict()
    with pytest.raises(ManifestMismatch, match="disagree on the model's structure"):
        PublicationHeader.from_dict(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_version": -1}, "model_version must be an integer >= 0"),
        ({"trainer_devices": ["a", "b"]}, "has 2 entries but trainer_world_size is 1"),
        ({"scope": "most"}, "scope is 'most'"),
        ({"scope": "partial"}, "scope is 'partial'; this vLLM accepts only 'full'"),
        ({"checksum": "md5"}, "checksum is 'md5'"),
        ({"receipt_channel": "shm"}, "receipt_dir must be set exactly when"),
        ({"publication_id": "x"}, "publication_id 'x'"),
        ({"payload_bytes": 1}, "a full update carries the whole manifest"),
        ({"extra": 1}, "unknown field\\(s\\) \\['extra'\\]"),
    ],
)
def test_header_validation_names_the_field(change, message):
    d = header().to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=message):
        PublicationHeader.from_dict(d)


@pytest.mark.parametrize("field", ["publication_id", "manifest_digest"])
def test_header_ids_with_a_trailing_newline_are_refused(field):
    d = header().to_dict()
    d[field] += "\n"
    with pytest.raises(ValueError, match=field):
        PublicationHeader.from_dict(d)


def test_a_receipt_of_another_scope_is_refused():
    d = Receipt.failure(header(), 0, "cpu:host:0", "boom").to_dict()
    d["scope"] = "partial"
    with pytest.raises(ValueError, match="receipt.scope is 'partial'; expected 'full'"):
        Receipt.from_dict(d)


def test_attach_and_pop_leave_the_backend_payload_unchanged():
    h = header()
    info = {"names": ["a"], "packed": True}
    sent = attach_publication(info, h, checksums=["ws1:4:00"])
    assert PUBLICATION_FIELD not in info
    got, sums, rest = pop_publication(json.loads(json.dumps(sent)))
    assert (got, sums, rest) == (h, ["ws1:4:00"], info)
    assert pop_publication(info) == (None, None, info)


def test_checksums_without_a_header_are_rejected():
    with pytest.raises(ValueError, match="payload_checksums but no publication"):
        pop_publication({"payload_checksums": ["x"]})
    with pytest.raises(ValueError, match="must be a list of strings"):
        pop_publication({"publication": header().to_dict(), "payload_checksums": 3})


@pytest.mark.parametrize("dtype", [5, None, ["float32"], "_C"])
def test_a_manifest_dtype_that_is_not_a_dtype_name_is_a_clean_error(dtype):
    d = manifest().to_dict()
    del d["digest"]
    d["entries"][0][1] = dtype
    with pytest.raises(
        ValueError, match="manifest entry .* dtype is .*not a torch dtype"
    ):
        Manifest.from_dict(d)


@pytest.mark.parametrize(
    "error, text",
    [
        (AssertionError(), "AssertionError (raised without a message)"),
        (TimeoutError("  "), "TimeoutError (raised without a message)"),
        ("", "unknown failure (no reason given)"),
        (KeyError("w"), "'w'"),
    ],
)
def test_describe_error_is_never_blank(error, text):
    assert describe_error(error) == text
