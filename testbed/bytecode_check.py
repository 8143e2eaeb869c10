"""Fails when the venv holds no bytecode for the packages every vLLM process imports.

These machines and CI run with PYTHONDONTWRITEBYTECODE=1: nothing writes `.pyc` at run time,
so a package installed without bytecode is compiled again, in memory, by every process that
imports it (each vLLM server, engine core and worker). `hack/venv.sh` compiles the venv once;
this check (run by `hack/venv.sh` and by `tests/unit/test_bytecode.py`) holds it to that.

    python -m testbed.bytecode_check          # exit 1 and say which package lacks bytecode
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

# The heavy imports of a vLLM process. A package missing here is not checked (the operator's
# own venv in its image holds no vLLM).
PACKAGES = ("vllm", "torch", "transformers")
# A few files in vendored test folders fail to compile (Python 2 syntax); the rest must not.
MIN_SHARE = 0.95


@dataclass(frozen=True)
class Coverage:
    package: str
    sources: int
    compiled: int

    @property
    def share(self) -> float:
        return self.compiled / self.sources if self.sources else 1.0


def coverage(package: str) -> Coverage | None:
    """How many of `package`'s .py files have an up-to-date-named .pyc for this interpreter."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    sources = compiled = 0
    for src in root.rglob("*.py"):
        if {"test", "tests", "test_data"} & set(src.relative_to(root).parts[:-1]):
            continue
        sources += 1
        if Path(importlib.util.cache_from_source(str(src))).exists():
            compiled += 1
    return Coverage(package, sources, compiled)


def problems(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    found = []
    for package in packages:
        cov = coverage(package)
        if cov is not None and cov.share < MIN_SHARE:
            found.append(
                f"{package}: {cov.compiled}/{cov.sources} modules compiled "
                f"({cov.share:.0%} < {MIN_SHARE:.0%}); run `bash hack/venv.sh` again"
            )
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(f"bytecode: {line}", file=sys.stderr)
    if not found:
        print("bytecode: " + ", ".join(p for p in PACKAGES if coverage(p)) + " compiled")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
