"""Checkpoint manifests: write one for a directory, and verify a directory against its own
(the path rules, every listed file present with its size and digest and no shard unlisted,
the headers' tensors exactly the manifest's). Every refusal raises contract.RefitRejected with
the code the operator reports as the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from refit_worker.checkpoint.digests import digest_pool, file_digest, file_digest_memo
from refit_worker.checkpoint.safetensors_header import (
    SAFETENSORS_SUFFIX,
    read_safetensors_header,
    safetensors_files,
)
from refit_worker.contract import (
    MANIFEST_DIGESTS,
    MANIFEST_FILE,
    MANIFEST_FORMAT_VERSION,
    ContractError,
    Manifest,
    ManifestFile,
    ManifestTensor,
    RefitRejected,
)


def reject_manifest_mismatch(detail: str) -> RefitRejected:
    return RefitRejected("ManifestMismatch", detail)


def build_manifest(directory: Path) -> Manifest:
    """Describe every safetensors file of a checkpoint directory (sizes, hashes, tensors)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory")
    files = safetensors_files(directory)
    if not files:
        raise FileNotFoundError(f"{directory}: no *{SAFETENSORS_SUFFIX} files")
    entries: list[ManifestFile] = []
    tensors: dict[str, ManifestTensor] = {}
    for path in files:
        for name, tensor in read_safetensors_header(path).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {tensors[name].file} and {path.name}")
            tensors[name] = tensor
        algorithm = MANIFEST_DIGESTS[MANIFEST_FORMAT_VERSION]
        entries.append(ManifestFile(path.name, path.stat().st_size, file_digest(path, algorithm)))
    return Manifest(files=tuple(entries), tensors=tensors)


def write_manifest(directory: Path) -> Path:
    """Write refit-manifest.json atomically (temporary file, then rename) and return its path."""
    manifest = build_manifest(directory)
    target = directory / MANIFEST_FILE
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest.to_json_dict(), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def resolve_under_root(path: str, allowed_root: str) -> Path:
    """The checkpoint directory, if `path` names one inside `allowed_root` without escaping."""
    if not allowed_root:
        raise RefitRejected("PathNotAllowed", "no allowed checkpoint root is configured")
    if not path or not os.path.isabs(path):
        raise RefitRejected("PathNotAllowed", f"{path!r} is not an absolute path")
    if ".." in Path(path).parts:
        raise RefitRejected("PathNotAllowed", f"{path!r} contains '..'")
    root = Path(os.path.realpath(allowed_root))
    real = Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        raise RefitRejected(
            "PathNotAllowed", f"{path!r} resolves to {str(real)!r}, outside the allowed root"
        )
    if not real.is_dir():
        raise RefitRejected("CheckpointMissing", f"{path!r} is not a directory")
    return real


def load_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise RefitRejected("CheckpointMissing", f"{MANIFEST_FILE} is absent in {directory}")
    try:
        return Manifest.from_json_dict(json.loads(path.read_text()))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RefitRejected("ManifestInvalid", f"{MANIFEST_FILE} is not JSON: {exc}") from None
    except ContractError as exc:
        raise RefitRejected("ManifestInvalid", str(exc)) from None


def verify_files(directory: Path, manifest: Manifest) -> None:
    """The files on disk are exactly those of the manifest, byte for byte."""
    paths = listed_files(directory, manifest)
    # Hashing bounds a refit: hash the shards concurrently (see hash_workers), and judge the
    # digests in manifest order so a refusal names the same shard whatever the timing.
    on_disk: dict[str, ManifestTensor] = {}
    algorithm = manifest.algorithm
    with digest_pool(len(paths)) as pool:
        digests = pool.map(lambda p: file_digest_memo(p, algorithm), paths)
        for entry, path, digest in zip(manifest.files, paths, digests, strict=True):
            check_digest(entry, digest, algorithm)
            try:
                on_disk.update(read_safetensors_header(path))
            except ValueError as exc:
                raise reject_manifest_mismatch(str(exc)) from None
    check_tensors(on_disk, manifest)


def listed_files(directory: Path, manifest: Manifest) -> list[Path]:
    """The manifest's files, each present with its size, and no unlisted shard beside them
    (everything but the digests); refuses ManifestInvalid or ManifestMismatch."""
    if manifest.format != "safetensors":
        raise RefitRejected("ManifestInvalid", f"format {manifest.format!r} is not safetensors")
    if not manifest.files:
        raise RefitRejected("ManifestInvalid", "the manifest lists no files")
    listed = {f.name for f in manifest.files}
    # The loader reads every *.safetensors file in the directory, listed or not.
    unlisted = sorted(p.name for p in safetensors_files(directory) if p.name not in listed)
    if unlisted:
        raise reject_manifest_mismatch(f"files not in the manifest: {', '.join(unlisted)}")
    # Presence and sizes first: a missing or truncated shard is refused before any hashing.
    paths: list[Path] = []
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file() or (path.is_symlink() and not _inside(path, directory)):
            raise reject_manifest_mismatch(f"{entry.name} is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise reject_manifest_mismatch(
                f"{entry.name} has {size} bytes, the manifest says {entry.size}"
            )
        paths.append(path)
    return paths


def check_digest(entry: ManifestFile, digest: str, algorithm: str) -> None:
    if digest != entry.digest:
        raise reject_manifest_mismatch(
            f"{entry.name} {algorithm} {digest[:16]}… differs from the manifest's "
            f"{entry.digest[:16]}…"
        )


def check_tensors(on_disk: Mapping[str, ManifestTensor], manifest: Manifest) -> None:
    if on_disk != manifest.tensors:
        missing = sorted(set(manifest.tensors) - set(on_disk))
        extra = sorted(set(on_disk) - set(manifest.tensors))
        changed = sorted(
            n for n in set(on_disk) & set(manifest.tensors) if on_disk[n] != manifest.tensors[n]
        )
        raise reject_manifest_mismatch(
            "tensors in the files differ from the manifest: "
            f"missing {missing[:5]}, unlisted {extra[:5]}, changed {changed[:5]}"
        )


def _inside(path: Path, directory: Path) -> bool:
    real = Path(os.path.realpath(path))
    return Path(os.path.realpath(directory)) in real.parents


def verify_checkpoint(path: str, allowed_root: str) -> tuple[Path, Manifest]:
    """Path, manifest and files checks: everything that needs no model."""
    directory = resolve_under_root(path, allowed_root)
    manifest = load_manifest(directory)
    verify_files(directory, manifest)
    return directory, manifest
