"""File digests of a checkpoint's shards: hashed in parallel on every core the process may
use, and remembered by file identity so that a file is hashed again only when it changed.

BLAKE3 (the blake3 package; vLLM depends on it too) or SHA-256 (format 1 manifests). Both
release the GIL while hashing, and so does a file read: several shards hash at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

_MAX_HASH_WORKERS = 8


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


@contextlib.contextmanager
def digest_pool(n_files: int) -> Iterator[ThreadPoolExecutor]:
    """Threads that hash `n_files` shards (hash_workers of them), on every core of the process."""
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


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of the whole file: ``blake3`` or ``sha256``."""
    with path.open("rb") as f:
        return digest_open_file(f, algorithm)


def digest_open_file(f: io.BufferedReader, algorithm: str) -> str:
    """Hex digest of what is left to read of an open file."""
    if algorithm == "blake3":
        # blake3's stubs do not spell hashlib's protocol; the object does implement it.
        return hashlib.file_digest(f, blake3.blake3).hexdigest()  # type: ignore[arg-type]
    return hashlib.file_digest(f, algorithm).hexdigest()


def digest_bytes(data: bytes, algorithm: str) -> str:
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()
    return hashlib.new(algorithm, data).hexdigest()


# Digests of files hashed earlier in this process, keyed by the file's identity: preflight
# hashes a checkpoint and refit_load verifies it again right after; without the memo a refit
# reads every byte twice more than the reload itself does. Any write to a file changes its
# ctime, which the key includes, so a changed file is always hashed again.
_DIGESTS: dict[tuple[int, int, int, int, int, str], str] = {}
_DIGESTS_MAX = 4096


def file_digest_memo(path: Path, algorithm: str) -> str:
    """file_digest, or the digest remembered for the file's identity now."""
    identity = FileIdentity.of(path.stat())
    digest = known_digest(identity, algorithm)
    if digest is None:
        digest = file_digest(path, algorithm)
        remember_digest(identity, algorithm, digest)
    return digest


def known_digest(identity: FileIdentity, algorithm: str) -> str | None:
    """The digest remembered for a file with this identity, if it was hashed before."""
    return _DIGESTS.get(_digest_key(identity, algorithm))


def _digest_key(identity: FileIdentity, algorithm: str) -> tuple[int, int, int, int, int, str]:
    return (
        identity.dev,
        identity.ino,
        identity.size,
        identity.mtime_ns,
        identity.ctime_ns,
        algorithm,
    )


def remember_digest(identity: FileIdentity, algorithm: str, digest: str) -> None:
    if len(_DIGESTS) >= _DIGESTS_MAX:
        _DIGESTS.clear()
    _DIGESTS[_digest_key(identity, algorithm)] = digest
