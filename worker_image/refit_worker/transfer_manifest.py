"""The transfer manifest's digests (defined in contract.py, next to TransferManifest): the
tensor digest, the manifest digest, and a manifest parsed with its digest checked; and the
transfer's names: a drafter's tensors beside its target's (contract.DRAFTER_PREFIX).

Standard library and blake3 only, no torch: a trainer, the worker and the operator compute and
check them alike, from raw bytes. refit_worker.broadcast.promise applies them to torch tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import blake3

from refit_worker.contract import DRAFTER_PREFIX, ContractError, TransferManifest, TransferTensor

T = TypeVar("T")

# Hash big tensors with BLAKE3's threads; below this, starting them costs more than it saves.
_THREADED_HASH_BYTES = 8 * 2**20


def tensor_digest(name: str, dtype: str, shape: Iterable[int], data: Any) -> str:
    """The tensor digest (hex) of `data`, a bytes-like object holding the raw elements:
    BLAKE3(name 0x00 dtype 0x00 dims 0x00 data)."""
    dims = ",".join(str(int(d)) for d in shape)
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes > _THREADED_HASH_BYTES else 1
    hasher = blake3.blake3(max_threads=threads)
    hasher.update(f"{name}\0{dtype}\0{dims}\0".encode())
    hasher.update(view)
    return hasher.hexdigest()


def manifest_digest(digests: Mapping[str, str]) -> str:
    """The manifest digest from tensor name -> tensor digest (hex): BLAKE3 over the 32-byte
    tensor digests in the order of the names' UTF-8 bytes."""
    hasher = blake3.blake3()
    for name in sorted(digests, key=lambda n: n.encode()):
        hasher.update(bytes.fromhex(digests[name]))
    return hasher.hexdigest()


def manifest_of(tensors: Mapping[str, TransferTensor]) -> TransferManifest:
    """A manifest of these tensors, with its digest."""
    return TransferManifest(
        dict(tensors), manifest_digest({n: t.digest for n, t in tensors.items()})
    )


def parse_manifest(doc: Any) -> TransferManifest:
    """contract.TransferManifest.from_json_dict plus the check that needs BLAKE3: the manifest
    digest is the digest of its tensors' digests. ContractError otherwise."""
    manifest = TransferManifest.from_json_dict(doc)
    expected = manifest_of(manifest.tensors).digest
    if expected != manifest.digest:
        raise ContractError(
            f"transfer manifest: blake3 {manifest.digest} is not the digest of its tensors' "
            f"digests ({expected})"
        )
    return manifest


def with_drafter(target: Mapping[str, T], drafter: Mapping[str, T]) -> dict[str, T]:
    """One transfer of the target's tensors and its drafter's, each drafter tensor under
    DRAFTER_PREFIX + its own name. ValueError for a target tensor named with the prefix: the
    receiver could not tell it from the drafter's."""
    clash = sorted(n for n in target if n.startswith(DRAFTER_PREFIX))
    if clash:
        raise ValueError(
            f"target tensors named with the drafter prefix {DRAFTER_PREFIX}: {clash[:5]}"
        )
    return {**target, **{DRAFTER_PREFIX + n: t for n, t in drafter.items()}}


def split_drafter(
    items: Iterable[tuple[str, T]],
) -> tuple[list[tuple[str, T]], list[tuple[str, T]]]:
    """(the target's items, the drafter's under their own names) of a transfer, each in the
    order given: with_drafter undone."""
    target: list[tuple[str, T]] = []
    drafter: list[tuple[str, T]] = []
    for name, value in items:
        if name.startswith(DRAFTER_PREFIX):
            drafter.append((name[len(DRAFTER_PREFIX) :], value))
        else:
            target.append((name, value))
    return target, drafter
