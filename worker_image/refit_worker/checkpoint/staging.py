"""Staging: verify a checkpoint while the pod still serves, and hold it for the load.

stage_checkpoint (the worker's refit_stage) verifies as manifest.verify_checkpoint does while
reading each file once, keeps the verified bytes when the checkpoint fits the staging budget
(REFIT_STAGING_BUDGET_BYTES), and records every file's identity (device, inode, size, mtime,
ctime) so that the load can tell, with a few stats, whether anything changed since.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit_worker.checkpoint.digests import (
    FileIdentity,
    digest_bytes,
    digest_open_file,
    digest_pool,
    known_digest,
    remember_digest,
)
from refit_worker.checkpoint.manifest import (
    check_digest,
    check_tensors,
    listed_files,
    load_manifest,
    reject_manifest_mismatch,
    resolve_under_root,
)
from refit_worker.checkpoint.safetensors_header import (
    parse_safetensors_header,
    read_safetensors_header,
    safetensors_files,
)
from refit_worker.contract import MANIFEST_FILE, Manifest, ManifestTensor, RefitRejected

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
            digest = digest_bytes(data, algorithm)
        else:
            known = known_digest(before, algorithm)
            digest = known if known is not None else digest_open_file(f, algorithm)
        after = FileIdentity.of(os.fstat(f.fileno()))
    if data is not None and len(data) != before.size:
        after = dataclasses.replace(after, size=len(data))  # shrank while it was read
    if after == before:
        remember_digest(before, algorithm, digest)
    return _StagedFile(before, after, digest, data)


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
    paths = listed_files(directory, manifest)
    shard_names = frozenset(p.name for p in safetensors_files(directory))
    total = sum(f.size for f in manifest.files)
    hold = 0 < total <= budget
    algorithm = manifest.algorithm
    on_disk: dict[str, ManifestTensor] = {}
    files: dict[str, FileIdentity] = {}
    held: dict[str, bytes] = {}
    with digest_pool(len(paths)) as pool:
        staged = pool.map(lambda p: _stage_file(p, algorithm, hold), paths)
        for entry, file_path, one in zip(manifest.files, paths, staged, strict=True):
            what = one.after.change_since(one.before)
            if what is not None:
                raise RefitRejected(
                    "CheckpointChanged", f"{entry.name} changed while it was being staged ({what})"
                )
            check_digest(entry, one.digest, algorithm)
            try:
                if one.data is not None:
                    on_disk.update(parse_safetensors_header(entry.name, one.data))
                    held[entry.name] = one.data
                else:
                    on_disk.update(read_safetensors_header(file_path))
            except ValueError as exc:
                raise reject_manifest_mismatch(str(exc)) from None
            files[entry.name] = one.after
    check_tensors(on_disk, manifest)
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
