"""The drafter's checkpoint inside the target's (contract.DRAFTER_DIR): present with a
manifest, or DrafterMissing before anything is hashed (refit_worker.drafter)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from refit_worker.contract import DRAFTER_DIR, MANIFEST_FILE, RefitRejected
from refit_worker.drafter import drafter_directory, drafter_of, method_of


def test_the_drafter_directory_needs_its_manifest(tmp_path: Path) -> None:
    with pytest.raises(RefitRejected) as refused:
        drafter_directory(tmp_path)
    assert refused.value.code == "DrafterMissing" and DRAFTER_DIR in refused.value.detail
    (tmp_path / DRAFTER_DIR).mkdir()
    with pytest.raises(RefitRejected, match="DrafterMissing"):
        drafter_directory(tmp_path)  # a directory without a manifest is no checkpoint
    (tmp_path / DRAFTER_DIR / MANIFEST_FILE).write_text("{}")
    assert drafter_directory(tmp_path) == tmp_path / DRAFTER_DIR


@pytest.mark.parametrize("method", ["", "ngram", "eagle3", "mtp"])
def test_only_draft_model_drafters_are_refitted(method: str) -> None:
    spec = SimpleNamespace(method=method, draft_model_config=object())
    cfg = SimpleNamespace(speculative_config=spec if method else None)
    runner = SimpleNamespace(get_draft_model=lambda: object())
    assert method_of(cfg) == method
    assert drafter_of(cfg, runner) is None


def test_a_runner_without_a_draft_model_refits_no_drafter() -> None:
    spec = SimpleNamespace(method="draft_model", draft_model_config=object())
    cfg = SimpleNamespace(speculative_config=spec)
    assert drafter_of(cfg, SimpleNamespace()) is None
    assert drafter_of(cfg, SimpleNamespace(get_draft_model=lambda: None)) is None
