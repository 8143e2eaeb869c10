"""Checkpoint manifests: write one for a directory, and verify a directory against its own.

This module imports neither vLLM nor torch, so the trainer-side CLI, the worker extension and
the tests share it. A safetensors file starts with an 8-byte little-endian header length and a
JSON header naming every tensor's dtype, shape and byte range; reading that header is all the
verification needs besides hashing the bytes.

Staging (stage_checkpoint, for the worker's refit_stage) verifies the same way while reading
each file once, keeps the verified bytes when the checkpoint fits the staging budget
(REFIT_STAGING_BUDGET_BYTES), and records every file's identity (device, inode, size, mtime,
ctime) so that the load can tell, with a few stats, whether anything changed since.

Every refusal raises contract.RefitRejected with a code the operator reports as the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from refit_worker.dtypes import DTYPE_BYTES

# Re-exported: testbed/simworker.py checks its pretend model's tensors through these.
from refit_worker.model_tensors import ExpectedParam as ExpectedParam
from refit_worker.model_tensors import verify_params as verify_params

SAFETENSORS_SUFFIX = ".safetensors"
# A header larger than this is not a checkpoint we wrote; refuse instead of reading it whole.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_MAX_HASH_WORKERS = 8


def _reject_manifest_mismatch(detail: str) -> RefitRejected:
    return RefitRejected("ManifestMismatch", detail)


def read_safetensors_header(path: Path) -> dict[str, ManifestTensor]:
    """Tensor name -> (file, dtype, shape) from a safetensors file's header.

    Raises ValueError with the reason when the file is not a well-formed safetensors file
    (too short, header length past the end, tensor byte ranges outside the data).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        return _parse_safetensors_header(path.name, size, f.read)


def parse_safetensors_header(name: str, data: bytes) -> dict[str, ManifestTensor]:
    """read_safetensors_header of a file held in memory (`name`: its file name)."""
    view = memoryview(data)
    at = 0

    def read(n: int) -> bytes:
        nonlocal at
        chunk = bytes(view[at : at + n])
        at += len(chunk)
        return chunk

    return _parse_safetensors_header(name, len(data), read)


def _parse_safetensors_header(
    name: str, size: int, read: Callable[[int], bytes]
) -> dict[str, ManifestTensor]:
    raw_len = read(8)
    if len(raw_len) != 8:
        raise ValueError(f"{name}: {size} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise ValueError(f"{name}: header length {header_len} exceeds the file")
    try:
        header = json.loads(read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, ManifestTensor] = {}
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: tensor {tname!r} has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name}: tensor {tname!r} has unknown dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{name}: tensor {tname!r} byte range {begin}..{end} does not fit "
                f"{dtype}{list(shape)} inside {data_len} data bytes"
            )
        tensors[tname] = ManifestTensor(file=name, dtype=dtype, shape=shape)
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
    identity = FileIdentity.of(path.stat())
    digest = _DIGESTS.get(_digest_key(identity, algorithm))
    if digest is None:
        digest = file_digest(path, algorithm)
        _remember_digest(identity, algorithm, digest)
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
    paths = _listed_files(directory, manifest)
    # Hashing bounds a refit: hash the shards concurrently (see hash_workers), and judge the
    # digests in manifest order so a refusal names the same shard whatever the timing.
    on_disk: dict[str, ManifestTensor] = {}
    algorithm = manifest.algorithm
    with _digest_pool(len(paths)) as pool:
        digests = pool.map(lambda p: file_digest_memo(p, algorithm), paths)
        for entry, path, digest in zip(manifest.files, paths, digests, strict=True):
            _check_digest(entry, digest, algorithm)
            try:
                on_disk.update(read_safetensors_header(path))
            except ValueError as exc:
                raise _reject_manifest_mismatch(str(exc)) from None
    _check_tensors(on_disk, manifest)


def _listed_files(directory: Path, manifest: Manifest) -> list[Path]:
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
    return paths


@contextlib.contextmanager
def _digest_pool(n_files: int) -> Iterator[ThreadPoolExecutor]:
    cpus = process_cpus()
    pool = ThreadPoolExecutor(
        hash_workers(n_files, len(cpus)),
        thread_name_prefix="refit-digest",
        initializer=_run_on,
        initargs=(cpus,),
    )
    try:
        yield pool
    finally:
        # After a refusal, shards not yet started are not hashed for nothing.
        pool.shutdown(cancel_futures=True)


def _check_digest(entry: ManifestFile, digest: str, algorithm: str) -> None:
    if digest != entry.digest:
        raise _reject_manifest_mismatch(
            f"{entry.name} {algorithm} {digest[:16]}… differs from the manifest's "
            f"{entry.digest[:16]}…"
        )


def _check_tensors(on_disk: Mapping[str, ManifestTensor], manifest: Manifest) -> None:
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


def verify_checkpoint(path: str, allowed_root: str) -> tuple[Path, Manifest]:
    """Path, manifest and files checks: everything that needs no model."""
    directory = resolve_under_root(path, allowed_root)
    manifest = load_manifest(directory)
    verify_files(directory, manifest)
    return directory, manifest


# ---------------------------------------------------------------------------------------
# Staging: verify a checkpoint while the pod still serves, hold its bytes for the load
# ---------------------------------------------------------------------------------------
STAGING_BUDGET_ENV = "REFIT_STAGING_BUDGET_BYTES"
DEFAULT_STAGING_BUDGET = 8 * 2**30
# Kubernetes quantity suffixes, as a pod's memory limit is written.
_BYTE_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_BYTE_COUNT = re.compile(r"([0-9]+)([A-Za-z]*)")


def parse_staging_budget(text: str | None) -> int:
    """The staging budget in bytes from REFIT_STAGING_BUDGET_BYTES's text.

    Unset or empty: DEFAULT_STAGING_BUDGET (8 GiB). Otherwise a non-negative integer of
    bytes, optionally with a Kubernetes quantity suffix (k, M, G, T: powers of 1000; Ki, Mi,
    Gi, Ti: powers of 1024), e.g. ``536870912``, ``512Mi``, ``8Gi``. ``0`` never holds bytes.
    Anything else raises ValueError naming the variable: a typo must not silently become a
    budget (the default may be larger than the memory the pod was sized for).
    """
    if text is None or not text.strip():
        return DEFAULT_STAGING_BUDGET
    match = _BYTE_COUNT.fullmatch(text.strip())
    if match is None or match.group(2) not in _BYTE_SUFFIXES:
        raise ValueError(
            f"{STAGING_BUDGET_ENV}={text!r} is not a byte count: give a non-negative integer "
            "of bytes, optionally with a suffix k, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti "
            "(powers of 1024), e.g. 8Gi; 0 holds nothing in memory"
        )
    return int(match.group(1)) * _BYTE_SUFFIXES[match.group(2)]


def staging_budget(environ: Mapping[str, str] | None = None) -> int:
    """The budget this process stages with (read at each call; see parse_staging_budget)."""
    env = os.environ if environ is None else environ
    return parse_staging_budget(env.get(STAGING_BUDGET_ENV))


def format_bytes(n: int) -> str:
    """412.3 MiB, 8.0 GiB, 512 B: one human reading of a byte count (powers of 1024)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


@dataclass(frozen=True)
class FileIdentity:
    """What the file system says about a file without reading it. Any write to a file
    changes its ctime (and mtime); a replacement (rename over, new symlink target) changes
    its inode. A write within the file system's timestamp granularity of the previous one
    can leave both times unchanged: that residual window is the probe's to catch."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change_since(self, before: FileIdentity) -> str | None:
        """How this file differs from `before` in words, or None when it does not."""
        if (self.dev, self.ino) != (before.dev, before.ino):
            return "replaced by another file"
        if self.size != before.size:
            return f"size {before.size} -> {self.size} bytes"
        if self.mtime_ns != before.mtime_ns:
            return "rewritten: new modification time"
        if self.ctime_ns != before.ctime_ns:
            return "rewritten or its metadata changed: new change time"
        return None


def _digest_key(identity: FileIdentity, algorithm: str) -> tuple[int, int, int, int, int, str]:
    return (
        identity.dev,
        identity.ino,
        identity.size,
        identity.mtime_ns,
        identity.ctime_ns,
        algorithm,
    )


def _remember_digest(identity: FileIdentity, algorithm: str, digest: str) -> None:
    if len(_DIGESTS) >= _DIGESTS_MAX:
        _DIGESTS.clear()
    _DIGESTS[_digest_key(identity, algorithm)] = digest


@dataclass(frozen=True)
class CheckpointIdentity:
    """The identities a staged checkpoint is held to until its load: the manifest file,
    every file the manifest lists, and the set of shard files in the directory (the
    loader reads every *.safetensors file, so a new one matters as much as a changed one)."""

    manifest: FileIdentity
    files: Mapping[str, FileIdentity]  # by file name, in manifest order
    shards: frozenset[str]  # names of the directory's *.safetensors files

    def first_change(self, directory: Path) -> tuple[str, str] | None:
        """(file name, what changed) for the first difference on disk now, or None. Costs
        one stat per file and one directory listing: no byte is read."""
        for name, before in [(MANIFEST_FILE, self.manifest), *self.files.items()]:
            try:
                now = FileIdentity.of((directory / name).stat())
            except FileNotFoundError:
                return name, "removed"
            except OSError as exc:
                return name, f"unreadable: {exc.strerror or exc}"
            what = now.change_since(before)
            if what is not None:
                return name, what
        try:
            shards = {p.name for p in safetensors_files(directory)}
        except OSError as exc:
            return directory.name, f"directory unreadable: {exc.strerror or exc}"
        for name in sorted(shards - self.shards):
            return name, "a new shard file the manifest does not list"
        for name in sorted(self.shards - shards):
            return name, "removed"
        return None


@dataclass
class StagedCheckpoint:
    """A verified checkpoint held for refit_load: its identities and, within the staging
    budget, its shards' bytes (exactly the bytes whose digests matched the manifest)."""

    path: str  # as the caller named it
    directory: Path  # where it resolved
    manifest: Manifest
    identity: CheckpointIdentity
    budget: int
    in_memory: bool
    shards: dict[str, bytes] = field(default_factory=dict)  # file name -> bytes, in order
    summary: dict[str, Any] = field(default_factory=dict)  # the caller's stage result
    reused: bool = False  # this staging found the previous one unchanged

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    @property
    def mode(self) -> str:
        """``memory`` or ``disk``: where refit_load reads the bytes from."""
        return "memory" if self.in_memory else "disk"

    def note(self) -> str:
        """One line for the pod's status: what staging held and why."""
        size, budget = format_bytes(self.total_bytes), format_bytes(self.budget)
        if self.in_memory:
            note = f"held {size} in memory (staging budget {budget})"
        elif self.budget == 0:
            note = (
                f"staging budget is 0 ({STAGING_BUDGET_ENV}): the load reads the {size} "
                "again after checking that no file changed"
            )
        else:
            note = (
                f"{size} exceeds the staging budget {budget}: the load reads the files "
                "again after checking that none changed"
            )
        return note + (" (already staged, unchanged since)" if self.reused else "")

    def first_change(self) -> tuple[str, str] | None:
        return self.identity.first_change(self.directory)

    def check_before_load(self, allowed_root: str) -> None:
        """Before a load touches the model: the path still resolves to the staged directory
        and no file differs from when it was staged, else CheckpointChanged (path rules
        refuse as in staging). Costs a stat per file and a directory listing, no read."""
        if resolve_under_root(self.path, allowed_root) != self.directory:
            raise RefitRejected(
                "CheckpointChanged",
                f"{self.path} no longer resolves to {self.directory}, where it was staged",
            )
        change = self.first_change()
        if change is not None:
            name, what = change
            raise RefitRejected("CheckpointChanged", f"{name} changed since it was staged ({what})")

    def check_after_load(self) -> None:
        """After a load that read the files from disk: a change since staging means the
        loader may have read some files before it and some after, so the model may hold a
        mix: LoadFailed (the model was touched; the pod needs a good load before serving)."""
        change = self.first_change()
        if change is not None:
            name, what = change
            raise RefitRejected(
                "LoadFailed",
                f"checkpoint changed while loading: {name} ({what}); the model may hold a "
                "mix of old and new bytes",
            )

    def take_shards(self) -> Iterator[tuple[str, bytes]]:
        """The held shards in manifest order, each dropped from this object as it is
        handed out (the caller's copy is the last reference: memory goes back shard by
        shard during the load)."""
        for entry in self.manifest.files:
            data = self.shards.pop(entry.name, None)
            if data is None:
                raise RuntimeError(f"{entry.name} is not held (released or never staged)")
            yield entry.name, data

    def intact(self) -> bool:
        """Everything staged is still here (no shard taken or released)."""
        return not self.in_memory or len(self.shards) == len(self.manifest.files)

    def release(self) -> None:
        """Drop the held bytes (the identities stay, so a disk load can still check)."""
        self.shards.clear()


@dataclass
class _StagedFile:
    before: FileIdentity
    after: FileIdentity
    digest: str
    data: bytes | None


def _stage_file(path: Path, algorithm: str, hold: bool) -> _StagedFile:
    """Read one shard once: hash it (and keep its bytes when `hold`), with its identity
    taken from the open file before and after. Not holding, a digest hashed earlier under
    the same identity is reused (the digest memo)."""
    with path.open("rb") as f:
        before = FileIdentity.of(os.fstat(f.fileno()))
        data: bytes | None = None
        if hold:
            data = f.read(before.size)
            digest = _digest_bytes(data, algorithm)
        else:
            known = _DIGESTS.get(_digest_key(before, algorithm))
            digest = known if known is not None else _digest_open_file(f, algorithm)
        after = FileIdentity.of(os.fstat(f.fileno()))
    if data is not None and len(data) != before.size:
        after = dataclasses.replace(after, size=len(data))  # shrank while it was read
    if after == before:
        _remember_digest(before, algorithm, digest)
    return _StagedFile(before, after, digest, data)


def _digest_bytes(data: bytes, algorithm: str) -> str:
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()
    return hashlib.new(algorithm, data).hexdigest()


def _digest_open_file(f: io.BufferedReader, algorithm: str) -> str:
    if algorithm == "blake3":
        return hashlib.file_digest(f, blake3.blake3).hexdigest()  # type: ignore[arg-type]
    return hashlib.file_digest(f, algorithm).hexdigest()


def stage_checkpoint(
    path: str,
    allowed_root: str,
    budget: int,
    *,
    previous: StagedCheckpoint | None = None,
) -> StagedCheckpoint:
    """Verify a checkpoint as verify_checkpoint does (path rules, manifest, every file's
    size and digest, the headers' tensors) and stage it for a load: each file read once,
    its bytes kept when the checkpoint's total fits `budget`, and every file's identity
    recorded for StagedCheckpoint.check_unchanged.

    `previous`: the checkpoint staged before. When it is the same path, resolves to the
    same directory, was staged under the same budget and nothing changed since, it is
    returned as is (reused=True: no byte read again). Otherwise it is released before
    anything is read, so two checkpoints are never held at once.

    Refuses like verify_checkpoint; a file that changes while it is being staged refuses
    CheckpointChanged.
    """
    directory = resolve_under_root(path, allowed_root)
    if previous is not None:
        if (
            previous.path == path
            and previous.directory == directory
            and previous.budget == budget
            and previous.intact()
            and previous.first_change() is None
        ):
            previous.reused = True
            return previous
        previous.release()
    # The manifest's identity is taken before it is read: a rewrite after this shows below.
    try:
        manifest_identity: FileIdentity | None = FileIdentity.of((directory / MANIFEST_FILE).stat())
    except OSError:
        manifest_identity = None
    manifest = load_manifest(directory)  # refuses CheckpointMissing when it is absent
    if manifest_identity is None:
        raise RefitRejected(
            "CheckpointChanged", f"{MANIFEST_FILE} appeared while the checkpoint was being staged"
        )
    paths = _listed_files(directory, manifest)
    shard_names = frozenset(p.name for p in safetensors_files(directory))
    total = sum(f.size for f in manifest.files)
    hold = 0 < total <= budget
    algorithm = manifest.algorithm
    on_disk: dict[str, ManifestTensor] = {}
    files: dict[str, FileIdentity] = {}
    held: dict[str, bytes] = {}
    with _digest_pool(len(paths)) as pool:
        staged = pool.map(lambda p: _stage_file(p, algorithm, hold), paths)
        for entry, file_path, one in zip(manifest.files, paths, staged, strict=True):
            what = one.after.change_since(one.before)
            if what is not None:
                raise RefitRejected(
                    "CheckpointChanged", f"{entry.name} changed while it was being staged ({what})"
                )
            _check_digest(entry, one.digest, algorithm)
            try:
                if one.data is not None:
                    on_disk.update(parse_safetensors_header(entry.name, one.data))
                    held[entry.name] = one.data
                else:
                    on_disk.update(read_safetensors_header(file_path))
            except ValueError as exc:
                raise _reject_manifest_mismatch(str(exc)) from None
            files[entry.name] = one.after
    _check_tensors(on_disk, manifest)
    result = StagedCheckpoint(
        path=path,
        directory=directory,
        manifest=manifest,
        identity=CheckpointIdentity(manifest_identity, files, shard_names),
        budget=budget,
        in_memory=hold,
        shards=held,
    )
    # What was verified is what is on disk now: a manifest rewritten or a shard added while
    # the files were read is not staged.
    change = result.first_change()
    if change is not None:
        result.release()
        name, what = change
        raise RefitRejected(
            "CheckpointChanged", f"{name} changed while it was being staged ({what})"
        )
    return result
