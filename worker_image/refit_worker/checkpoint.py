"""Checkpoint manifests: write one for a directory, and verify a directory against its own.

This module imports neither vLLM nor torch, so the trainer-side CLI, the worker extension and
the tests share it. A safetensors file starts with an 8-byte little-endian header length and a
JSON header naming every tensor's dtype, shape and byte range; reading that header is all the
verification needs besides hashing the bytes.

Every refusal raises contract.RefitRejected with a code the operator reports as the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

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

SAFETENSORS_SUFFIX = ".safetensors"
# A header larger than this is not a checkpoint we wrote; refuse instead of reading it whole.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_MAX_HASH_WORKERS = 8

# Bytes per element for each safetensors dtype (used to check a header's byte ranges).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class ExpectedParam:
    """A tensor the model will load, as preflight compares it with the checkpoint."""

    shape: tuple[int, ...] | None  # None: the shape cannot be derived, so it is not checked
    dtype: str  # safetensors dtype name


def _reject_manifest_mismatch(detail: str) -> RefitRejected:
    return RefitRejected("ManifestMismatch", detail)


def read_safetensors_header(path: Path) -> dict[str, ManifestTensor]:
    """Tensor name -> (file, dtype, shape) from a safetensors file's header.

    Raises ValueError with the reason when the file is not a well-formed safetensors file
    (too short, header length past the end, tensor byte ranges outside the data).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path.name}: {size} bytes is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(f"{path.name}: header length {header_len} exceeds the file")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path.name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, ManifestTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name}: tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{path.name}: tensor {name!r} has unknown dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{path.name}: tensor {name!r} byte range {begin}..{end} does not fit "
                f"{dtype}{list(shape)} inside {data_len} data bytes"
            )
        tensors[name] = ManifestTensor(file=path.name, dtype=dtype, shape=shape)
    return tensors


def process_cpus(pid: int | None = None) -> set[int]:
    """The cores a process's threads may run on, all threads together (this process by
    default). Not one thread's affinity: vLLM's CPU worker pins each of its OpenMP threads,
    the main thread included, to one core of the worker's binding, and a new thread inherits
    the affinity of the thread that starts it."""
    if not hasattr(os, "sched_getaffinity"):
        return set(range(os.cpu_count() or 1))
    task = Path(f"/proc/{pid or 'self'}/task")
    cpus: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(task):
            with contextlib.suppress(OSError, ValueError):  # a thread may exit meanwhile
                cpus |= os.sched_getaffinity(int(tid))
    return cpus or os.sched_getaffinity(pid or 0)


def hash_workers(n_files: int, cores: int | None = None) -> int:
    """Threads that hash a checkpoint's shards at once. hashlib releases the GIL while it
    hashes and so does a file read, so each thread alternates between waiting on the disk
    and hashing: two per usable core keep both busy (a cold read of several files at once
    is also faster than one sequential reader). The cap bounds the disk queue. `cores`:
    how many the process may use (default: process_cpus)."""
    cores = cores if cores is not None else len(process_cpus())
    return max(1, min(n_files, 2 * cores, _MAX_HASH_WORKERS))


def _run_on(cpus: set[int]) -> None:
    """Digest thread initializer: run on every core of the process, not only on the core of
    the thread that started the pool (in a vLLM CPU worker that core is OpenMP thread 0's,
    which the idle scheduler process may be spinning on)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, cpus)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of the whole file: ``blake3`` (the blake3 package; vLLM depends on it too)
    or ``sha256``. Both release the GIL while hashing, so several files hash in parallel."""
    with path.open("rb") as f:
        if algorithm == "blake3":
            # blake3's stubs do not spell hashlib's protocol; the object does implement it.
            return hashlib.file_digest(f, blake3.blake3).hexdigest()  # type: ignore[arg-type]
        return hashlib.file_digest(f, algorithm).hexdigest()


# Digests of files hashed earlier in this process, keyed by the file's identity: preflight
# hashes a checkpoint and refit_load verifies it again right after; without the memo a refit
# reads every byte twice more than the reload itself does. Any write to a file changes its
# ctime, which the key includes, so a changed file is always hashed again.
_DIGESTS: dict[tuple[int, int, int, int, int, str], str] = {}
_DIGESTS_MAX = 4096


def file_digest_memo(path: Path, algorithm: str) -> str:
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, algorithm)
    digest = _DIGESTS.get(key)
    if digest is None:
        digest = file_digest(path, algorithm)
        if len(_DIGESTS) >= _DIGESTS_MAX:
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    return digest


def safetensors_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(SAFETENSORS_SUFFIX))


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
    if manifest.format != "safetensors":
        raise RefitRejected("ManifestInvalid", f"format {manifest.format!r} is not safetensors")
    if not manifest.files:
        raise RefitRejected("ManifestInvalid", "the manifest lists no files")
    listed = {f.name for f in manifest.files}
    # The loader reads every *.safetensors file in the directory, listed or not.
    unlisted = sorted(p.name for p in safetensors_files(directory) if p.name not in listed)
    if unlisted:
        raise _reject_manifest_mismatch(f"files not in the manifest: {', '.join(unlisted)}")
    # Presence and sizes first: a missing or truncated shard is refused before any hashing.
    paths: list[Path] = []
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file() or (path.is_symlink() and not _inside(path, directory)):
            raise _reject_manifest_mismatch(f"{entry.name} is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise _reject_manifest_mismatch(
                f"{entry.name} has {size} bytes, the manifest says {entry.size}"
            )
        paths.append(path)
    # Hashing bounds a refit: hash the shards concurrently (see hash_workers), and judge the
    # digests in manifest order so a refusal names the same shard whatever the timing.
    on_disk: dict[str, ManifestTensor] = {}
    algorithm = manifest.algorithm
    cpus = process_cpus()
    pool = ThreadPoolExecutor(
        hash_workers(len(paths), len(cpus)),
        thread_name_prefix="refit-digest",
        initializer=_run_on,
        initargs=(cpus,),
    )
    try:
        digests = pool.map(lambda p: file_digest_memo(p, algorithm), paths)
        for entry, path, digest in zip(manifest.files, paths, digests, strict=True):
            if digest != entry.digest:
                raise _reject_manifest_mismatch(
                    f"{entry.name} {algorithm} {digest[:16]}… differs from the manifest's "
                    f"{entry.digest[:16]}…"
                )
            try:
                on_disk.update(read_safetensors_header(path))
            except ValueError as exc:
                raise _reject_manifest_mismatch(str(exc)) from None
    finally:
        # After a refusal, shards not yet started are not hashed for nothing.
        pool.shutdown(cancel_futures=True)
    if on_disk != manifest.tensors:
        missing = sorted(set(manifest.tensors) - set(on_disk))
        extra = sorted(set(on_disk) - set(manifest.tensors))
        changed = sorted(
            n for n in set(on_disk) & set(manifest.tensors) if on_disk[n] != manifest.tensors[n]
        )
        raise _reject_manifest_mismatch(
            "tensors in the files differ from the manifest: "
            f"missing {missing[:5]}, unlisted {extra[:5]}, changed {changed[:5]}"
        )


def _inside(path: Path, directory: Path) -> bool:
    real = Path(os.path.realpath(path))
    return Path(os.path.realpath(directory)) in real.parents


def dtype_compatible(checkpoint: str, param: str) -> bool:
    """vLLM casts floating checkpoints to the parameter dtype on load; anything else (FP8,
    integer-packed quantized weights) must match exactly."""
    if checkpoint in FLOAT_DTYPES and param in FLOAT_DTYPES:
        return True
    return checkpoint == param


def verify_params(
    tensors: Mapping[str, ManifestTensor],
    expected: Mapping[str, ExpectedParam],
    ignored: Callable[[str], bool] = lambda name: False,
) -> None:
    """Every expected tensor is in the checkpoint with the same shape and a compatible dtype,
    and the checkpoint holds nothing the model would not know where to put (a name the
    model's loader has no parameter for fails inside vLLM's reload, after the old weights
    are gone). `ignored` names checkpoint tensors the model's loader skips on purpose."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise RefitRejected(
            "TensorMismatch", f"the checkpoint lacks {', '.join(missing[:5])}{more}"
        )
    unknown = sorted(n for n in set(tensors) - set(expected) if not ignored(n))
    if unknown:
        raise RefitRejected(
            "TensorMismatch", f"the model has no parameter for {', '.join(unknown[:5])}"
        )
    for name, want in sorted(expected.items()):
        got = tensors[name]
        if want.shape is not None and got.shape != want.shape:
            raise RefitRejected(
                "TensorMismatch",
                f"{name}: checkpoint shape {list(got.shape)}, the model expects {list(want.shape)}",
            )
        if not dtype_compatible(got.dtype, want.dtype):
            raise RefitRejected(
                "TensorMismatch",
                f"{name}: checkpoint dtype {got.dtype}, the model expects {want.dtype}",
            )


def verify_checkpoint(path: str, allowed_root: str) -> tuple[Path, Manifest]:
    """Path, manifest and files checks: everything that needs no model."""
    directory = resolve_under_root(path, allowed_root)
    manifest = load_manifest(directory)
    verify_files(directory, manifest)
    return directory, manifest
