"""`make lint` covers every Python file: each tracked module of the product, the test bed,
the tests, the benchmarks, the demo and the generators is one ruff checks and formats and
one mypy type-checks (the example scripts: ruff only, RUFF_ONLY). Ruff and mypy are asked
which files they take: an exclude in pyproject.toml, a folder the lint target does not name
or a package [tool.mypy] leaves out each hid files silently before; here they fail by name.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Ruff checks and formats these folders and mypy type-checks them.
LINTED = ("operator", "worker_image", "sdk", "testbed", "tests", "bench", "demo", "hack")
# The Python files outside them, which ruff checks too, and why mypy does not.
RUFF_ONLY = {
    "examples/trainer_loop.py": "a script, no package: [tool.mypy] takes packages or files",
    "examples/vllm_trainer_engine.py": "a script, no package: [tool.mypy] takes packages or files",
}

# Which files mypy's configuration selects, as mypy itself resolves it (pyproject.toml's
# [tool.mypy] packages, mypy_path and excludes), without type-checking anything.
_MYPY_SOURCES = """
import json, sys
from mypy.main import process_options
sources, _ = process_options([], stdout=sys.stderr, stderr=sys.stderr)
print(json.dumps([s.path for s in sources if s.path]))
"""


def _tracked() -> set[Path]:
    """Every .py file git tracks (where no git: those of the linted folders and RUFF_ONLY)."""
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py"],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        found = {p for d in LINTED for p in (REPO / d).rglob("*.py")}
        return {p.resolve() for p in found if "__pycache__" not in p.parts} | {
            (REPO / name).resolve() for name in RUFF_ONLY
        }
    paths = (REPO / name for name in proc.stdout.split("\0") if name)
    return {p.resolve() for p in paths if p.exists()}  # a deletion not yet staged: gone


def _in_linted_folders(paths: set[Path]) -> set[Path]:
    return {p for p in paths if p.relative_to(REPO).parts[0] in LINTED}


def _lint_recipe(tool: str) -> list[str]:
    """The arguments of `make lint`'s `<tool>` command line (the folders ruff is given)."""
    command = tool.split()
    in_recipe = False
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("lint:"):
            in_recipe = True
        elif in_recipe and not line.startswith("\t"):
            break
        elif in_recipe and shlex.split(line)[: len(command)] == command:
            return shlex.split(line)[len(command) :]
    raise AssertionError(f"make lint runs no `{tool}`")


def _ruff_files(args: list[str]) -> set[Path]:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {Path(line).resolve() for line in proc.stdout.splitlines() if line.strip()}


def _names(paths: set[Path]) -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in paths)


def test_every_python_file_is_in_a_linted_folder() -> None:
    """A new folder of Python code joins LINTED (and `make lint`), or RUFF_ONLY with a reason."""
    tracked = _tracked()
    outside = _names(tracked - _in_linted_folders(tracked))
    assert outside == sorted(RUFF_ONLY), f"Python outside the linted folders: {outside}"
    assert {p.relative_to(REPO).parts[0] for p in _in_linted_folders(tracked)} == set(LINTED)
    assert REPO / "sdk" / "refit_client" / "client.py" in tracked


def test_ruff_checks_and_formats_every_python_file() -> None:
    check = _lint_recipe(".venv/bin/ruff check")
    fmt = _lint_recipe(".venv/bin/ruff format --check")
    assert check == fmt, "make lint's ruff check and ruff format --check name other folders"
    missed = _tracked() - _ruff_files(check)
    assert not missed, f"ruff (as `make lint` runs it) skips: {', '.join(_names(missed))}"


def test_mypy_type_checks_every_python_file_of_the_linted_folders() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _MYPY_SOURCES],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = {Path(p).resolve() for p in json.loads(proc.stdout)}
    missed = _in_linted_folders(_tracked()) - checked
    assert not missed, (
        f"mypy's [tool.mypy] in pyproject.toml leaves out: {', '.join(_names(missed))}"
    )
