"""The transfer manifest (contract.TransferManifest) and its digests
(refit_worker.transfer_manifest): the definition in contract.py computed by hand with BLAKE3,
and what the format refuses."""

from __future__ import annotations

import struct
from typing import Any

import blake3
import pytest
from refit_worker.contract import (
    REJECTION_CODES,
    ContractError,
    TransferManifest,
    TransferTensor,
    parse_rejection,
)
from refit_worker.transfer_manifest import (
    manifest_digest,
    manifest_of,
    parse_manifest,
    tensor_digest,
)

F32_1_2 = struct.pack("<2f", 1.0, 2.0)


def test_tensor_digest_is_blake3_of_name_dtype_dims_and_bytes() -> None:
    by_hand = blake3.blake3(b"w\0F32\x002\0" + F32_1_2).hexdigest()
    assert tensor_digest("w", "F32", (2,), F32_1_2) == by_hand
    # A scalar has no dims; a 2-D shape joins them with ","; the name is UTF-8.
    assert (
        tensor_digest("s", "F32", (), F32_1_2[:4])
        == blake3.blake3(b"s\0F32\0\0" + F32_1_2[:4]).hexdigest()
    )
    assert (
        tensor_digest("é", "F32", (1, 2), F32_1_2)
        == blake3.blake3("é\0F32\x001,2\0".encode() + F32_1_2).hexdigest()
    )
    # memoryviews of other item sizes hash their bytes
    assert tensor_digest("w", "F32", (2,), memoryview(F32_1_2).cast("f")) == by_hand


@pytest.mark.parametrize(
    "other",
    [
        ("v", "F32", (2,), F32_1_2),  # another name
        ("w", "I32", (2,), F32_1_2),  # the same bytes read as another dtype
        ("w", "F32", (1, 2), F32_1_2),  # or another shape
        ("w", "F32", (2,), struct.pack("<2f", 1.0, 2.5)),  # one element changed
    ],
)
def test_every_part_of_a_tensor_changes_its_digest(other: tuple[Any, ...]) -> None:
    assert tensor_digest(*other) != tensor_digest("w", "F32", (2,), F32_1_2)


def test_the_manifest_digest_hashes_tensor_digests_in_utf8_name_order() -> None:
    digests = {n: tensor_digest(n, "U8", (1,), b"x") for n in ("b", "a", "Z", "é")}
    order = sorted(digests, key=lambda n: n.encode())
    assert order == ["Z", "a", "b", "é"]
    by_hand = blake3.blake3(b"".join(bytes.fromhex(digests[n]) for n in order)).hexdigest()
    assert manifest_digest(digests) == by_hand
    assert manifest_digest(dict(reversed(digests.items()))) == by_hand  # any arrival order


def manifest() -> TransferManifest:
    return manifest_of(
        {
            "model.b": TransferTensor("F32", (2,), tensor_digest("model.b", "F32", (2,), F32_1_2)),
            "model.a": TransferTensor("U8", (), tensor_digest("model.a", "U8", (), b"\x07")),
        }
    )


def test_json_round_trip() -> None:
    m = manifest()
    doc = m.to_json_dict()
    assert doc["formatVersion"] == 1 and doc["blake3"] == m.digest
    assert list(doc["tensors"]) == ["model.a", "model.b"]
    assert doc["tensors"]["model.b"] == {
        "dtype": "F32",
        "shape": [2],
        "blake3": m.tensors["model.b"].digest,
    }
    assert parse_manifest(doc) == m
    assert TransferManifest.from_json_dict(doc) == m


def test_a_digest_that_is_not_its_tensors_digest_is_refused() -> None:
    doc = manifest().to_json_dict()
    doc["blake3"] = "0" * 64
    TransferManifest.from_json_dict(doc)  # the format alone cannot tell
    with pytest.raises(ContractError, match="is not the digest of its tensors' digests"):
        parse_manifest(doc)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(formatVersion=2), "formatVersion 2 is not supported"),
        (lambda d: d.pop("blake3"), "missing field 'blake3'"),
        (lambda d: d.update(blake3="ABC"), "blake3 must be 64 lowercase hex digits"),
        (lambda d: d.update(tensors={}), "tensors is empty"),
        (lambda d: d["tensors"]["model.b"].update(shape=[-1]), "non-negative integers"),
        (lambda d: d["tensors"]["model.b"].update(shape=[True]), "non-negative integers"),
        (lambda d: d["tensors"]["model.b"].pop("dtype"), "missing field 'dtype'"),
        (lambda d: d["tensors"]["model.b"].update(blake3="x"), "blake3 must be 64 lowercase"),
        (lambda d: d["tensors"].update({"a\0b": d["tensors"]["model.b"]}), "without NUL"),
    ],
)
def test_malformed_manifests_are_refused(change: Any, message: str) -> None:
    doc = manifest().to_json_dict()
    change(doc)
    with pytest.raises(ContractError, match=message):
        TransferManifest.from_json_dict(doc)
    with pytest.raises(ContractError):
        parse_manifest(doc)


def test_the_broadcast_refusal_codes_are_part_of_the_contract() -> None:
    assert {"TransferMismatch", "TransferFailed"} <= set(REJECTION_CODES)
    body = "error 'refit-rejected: TransferMismatch: w: its bytes differ', please check the"
    assert parse_rejection(body) == ("TransferMismatch", "w: its bytes differ")
