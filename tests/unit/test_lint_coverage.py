"""`make lint` covers every Python file of the code: each tracked module of the product, the
test bed, the tests, the benchmarks, the demo and the generators is one ruff checks and
formats and one mypy type-checks. Ruff and mypy are asked which files they take (an exclude
in pyproject.toml, a folder the lint target no longer names, a package left out of
[tool.mypy] each silently hid files before), so a file either leaves here by name or is linted.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINTED = ("operator", "worker_image", "testbed", "tests", "bench", "demo", "hack")

# Which files mypy's configuration selects, as mypy itself resolves it (pyproject.toml's
# [tool.mypy] packages, mypy_path and excludes), without type-checking anything.
_MYPY_SOURCES = """
import json, sys
from mypy.main import process_options
sources, _ = process_options([], stdout=sys.stderr, stderr=sys.stderr)
print(json.dumps([s.path for s in sources if s.path]))
"""


def _tracked() -> set[Path]:
    """The .py files of the linted folders that git tracks (untracked ones where no git)."""
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--", *(f"{d}/*.py" for d in LINTED)],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {
            p.resolve()
            for d in LINTED
            for p in (REPO / d).rglob("*.py")
            if "__pycache__" not in p.parts
        }
    return {(REPO / name).resolve() for name in proc.stdout.split("\0") if name}


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


def test_the_linted_folders_hold_python_files() -> None:
    """The check below compares against something: the folders are where the code is."""
    tracked = _tracked()
    assert {p.relative_to(REPO).parts[0] for p in tracked} == set(LINTED)
    assert REPO / "operator" / "refit_operator" / "tools" / "client.py" in tracked


def test_ruff_checks_and_formats_every_python_file() -> None:
    check = _lint_recipe(".venv/bin/ruff check")
    fmt = _lint_recipe(".venv/bin/ruff format --check")
    assert check == fmt, "make lint's ruff check and ruff format --check name other folders"
    missed = _tracked() - _ruff_files(check)
    assert not missed, f"ruff (as `make lint` runs it) skips: {', '.join(_names(missed))}"


def test_mypy_type_checks_every_python_file() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _MYPY_SOURCES],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = {Path(p).resolve() for p in json.loads(proc.stdout)}
    missed = _tracked() - checked
    assert not missed, (
        f"mypy's [tool.mypy] in pyproject.toml leaves out: {', '.join(_names(missed))}"
    )
