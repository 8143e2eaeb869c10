"""refit_worker.checkpoint's staging (refit_stage's files side) on real files, and the
simulated worker's refit_stage/refit_load over it (no vLLM)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from refit_operator.edges import worker_client
from refit_operator.edges.worker_client import WorkerClient, WorkerError
from refit_worker import checkpoint
from refit_worker.checkpoint import digests, staging
from refit_worker.contract import MANIFEST_FILE
from safetensors.numpy import load

from testbed.simfleet import SimPod
from testbed.simworker import SIM_WEIGHTS_FILE, make_sim_checkpoint
from tests.fixtures.checkpoints import SHARDS, make_checkpoint, rejected

Fleet = Callable[..., list[SimPod]]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    make_checkpoint(r / "ckpt")
    return r


def stage(root: Path, budget: int = 2**20, **kw: object) -> checkpoint.StagedCheckpoint:
    return checkpoint.stage_checkpoint(str(root / "ckpt"), str(root), budget, **kw)  # type: ignore[arg-type]


def rewrite_same_size(path: Path) -> None:
    """Different bytes, same size; the modification time put back (the change time moves)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.01)  # past the file system's timestamp granularity
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


# --- the budget ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, 8 * 2**30),
        ("", 8 * 2**30),
        ("  ", 8 * 2**30),
        ("0", 0),
        ("1048576", 2**20),
        (" 512Mi ", 512 * 2**20),
        ("8Gi", 8 * 2**30),
        ("1Ti", 2**40),
        ("64Ki", 64 * 1024),
        ("3k", 3000),
        ("2M", 2 * 10**6),
        ("8G", 8 * 10**9),
        ("1T", 10**12),
    ],
)
def test_budget_parses_bytes_and_kubernetes_suffixes(text: str | None, expected: int) -> None:
    assert checkpoint.parse_staging_budget(text) == expected
    env = {} if text is None else {checkpoint.STAGING_BUDGET_ENV: text}
    assert checkpoint.staging_budget(env) == expected


@pytest.mark.parametrize("text", ["8GB", "8gi", "-1", "1.5Gi", "lots", "8 Gi", "Gi", "0x10", "1e9"])
def test_a_malformed_budget_is_an_error_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError) as info:
        checkpoint.parse_staging_budget(text)
    message = str(info.value)
    assert message.startswith(f"REFIT_STAGING_BUDGET_BYTES={text!r} is not a byte count")
    assert "8Gi" in message


def test_format_bytes() -> None:
    assert checkpoint.format_bytes(0) == "0 B"
    assert checkpoint.format_bytes(1023) == "1023 B"
    assert checkpoint.format_bytes(2**20) == "1.0 MiB"
    assert checkpoint.format_bytes(int(412.3 * 2**20)) == "412.3 MiB"
    assert checkpoint.format_bytes(8 * 2**30) == "8.0 GiB"
    assert checkpoint.format_bytes(3 * 2**50) == "3072.0 TiB"


# --- staging --------------------------------------------------------------------------------
def test_within_the_budget_the_verified_bytes_are_held(root: Path) -> None:
    staged = stage(root)
    assert (staged.mode, staged.in_memory, staged.reused) == ("memory", True, False)
    assert staged.directory == (root / "ckpt").resolve()
    assert list(staged.shards) == list(SHARDS)
    for name in SHARDS:
        assert staged.shards[name] == (root / "ckpt" / name).read_bytes()
    assert staged.total_bytes == sum((root / "ckpt" / n).stat().st_size for n in SHARDS)
    assert staged.note() == (
        f"held {checkpoint.format_bytes(staged.total_bytes)} in memory (staging budget 1.0 MiB)"
    )
    assert staged.identity.shards == frozenset(SHARDS)
    assert set(staged.identity.files) == set(SHARDS)
    assert staged.first_change() is None
    staged.check_before_load(str(root))
    taken = list(staged.take_shards())
    assert [n for n, _ in taken] == list(SHARDS)
    assert load(taken[1][1])["b.weight"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert staged.shards == {} and not staged.intact()


def test_each_file_is_read_once_while_staging(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging in memory hashes the bytes it read: one open per shard, no second read."""
    opened: list[str] = []
    real_open = Path.open

    def counting(self: Path, *args: object, **kwargs: object):
        opened.append(self.name)
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", counting)
    monkeypatch.setattr(digests, "file_digest", lambda *a: pytest.fail("hashed from disk"))
    stage(root)
    assert sorted(n for n in opened if n.endswith(".safetensors")) == sorted(SHARDS)


@pytest.mark.parametrize("budget", [0, 100])
def test_over_the_budget_nothing_is_held(root: Path, budget: int) -> None:
    staged = stage(root, budget)
    assert (staged.mode, staged.shards) == ("disk", {})
    assert staged.intact()
    assert "the load reads" in staged.note() and "after checking that" in staged.note()
    assert ("staging budget is 0" in staged.note()) == (budget == 0)
    staged.check_before_load(str(root))
    staged.check_after_load()


def test_a_disk_staging_reuses_the_digests_of_a_preflight(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint.verify_checkpoint(str(root / "ckpt"), str(root))
    monkeypatch.setattr(staging, "digest_open_file", lambda *a: pytest.fail("hashed twice"))
    assert stage(root, 0).mode == "disk"


def test_staging_refuses_what_preflight_refuses(root: Path) -> None:
    ckpt = root / "ckpt"
    (ckpt / SHARDS[1]).write_bytes((ckpt / SHARDS[1]).read_bytes()[:-4])  # truncated
    assert "bytes, the manifest says" in rejected("ManifestMismatch", stage, root)
    make_checkpoint(root / "other")
    (root / "other" / "extra.safetensors").write_bytes(b"")
    detail = rejected(
        "ManifestMismatch",
        checkpoint.stage_checkpoint,
        str(root / "other"),
        str(root),
        2**20,
    )
    assert detail == "files not in the manifest: extra.safetensors"
    assert rejected("PathNotAllowed", checkpoint.stage_checkpoint, "/etc", str(root), 1)
    (root / "other" / "extra.safetensors").unlink()
    rewrite_same_size(root / "other" / SHARDS[0])
    assert "blake3" in rejected(
        "ManifestMismatch", checkpoint.stage_checkpoint, str(root / "other"), str(root), 2**20
    )


# --- the identity check between staging and the load -----------------------------------
def test_a_rewrite_of_the_same_size_is_seen(root: Path) -> None:
    staged = stage(root)
    rewrite_same_size(root / "ckpt" / SHARDS[1])
    assert staged.first_change() == (
        SHARDS[1],
        "rewritten or its metadata changed: new change time",
    )
    detail = rejected("CheckpointChanged", staged.check_before_load, str(root))
    assert detail == (
        f"{SHARDS[1]} changed since it was staged "
        "(rewritten or its metadata changed: new change time)"
    )
    detail = rejected("LoadFailed", staged.check_after_load)
    assert detail.startswith(f"checkpoint changed while loading: {SHARDS[1]} (")


def test_a_rewrite_with_a_new_mtime_and_a_replacement_are_named(root: Path) -> None:
    staged = stage(root)
    shard = root / "ckpt" / SHARDS[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert staged.first_change() == (SHARDS[0], "rewritten: new modification time")
    staged = stage(root)
    tmp = shard.with_name("tmp")
    tmp.write_bytes(shard.read_bytes())
    os.replace(tmp, shard)  # same bytes, a new file
    assert staged.first_change() == (SHARDS[0], "replaced by another file")
    staged = stage(root)
    with shard.open("ab") as f:
        f.write(b"\0")
    assert staged.first_change() == (SHARDS[0], f"size {st.st_size} -> {st.st_size + 1} bytes")


def test_a_new_shard_is_seen(root: Path) -> None:
    staged = stage(root)
    (root / "ckpt" / "model-00003-of-00003.safetensors").write_bytes(b"x")
    detail = rejected("CheckpointChanged", staged.check_before_load, str(root))
    assert detail == (
        "model-00003-of-00003.safetensors changed since it was staged "
        "(a new shard file the manifest does not list)"
    )


def test_a_removed_shard_is_seen(root: Path) -> None:
    staged = stage(root)
    (root / "ckpt" / SHARDS[0]).unlink()
    assert staged.first_change() == (SHARDS[0], "removed")
    assert "removed" in rejected("CheckpointChanged", staged.check_before_load, str(root))


def test_a_rewritten_manifest_is_seen(root: Path) -> None:
    staged = stage(root, 0)
    time.sleep(0.01)
    checkpoint.write_manifest(root / "ckpt")  # same content, a new file (renamed into place)
    assert staged.first_change() == (MANIFEST_FILE, "replaced by another file")
    detail = rejected("CheckpointChanged", staged.check_before_load, str(root))
    assert detail.startswith(f"{MANIFEST_FILE} changed since it was staged")


def test_a_path_that_resolves_elsewhere_is_seen(root: Path) -> None:
    make_checkpoint(root / "other", fill=2.0)
    (root / "latest").symlink_to(root / "ckpt")
    staged = checkpoint.stage_checkpoint(str(root / "latest"), str(root), 2**20)
    (root / "latest").unlink()
    (root / "latest").symlink_to(root / "other")
    detail = rejected("CheckpointChanged", staged.check_before_load, str(root))
    assert detail == f"{root / 'latest'} no longer resolves to {(root / 'ckpt').resolve()}, " + (
        "where it was staged"
    )


def test_a_change_while_staging_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest rewritten after it was read (the trainer still writing) is not staged."""
    real = staging._stage_file

    def rewrite_then_stage(path: Path, algorithm: str, hold: bool) -> object:
        if path.name == SHARDS[1]:
            checkpoint.write_manifest(root / "ckpt")
        return real(path, algorithm, hold)

    monkeypatch.setattr(staging, "_stage_file", rewrite_then_stage)
    monkeypatch.setattr(digests, "hash_workers", lambda n, cores=None: 1)
    detail = rejected("CheckpointChanged", stage, root)
    assert detail.startswith(f"{MANIFEST_FILE} changed while it was being staged")


# --- staging again --------------------------------------------------------------------------
def test_staging_the_same_unchanged_path_again_reads_nothing(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = stage(root)
    monkeypatch.setattr(staging, "_stage_file", lambda *a: pytest.fail("read again"))
    again = stage(root, previous=first)
    assert again is first and again.reused
    assert again.note().endswith("(already staged, unchanged since)")
    assert again.intact()


def test_staging_again_after_a_change_or_another_path_drops_the_previous(root: Path) -> None:
    first = stage(root)
    rewrite_same_size(root / "ckpt" / SHARDS[1])
    checkpoint.write_manifest(root / "ckpt")
    second = stage(root, previous=first)
    assert second is not first and not second.reused
    assert first.shards == {}  # released before the new one was read
    assert second.shards[SHARDS[1]] == (root / "ckpt" / SHARDS[1]).read_bytes()
    make_checkpoint(root / "other")
    third = checkpoint.stage_checkpoint(str(root / "other"), str(root), 2**20, previous=second)
    assert third.path == str(root / "other") and second.shards == {}
    # A different budget stages again (and can change where the bytes come from).
    fourth = checkpoint.stage_checkpoint(str(root / "other"), str(root), 0, previous=third)
    assert fourth is not third and fourth.mode == "disk"


def test_a_taken_checkpoint_is_staged_again(root: Path) -> None:
    first = stage(root)
    list(first.take_shards())
    second = stage(root, previous=first)
    assert second is not first and second.intact()


# --- the simulated worker -------------------------------------------------------------------
@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with worker_client.session() as session:
        yield session


async def test_simulated_stage_then_load_comes_from_memory(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    ckpt = make_sim_checkpoint(tmp_path / "B", "B")
    pods = sim_fleet(1, allowed_root=tmp_path)
    client = WorkerClient(pods[0].base_url, http=http)
    staged = await client.stage(str(ckpt))
    assert staged["staged"] == "memory"
    assert staged["budgetBytes"] == checkpoint.DEFAULT_STAGING_BUDGET
    assert staged["note"].startswith("held ") and "(staging budget 8.0 GiB)" in staged["note"]
    assert staged["path"] == str(ckpt.resolve()) and staged["files"] == 1
    assert pods[0].state()["staged"] == {"path": str(ckpt), "mode": "memory"}
    again = await client.stage(str(ckpt))
    assert again["note"].endswith("(already staged, unchanged since)")
    loaded = await client.load(str(ckpt), "B")
    assert loaded["source"] == "memory" and loaded["version"] == "B"
    assert pods[0].state()["staged"] is None  # released by the load
    assert (await client.refit_info()).weight_version == "B"
    loaded = await client.load(str(ckpt), "B2")
    assert loaded["source"] == "unstaged"
    assert pods[0].calls() == [
        "refit_stage",
        "refit_stage",
        "refit_load",
        "refit_info",
        "refit_load",
    ]


async def test_simulated_load_refuses_a_checkpoint_changed_since_staging(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    a = make_sim_checkpoint(tmp_path / "A", "A")
    b = make_sim_checkpoint(tmp_path / "B", "B")
    pods = sim_fleet(1, allowed_root=tmp_path)
    client = WorkerClient(pods[0].base_url, http=http)
    await client.stage(str(a))
    await client.load(str(a), "A")
    await client.stage(str(b))
    rewrite_same_size(b / SIM_WEIGHTS_FILE)
    with pytest.raises(WorkerError) as info:
        await client.load(str(b), "B")
    assert info.value.code == "CheckpointChanged"
    assert f"{SIM_WEIGHTS_FILE} changed since it was staged" in info.value.message
    assert (await client.refit_info()).weight_version == "A"  # the old weights serve on
    assert pods[0].state()["loaded_version"] == "A"
    assert not pods[0].state()["weights_discarded"]
    with pytest.raises(WorkerError) as info:  # staging it again: the digest now differs
        await client.stage(str(b))
    assert info.value.code == "ManifestMismatch"


async def test_simulated_budget_puts_the_load_on_disk(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    ckpt = make_sim_checkpoint(tmp_path / "B", "B")
    pods = sim_fleet(2, allowed_root=tmp_path)
    pods[0].set_state(staging_budget="16")
    pods[1].set_state(staging_budget="8 GiB")
    client = WorkerClient(pods[0].base_url, http=http)
    staged = await client.stage(str(ckpt))
    assert (staged["staged"], staged["budgetBytes"]) == ("disk", 16)
    assert "exceeds the staging budget 16 B" in staged["note"]
    assert (await client.load(str(ckpt), "B"))["source"] == "disk"
    assert (await client.refit_info()).weight_version == "B"
    with pytest.raises(WorkerError) as info:
        await WorkerClient(pods[1].base_url, http=http).stage(str(ckpt))
    assert info.value.code is None and info.value.status == 500
    assert "REFIT_STAGING_BUDGET_BYTES='8 GiB' is not a byte count" in info.value.message


async def test_simulated_stage_faults_and_restart(
    sim_fleet: Fleet, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    ckpt = make_sim_checkpoint(tmp_path / "B", "B")
    pods = sim_fleet(1, allowed_root=tmp_path)
    client = WorkerClient(pods[0].base_url, http=http)
    pods[0].set_fault("refit_stage", "error", code="CheckpointChanged", times=1)
    with pytest.raises(WorkerError) as info:
        await client.stage(str(ckpt))
    assert info.value.code == "CheckpointChanged"
    await client.stage(str(ckpt))
    assert pods[0].state()["staged"] is not None
    pods[0].crash()
    pods[0].restart()
    assert pods[0].state()["staged"] is None  # process memory
    assert (await client.load(str(ckpt), "B"))["source"] == "unstaged"
