"""refit_worker.checkpoint: manifests written and verified on real files (no vLLM)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np
import pytest
from refit_worker import checkpoint
from refit_worker.checkpoint import digests
from refit_worker.checkpoint import manifest as manifests
from refit_worker.contract import (
    MANIFEST_FILE,
    MANIFEST_FORMAT_VERSION,
    Manifest,
    ManifestTensor,
)
from safetensors.numpy import save_file

from tests.fixtures.checkpoints import make_checkpoint, rejected


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    make_checkpoint(r / "ckpt")
    return r


def test_manifest_describes_every_file_and_tensor(root: Path) -> None:
    doc = json.loads((root / "ckpt" / MANIFEST_FILE).read_text())
    m = Manifest.from_json_dict(doc)
    assert doc["formatVersion"] == MANIFEST_FORMAT_VERSION == 2
    assert all(set(f) == {"name", "size", "blake3"} for f in doc["files"])
    assert [f.name for f in m.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert m.tensors["a.weight"] == ManifestTensor(
        "model-00001-of-00002.safetensors", "F32", (4, 8)
    )
    assert m.tensors["b.weight"].dtype == "F16"
    assert all(len(f.digest) == 64 for f in m.files)
    assert m.algorithm == "blake3"
    assert not list(root.glob("ckpt/.*tmp"))


def test_verify_accepts_a_good_checkpoint(root: Path) -> None:
    directory, manifest = checkpoint.verify_checkpoint(str(root / "ckpt"), str(root))
    assert directory == (root / "ckpt").resolve()
    assert set(manifest.tensors) == {"a.weight", "a.bias", "b.weight"}


@pytest.mark.parametrize("path", ["ckpt", "/x/../ckpt"])
def test_relative_and_dotdot_paths_are_refused(root: Path, path: str) -> None:
    p = path if path == "ckpt" else str(root) + path
    rejected("PathNotAllowed", checkpoint.verify_checkpoint, p, str(root))


def test_paths_outside_the_root_and_symlink_escapes_are_refused(root: Path, tmp_path: Path) -> None:
    outside = make_checkpoint(tmp_path / "outside")
    rejected("PathNotAllowed", checkpoint.verify_checkpoint, str(outside), str(root))
    os.symlink(outside, root / "escape")
    detail = rejected(
        "PathNotAllowed", checkpoint.verify_checkpoint, str(root / "escape"), str(root)
    )
    assert "outside the allowed root" in detail
    # A symlink that stays inside the root is fine.
    os.symlink(root / "ckpt", root / "alias")
    checkpoint.verify_checkpoint(str(root / "alias"), str(root))
    rejected("PathNotAllowed", checkpoint.verify_checkpoint, str(root / "ckpt"), "")


def test_missing_directory_and_manifest(root: Path) -> None:
    rejected("CheckpointMissing", checkpoint.verify_checkpoint, str(root / "nope"), str(root))
    (root / "ckpt" / MANIFEST_FILE).unlink()
    rejected("CheckpointMissing", checkpoint.verify_checkpoint, str(root / "ckpt"), str(root))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not JSON"),
        ('{"formatVersion": 9}', "formatVersion 9"),
        ("[]", "not a JSON object"),
    ],
)
def test_invalid_manifest(root: Path, content: str, needle: str) -> None:
    (root / "ckpt" / MANIFEST_FILE).write_text(content)
    assert needle in rejected(
        "ManifestInvalid", checkpoint.verify_checkpoint, str(root / "ckpt"), str(root)
    )


def test_truncated_changed_missing_and_unlisted_files(root: Path) -> None:
    d = root / "ckpt"
    shard = d / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])
    assert "bytes" in rejected("ManifestMismatch", checkpoint.verify_checkpoint, str(d), str(root))
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "blake3" in rejected("ManifestMismatch", checkpoint.verify_checkpoint, str(d), str(root))
    shard.unlink()
    assert "missing" in rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(d), str(root)
    )
    shard.write_bytes(data)
    checkpoint.verify_checkpoint(str(d), str(root))
    save_file({"c": np.ones(1, np.float32)}, str(d / "extra.safetensors"))
    assert "extra.safetensors" in rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(d), str(root)
    )


def test_manifest_tensors_must_match_the_headers(root: Path) -> None:
    d = root / "ckpt"
    doc = json.loads((d / MANIFEST_FILE).read_text())
    doc["tensors"]["a.weight"]["shape"] = [8, 4]
    (d / MANIFEST_FILE).write_text(json.dumps(doc))
    assert "a.weight" in rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(d), str(root)
    )


def test_header_reader_refuses_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        checkpoint.read_safetensors_header(bad)
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="exceeds"):
        checkpoint.read_safetensors_header(bad)
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="does not fit"):
        checkpoint.read_safetensors_header(bad)


def test_build_manifest_needs_safetensors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        checkpoint.build_manifest(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        checkpoint.build_manifest(tmp_path / "nope")


def test_a_verified_file_is_hashed_once_until_it_changes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """preflight then refit_load verify the same files: the second pass reuses the digests,
    but any write to a file (same size, even same mtime) makes it hashed and checked again."""
    hashed: list[str] = []
    real = checkpoint.file_digest

    def counting(path: Path, algorithm: str) -> str:
        hashed.append(path.name)
        return real(path, algorithm)

    monkeypatch.setattr(digests, "file_digest", counting)
    checkpoint.verify_checkpoint(str(root / "ckpt"), str(root))
    assert len(hashed) == 2
    checkpoint.verify_checkpoint(str(root / "ckpt"), str(root))
    assert len(hashed) == 2
    shard = root / "ckpt" / "model-00002-of-00002.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size; the timestamp is put back below
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    message = rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(root / "ckpt"), str(root)
    )
    assert "blake3" in message
    assert hashed[2:] == [shard.name]


def make_sharded(directory: Path, n: int) -> list[Path]:
    directory.mkdir(parents=True)
    for k in range(n):
        save_file(
            {f"l{k}.weight": np.full((64, 64), k, np.float32)},
            str(directory / f"model-{k + 1:05d}-of-{n:05d}.safetensors"),
        )
    checkpoint.write_manifest(directory)
    return checkpoint.safetensors_files(directory)


def test_shards_are_hashed_concurrently_and_a_bad_last_byte_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard is hashed, in several threads, and the refusal names the first bad shard
    in manifest order with its digest, whichever thread hashed it; the digest memo stays keyed
    by the file's stat, so the repaired file is hashed again and accepted."""
    shards = make_sharded(tmp_path / "ckpt", 6)
    hashed: list[tuple[str, str]] = []  # (file, thread)
    real = checkpoint.file_digest
    both = threading.Barrier(2, timeout=30)  # breaks unless two shards are hashed at once

    def recording(path: Path, algorithm: str) -> str:
        hashed.append((path.name, threading.current_thread().name))
        if path in shards[:2]:
            both.wait()
        return real(path, algorithm)

    monkeypatch.setattr(digests, "file_digest", recording)
    checkpoint.verify_checkpoint(str(tmp_path / "ckpt"), str(tmp_path))
    assert sorted(name for name, _ in hashed) == [p.name for p in shards]
    assert checkpoint.hash_workers(len(shards)) >= 2
    assert len({thread for _, thread in hashed}) >= 2, hashed
    assert threading.current_thread().name not in {thread for _, thread in hashed}

    last = shards[-1]
    good = last.read_bytes()
    last.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    entry = checkpoint.load_manifest(tmp_path / "ckpt").files[-1]
    bad = blake3.blake3(last.read_bytes()).hexdigest()
    hashed.clear()
    detail = rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(tmp_path / "ckpt"), str(tmp_path)
    )
    assert detail == (
        f"{last.name} blake3 {bad[:16]}… differs from the manifest's {entry.digest[:16]}…"
    )
    assert [name for name, _ in hashed] == [last.name]  # the others are memo hits
    last.write_bytes(good)
    checkpoint.verify_checkpoint(str(tmp_path / "ckpt"), str(tmp_path))
    assert [name for name, _ in hashed] == [last.name, last.name]


def test_sizes_are_checked_before_any_hashing_and_a_refusal_stops_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_sharded(tmp_path / "ckpt", 6)
    other = make_sharded(tmp_path / "other", 6)
    hashed: list[str] = []
    real = checkpoint.file_digest

    def slow(path: Path, algorithm: str) -> str:
        hashed.append(path.name)
        if path != other[0]:
            time.sleep(0.2)  # still hashing when the first shard's refusal comes back
        return real(path, algorithm)

    monkeypatch.setattr(digests, "file_digest", slow)
    monkeypatch.setattr(digests, "hash_workers", lambda n, cores=None: 2)
    shards[-1].write_bytes(shards[-1].read_bytes()[:-1])
    detail = rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(tmp_path / "ckpt"), str(tmp_path)
    )
    assert "bytes, the manifest says" in detail
    assert hashed == []

    data = other[0].read_bytes()
    other[0].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(tmp_path / "other"), str(tmp_path)
    )
    assert len(hashed) <= 3, hashed  # the shards not started when it was refused are dropped


def test_hash_workers_are_bounded() -> None:
    assert checkpoint.hash_workers(1) == 1
    assert 1 <= checkpoint.hash_workers(1000) <= 8
    assert checkpoint.hash_workers(0) == 1
    assert checkpoint.hash_workers(1000, cores=1) == 2
    assert checkpoint.hash_workers(1000, cores=64) == 8


def test_digest_threads_run_on_every_core_of_the_process_not_the_callers_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a vLLM CPU worker: the thread that verifies is pinned to one core and another
    thread of the process holds the other cores. The digest threads run on all of them (and
    count them), not on the caller's core alone."""
    cores = sorted(os.sched_getaffinity(0))
    shards = make_sharded(tmp_path / "ckpt", 4)
    manifest = checkpoint.load_manifest(tmp_path / "ckpt")
    seen: list[set[int]] = []
    real = checkpoint.file_digest_memo

    def recording(path: Path, algorithm: str) -> str:
        seen.append(os.sched_getaffinity(0))
        return real(path, algorithm)

    monkeypatch.setattr(manifests, "file_digest_memo", recording)
    release = threading.Event()
    holding = threading.Event()
    errors: list[BaseException] = []

    def hold_the_other_cores() -> None:
        os.sched_setaffinity(0, cores[1:] or cores)
        holding.set()
        release.wait(30)

    def verify_pinned() -> None:
        try:
            os.sched_setaffinity(0, cores[:1])
            assert checkpoint.process_cpus() == set(cores)
            assert checkpoint.hash_workers(len(shards)) == min(len(shards), 2 * len(cores), 8)
            checkpoint.verify_files(tmp_path / "ckpt", manifest)
        except BaseException as exc:
            errors.append(exc)

    holder = threading.Thread(target=hold_the_other_cores)
    holder.start()
    assert holding.wait(30)
    try:
        verifier = threading.Thread(target=verify_pinned)
        verifier.start()
        verifier.join(60)
    finally:
        release.set()
        holder.join(30)
    assert not errors, errors
    assert len(seen) == len(shards)
    assert all(s == set(cores) for s in seen), (cores, seen)


def test_process_cpus_of_another_process_unions_its_threads() -> None:
    assert checkpoint.process_cpus(os.getpid()) == checkpoint.process_cpus()
    assert checkpoint.process_cpus() >= os.sched_getaffinity(0)


def test_a_format_1_manifest_is_still_verified_by_sha256(root: Path) -> None:
    """Manifests written before BLAKE3 (formatVersion 1, files[].sha256) keep working, with
    the same checks; a corrupt byte is refused naming sha256."""
    path = root / "ckpt" / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc["formatVersion"] = 1
    for f in doc["files"]:
        del f["blake3"]
        f["sha256"] = hashlib.sha256((root / "ckpt" / f["name"]).read_bytes()).hexdigest()
    path.write_text(json.dumps(doc))
    _, manifest = checkpoint.verify_checkpoint(str(root / "ckpt"), str(root))
    assert (manifest.formatVersion, manifest.algorithm) == (1, "sha256")
    assert manifest.to_json_dict()["files"] == doc["files"]
    shard = root / "ckpt" / doc["files"][0]["name"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    detail = rejected(
        "ManifestMismatch", checkpoint.verify_checkpoint, str(root / "ckpt"), str(root)
    )
    assert detail.startswith(f"{shard.name} sha256 ")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d["files"][0].pop("blake3"), "missing field 'blake3'"),
        (lambda d: d["files"][0].update(blake3="ABC"), "64 lowercase hex digits"),
        (lambda d: d.update(formatVersion=3), "formatVersion 3 is not supported (1, 2)"),
    ],
)
def test_a_manifest_without_a_usable_digest_is_invalid(
    root: Path, change: Callable[[dict], object], needle: str
) -> None:
    path = root / "ckpt" / MANIFEST_FILE
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    detail = rejected(
        "ManifestInvalid", checkpoint.verify_checkpoint, str(root / "ckpt"), str(root)
    )
    assert needle in detail, detail
