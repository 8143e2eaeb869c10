"""The tree, top down. The `refit` distribution (what the operator image and `pip install` get)
holds refit_operator, refit_worker and the trainer-side SDK refit_client, every module of
each, and nothing of what runs only from a checkout (the test bed, the demo, the benchmarks,
the generators); the operator and the SDK import only the standard library, the three
packages and their declared dependencies. The test
bed is a library the tests, the demo and the benchmarks share: it imports neither pytest nor
the tests, and neither do the demo and the benchmarks."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions, requires
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "refit_operator"
WORKER = REPO / "worker_image" / "refit_worker"
SDK = REPO / "sdk" / "refit_client"
PACKAGES = {"refit_operator", "refit_worker", "refit_client"}
CHECKOUT_ONLY = {"testbed", "demo", "bench", "hack", "tests"}


def _modules(package: Path) -> set[str]:
    return {
        p.relative_to(package.parent).as_posix()
        for p in package.rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a module (function-level ones included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_wheel_holds_the_three_packages_whole_and_nothing_else(tmp_path: Path) -> None:
    """Built as the operator image builds it: from pyproject.toml, README.md, operator/,
    worker_image/refit_worker and sdk/refit_client only (operator/Dockerfile)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "operator", src / "operator", ignore=ignore)
    shutil.copytree(WORKER, src / "worker_image" / "refit_worker", ignore=ignore)
    shutil.copytree(SDK, src / "sdk" / "refit_client", ignore=ignore)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    modules = {f for f in files if not re.match(r"refit-[^/]+\.dist-info/", f)}
    assert modules == _modules(OPERATOR) | _modules(WORKER) | _modules(SDK)


def _dist(requirement: str) -> str:
    """The normalized distribution name of a requirement ("kubernetes-asyncio>=33" ->
    "kubernetes-asyncio")."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[;( ]", requirement, maxsplit=1)[0]).lower()


def test_the_operator_and_the_sdk_import_only_their_dependencies() -> None:
    """What they import is installed by `pip install refit[report]`: a declared dependency, or
    one those bring (urllib3, with kubernetes); an integration (integrations/NAME.py, or a
    variant of it, NAME_MODE.py) may also import what its extra `refit[NAME]` brings (torch and
    transformers with trl)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def installed_with(requirements: list[str]) -> set[str]:
        declared = {_dist(r) for r in requirements}
        out = set(declared)
        for dist in declared:
            out |= {_dist(r) for r in requires(dist) or [] if "extra ==" not in r}
        return out

    base = project["dependencies"] + extras["report"]
    dists = packages_distributions()
    wrong = {}
    for path in sorted([*OPERATOR.rglob("*.py"), *SDK.rglob("*.py")]):
        family = path.stem.split("_")[0]  # trl_async.py: the trl extra
        extra = extras.get(family, []) if path.parent.name == "integrations" else []
        installed = installed_with(base + extra)
        names = _imports(path) - set(sys.stdlib_module_names) - PACKAGES
        bad = {n for n in names if not {_dist(d) for d in dists.get(n, [])} & installed}
        if bad:
            wrong[path.relative_to(REPO).as_posix()] = sorted(bad)
    assert not wrong, f"imports that are not the distribution's dependencies: {wrong}"


def test_no_package_imports_the_checkout() -> None:
    for path in sorted([*OPERATOR.rglob("*.py"), *WORKER.rglob("*.py"), *SDK.rglob("*.py")]):
        assert not _imports(path) & CHECKOUT_ONLY, path.relative_to(REPO)


def test_the_test_bed_demo_and_benches_import_neither_pytest_nor_the_tests() -> None:
    for folder in ("testbed", "demo", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            assert not _imports(path) & {"pytest", "tests"}, path.relative_to(REPO)
