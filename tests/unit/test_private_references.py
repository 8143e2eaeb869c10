"""Every file of the repository points only where a reader can follow: the repository's own
files, upstream issues, pull requests and source paths. The development notes and issue copies
the project was started from live outside the repository, so a path into them (a ``notes`` or
``shared`` folder) or a name of one of those issue copies ("seed 001", or its file name
``001_<16 hex digits>``) tells a reader nothing; cite the upstream issue or file instead."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {"__pycache__", "build", "node_modules"}

PRIVATE = re.compile(
    r"(?<![\w./-])(?:\.\./)*(?:notes|shared|seeds)/"  # a relative path into the folders
    r"|/work/shared/"  # the same folders by absolute path
    r"|\bseeds? #?0\d\d\b"  # an issue copy by number: seed 000, seed 001, ...
    r"|\b\d{3}_[0-9a-f]{16}\b",  # an issue copy by file name
    re.IGNORECASE,
)


def repository_files() -> dict[Path, str]:
    """The repository's text files and their text, without git's, caches, virtual environments
    and build output (hidden folders, __pycache__, build, *.egg-info) and binary files."""
    found = {}
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")
        ]
        for name in names:
            if name == ".git":
                continue  # a worktree's pointer to its repository, git's not the project's
            path = Path(folder, name)
            try:
                found[path] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # a binary file: an image, a compiled file
    return found


def test_no_file_names_a_private_note_or_issue_copy() -> None:
    files = repository_files()
    assert REPO / "docs" / "concepts.md" in files and REPO / "README.md" in files
    found = []
    for path, text in files.items():
        if path == Path(__file__).resolve():
            continue  # this file spells the patterns out
        for number, line in enumerate(text.splitlines(), 1):
            if match := PRIVATE.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}")
    assert not found, "cite upstream or the repository's docs instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "see notes/vllm-refit-facts.md",
        "(../shared/ARCHITECTURE.md)",
        "The safety invariants (shared/ARCHITECTURE.md)",
        "measured in /work/shared/notes",
        "as seed 001 showed",
        "Seeds 000",
        "000_2e68ce766afd9e10.txt",
    ],
)
def test_the_pattern_sees_a_private_reference(text: str) -> None:
    assert PRIVATE.search(text), text


@pytest.mark.parametrize(
    "text",
    [
        "python -m testbed.explorer --seed 0 --count 500",
        "Seed 10681 (short, in CI's batch too)",
        "found by the explorer (seed 181)",
        "np.random.seed(0)",
        "rng = random.Random(seed)",
        "the helm chart's shared values",
        "https://example.com/docs/shared/page",
        "docs/notes.md",
        "bench/results/HISTORY.md",
        "seeds 0–19",
    ],
)
def test_the_pattern_passes_what_is_not_one(text: str) -> None:
    assert not PRIVATE.search(text), text
