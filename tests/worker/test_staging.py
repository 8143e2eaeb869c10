"""Staging on a real vLLM CPU engine: refit_stage while serving, then refit_load.

Within the staging budget the load uses the bytes staging verified (source "memory"); a shard
rewritten between staging and the load is refused CheckpointChanged before the model is
touched; a partial checkpoint is refused at staging; over the budget the load reads the
files again (source "disk") and scores exactly like a load that was never staged.

The tests change checkpoint files, so this module's server gets an allowed root of its own
(copies of A and B in a temporary directory, never the shared model cache) and a staging
budget of 4 MiB: B (~3 MiB) fits, "B-padded" (B with ~3 MiB of safetensors header metadata,
the same tensors) does not. One server for the module.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from refit_worker import checkpoint

from testbed.tiny_model import TinyModel
from testbed.vllm_server import VllmServer, start_vllm_server
from tests.fixtures.reload import admin, assert_matches, rejection, scores, staged_refit, swap

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BUDGET = "4Mi"
BUDGET_BYTES = 4 * 2**20
PADDING = 3 * 2**20


def pad_headers(directory: Path) -> None:
    """Rewrite every shard with the same tensors and PADDING bytes of header metadata."""
    from safetensors.numpy import load_file, save_file

    for shard in checkpoint.safetensors_files(directory):
        tensors = load_file(str(shard))
        save_file(tensors, str(shard), metadata={"format": "pt", "padding": "x" * PADDING})
    checkpoint.write_manifest(directory)


@pytest.fixture(scope="module")
def root(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("staging-root")
    for name in ("A", "B"):
        shutil.copytree(tiny_model.checkpoints[name], root / name)
    shutil.copytree(tiny_model.checkpoints["B"], root / "B-padded")
    pad_headers(root / "B-padded")
    return root


@pytest.fixture(scope="module")
def vllm_server(tiny_model: TinyModel, root: Path) -> Iterator[VllmServer]:
    """This module's server: allowed root `root`, staging budget BUDGET."""
    env = {"REFIT_ALLOWED_ROOT": str(root), checkpoint.STAGING_BUDGET_ENV: BUDGET}
    with start_vllm_server(tiny_model, api_key="test-api-key", env=env) as server:
        yield server


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


def copy_of(root: Path, name: str, as_name: str) -> Path:
    target = root / as_name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / name, target)
    return target


def test_stage_then_load_uses_the_staged_bytes(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    staged, loaded = staged_refit(vllm_server, http, root / "A", "A")
    assert loaded["switchedLoadFormatFrom"] == "dummy"
    assert loaded["source"] == "memory"
    assert_matches(scores(vllm_server, http, tiny_model.reference("A")), tiny_model.reference("A"))

    staged = vllm_server.rpc(http, "refit_stage", str(root / "B"))
    size = sum(p.stat().st_size for p in checkpoint.safetensors_files(root / "B"))
    assert staged == {
        "path": str((root / "B").resolve()),
        "files": 2,
        "bytes": size,
        "tensors": staged["tensors"],
        "parameters": staged["parameters"],
        "shapesChecked": True,
        "tensorParallelSize": 1,
        "seconds": staged["seconds"],
        "staged": "memory",
        "budgetBytes": BUDGET_BYTES,
        "podWorkers": 1,
        "note": f"held {checkpoint.format_bytes(size)} in memory (staging budget 4.0 MiB)",
    }
    assert staged["tensors"] > 0 and staged["parameters"] > 0
    # Staging the same unchanged path again: a few stats, nothing read or hashed.
    again = vllm_server.rpc(http, "refit_stage", str(root / "B"))
    assert again["note"].endswith("(already staged, unchanged since)")
    assert {**again, "seconds": 0, "note": ""} == {**staged, "seconds": 0, "note": ""}
    # Still serving A while B is staged.
    assert_matches(scores(vllm_server, http, tiny_model.reference("A")), tiny_model.reference("A"))
    loaded = swap(vllm_server, http, str(root / "B"), "B")
    assert loaded["source"] == "memory"
    assert (loaded["version"], loaded["switchedLoadFormatFrom"]) == ("B", None)
    assert_matches(scores(vllm_server, http, tiny_model.reference("B")), tiny_model.reference("B"))
    info = vllm_server.rpc(http, "refit_info")
    assert (info["weight_version"], info["model"]) == ("B", str((root / "B").resolve()))
    # The load released what was staged: loading again is a full, unstaged load.
    assert swap(vllm_server, http, str(root / "B"), "B-again")["source"] == "unstaged"


def test_a_shard_rewritten_after_staging_is_refused_and_the_old_weights_serve(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    staged_refit(vllm_server, http, root / "A", "A")
    ref = tiny_model.reference("A")
    before = scores(vllm_server, http, ref)
    b = copy_of(root, "B", "B-rewritten")
    assert vllm_server.rpc(http, "refit_stage", str(b))["staged"] == "memory"
    shard = checkpoint.safetensors_files(b)[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, different bytes
    time.sleep(0.01)  # past the file system's timestamp granularity
    shard.write_bytes(bytes(data))
    admin(vllm_server, http, "POST", "/sleep", params={"level": 1})
    admin(vllm_server, http, "POST", "/wake_up", params={"tags": "weights"})
    code, detail = rejection(vllm_server, http, "refit_load", str(b), "B")
    admin(vllm_server, http, "POST", "/wake_up", params={"tags": "kv_cache"})
    assert code == "CheckpointChanged", detail
    assert detail.startswith(f"{shard.name} changed since it was staged ("), detail
    after = scores(vllm_server, http, ref)
    assert after == before  # untouched, bit for bit
    assert vllm_server.rpc(http, "refit_info")["weight_version"] == "A"


@pytest.mark.parametrize("damage", ["truncated", "missing", "unlisted"])
def test_a_partial_checkpoint_is_refused_at_staging(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path, damage: str
) -> None:
    staged_refit(vllm_server, http, root / "A", "A")
    ref = tiny_model.reference("A")
    before = scores(vllm_server, http, ref)
    vllm_server.rpc(http, "refit_stage", str(root / "B"))  # dropped by the refused staging
    b = copy_of(root, "B", f"B-{damage}")
    last = checkpoint.safetensors_files(b)[-1]
    if damage == "truncated":
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    elif damage == "missing":
        last.rename(last.with_name(last.name + ".partial"))
    else:
        shutil.copy(last, b / "model-00003-of-00003.safetensors")
    code, detail = rejection(vllm_server, http, "refit_stage", str(b))
    assert code == "ManifestMismatch", detail
    expected = {
        "truncated": f"{last.name} has ",
        "missing": f"{last.name} is missing",
        "unlisted": "files not in the manifest: model-00003-of-00003.safetensors",
    }[damage]
    assert detail.startswith(expected), detail
    assert scores(vllm_server, http, ref) == before
    # Staging another path dropped B: its load is a full, unstaged one.
    loaded = swap(vllm_server, http, str(root / "B"), "B")
    assert loaded["source"] == "unstaged"
    assert_matches(scores(vllm_server, http, tiny_model.reference("B")), tiny_model.reference("B"))


def test_over_the_budget_the_load_reads_the_files_and_scores_like_a_fresh_load(
    vllm_server: VllmServer, tiny_model: TinyModel, http: httpx.Client, root: Path
) -> None:
    padded = root / "B-padded"
    ref = tiny_model.reference("B")
    fresh = swap(vllm_server, http, str(padded), "B-fresh")
    assert fresh["source"] == "unstaged"
    fresh_scores = scores(vllm_server, http, ref)
    assert_matches(fresh_scores, ref)  # the padding changes no tensor
    staged_refit(vllm_server, http, root / "A", "A")
    staged = vllm_server.rpc(http, "refit_stage", str(padded))
    assert staged["bytes"] > BUDGET_BYTES
    assert (staged["staged"], staged["budgetBytes"]) == ("disk", BUDGET_BYTES)
    assert staged["note"] == (
        f"{checkpoint.format_bytes(staged['bytes'])} exceeds the staging budget 4.0 MiB: the "
        "load reads the files again after checking that none changed"
    )
    loaded = swap(vllm_server, http, str(padded), "B-padded")
    assert loaded["source"] == "disk"
    assert scores(vllm_server, http, ref) == fresh_scores
    assert vllm_server.rpc(http, "refit_info")["model"] == str(padded.resolve())
