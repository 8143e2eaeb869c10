"""The trainer-side `refit` tool on the tiny model's real checkpoints (HF transformers, no vLLM)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from refit_worker import cli
from refit_worker.contract import (
    MANIFEST_FILE,
    MANIFEST_FORMAT_VERSION,
    PROBE_FILE,
    Manifest,
    ProbeReference,
)

from testbed.tiny_model import TinyModel

pytestmark = pytest.mark.slow  # builds the tiny model on first use, runs HF transformers


@pytest.fixture
def ckpt_a(tiny_model: TinyModel, tmp_path: Path) -> Path:
    d = tmp_path / "step-150"
    shutil.copytree(tiny_model.checkpoints["A"], d)
    (d / MANIFEST_FILE).unlink()
    (d / PROBE_FILE).unlink()
    return d


def test_manifest_command_reproduces_the_builders_manifest(
    tiny_model: TinyModel, ckpt_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["manifest", str(ckpt_a)]) == 0
    assert capsys.readouterr().out.strip() == str(ckpt_a / MANIFEST_FILE)
    written = json.loads((ckpt_a / MANIFEST_FILE).read_text())
    original = json.loads((tiny_model.checkpoints["A"] / MANIFEST_FILE).read_text())
    assert written == original
    assert Manifest.from_json_dict(written).formatVersion == MANIFEST_FORMAT_VERSION


def test_reference_command_matches_the_fp32_reference(
    tiny_model: TinyModel, ckpt_a: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["reference", str(ckpt_a), "--texts", str(tiny_model.probe_texts_file)]
    assert cli.main([*argv, "--max-tokens", "48", "--tokenizer", str(tiny_model.base_dir)]) == 0
    assert "NLL" in capsys.readouterr().out
    doc = json.loads((ckpt_a / PROBE_FILE).read_text())
    got = ProbeReference.from_json_dict(doc)
    want = tiny_model.reference("A")
    assert got.version == "step-150"  # the directory name unless --version is given
    assert got.dtype == "float32"
    assert doc["prompts"][0]["logprobs"][0] is None
    assert [p.token_ids for p in got.prompts] == [p.token_ids for p in want.prompts]
    for g, w in zip(got.prompts, want.prompts, strict=True):
        assert abs(g.nll - w.nll) < 1e-6
        assert 2 <= len(g.token_ids) <= 48


def test_console_script_runs(ckpt_a: Path) -> None:
    script = Path(sys.executable).with_name("refit")
    out = subprocess.run(
        [str(script), "manifest", str(ckpt_a)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert (ckpt_a / MANIFEST_FILE).is_file()


def test_bad_input_is_a_clear_error_and_writes_nothing(
    tiny_model: TinyModel, ckpt_a: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def fails(argv: list[str], needle: str) -> None:
        assert cli.main(argv) == 2
        assert needle in capsys.readouterr().err

    fails(["manifest", str(tmp_path / "nope")], "no such directory")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    fails(["manifest", str(empty_dir)], "no *.safetensors files")
    assert not (empty_dir / MANIFEST_FILE).exists()
    texts = tmp_path / "texts.txt"
    texts.write_text("\n  \n")
    fails(["reference", str(ckpt_a), "--texts", str(texts)], "no non-empty lines")
    fails(["reference", str(ckpt_a), "--texts", str(tmp_path / "missing.txt")], "not found")
    texts.write_text("a\n")
    fails(["reference", str(ckpt_a), "--texts", str(texts)], "at least 2")
    fails(
        [
            "reference",
            str(ckpt_a),
            "--texts",
            str(tiny_model.probe_texts_file),
            "--max-tokens",
            "1",
        ],
        "--max-tokens",
    )
    assert not (ckpt_a / PROBE_FILE).exists()
