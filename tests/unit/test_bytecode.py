"""The venv holds bytecode for vLLM, torch and transformers (hack/venv.sh compiles it once):
with PYTHONDONTWRITEBYTECODE=1, a venv without it makes every vLLM process compile them
again, and three servers starting together on 2 cores then outlast any start timeout."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from testbed import bytecode_check


@pytest.mark.parametrize("package", ["vllm", "torch"])
def test_the_venv_holds_bytecode_for(package: str) -> None:
    cov = bytecode_check.coverage(package)
    assert cov is not None, f"{package} is not installed in this venv"
    assert cov.sources > 100  # the real package, not a stub
    assert cov.share >= bytecode_check.MIN_SHARE, (
        f"{package}: {cov.compiled}/{cov.sources} modules compiled; run `bash hack/venv.sh`"
    )
    assert bytecode_check.problems((package,)) == []


def test_the_check_fails_on_a_package_without_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "uncompiled_pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / f).write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cov = bytecode_check.coverage("uncompiled_pkg")
    assert cov is not None and (cov.sources, cov.compiled) == (4, 0)
    (problem,) = bytecode_check.problems(("uncompiled_pkg",))
    assert "uncompiled_pkg: 0/4 modules compiled" in problem
    # Compiled, it passes: the check reads what a process would find.
    import py_compile

    for src in pkg.rglob("*.py"):
        py_compile.compile(str(src), cfile=importlib.util.cache_from_source(str(src)))
    assert bytecode_check.problems(("uncompiled_pkg",)) == []


def test_a_package_that_is_not_installed_is_not_a_problem() -> None:
    assert bytecode_check.coverage("no_such_package_here") is None
    assert bytecode_check.problems(("no_such_package_here",)) == []
