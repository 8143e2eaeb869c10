"""The layers of the operator package, read from the imports of its source (no import runs):
the pure core takes plain data in and gives decisions out, so it imports no I/O library and
no I/O module of the package; the worker plugin imports nothing of the operator, and the
operator imports neither torch nor vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "refit_operator"
WORKER = ROOT / "worker_image" / "refit_worker"

PURE = {"api", "plan", "podflow", "probe", "reconcile", "history", "times", "views", "index",
        "traffic"}  # fmt: skip
# rounds holds no client of its own, but its coordination is asyncio's (events, timeouts):
# it sits with the engine and the runner that await it, not in the pure core.
IO_MODULES = {"cluster", "worker", "engine", "runner", "leader", "handlers", "main", "client",
              "kubectl_plugin", "report", "metrics", "rounds"}  # fmt: skip
IO_LIBRARIES = {"kubernetes", "kubernetes_asyncio", "kopf", "aiohttp", "httpx", "requests",
                "urllib3", "asyncio", "socket", "subprocess", "prometheus_client"}  # fmt: skip


def imports(path: Path) -> set[str]:
    """Top-level names this module imports: 'kopf', '.cluster' for a sibling module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from .x import y
                if node.module:
                    out.add("." + node.module.split(".")[0])
                else:
                    out |= {"." + a.name for a in node.names}
            elif node.module:
                out.add(node.module.split(".")[0])
    return out


def test_every_module_is_placed_in_a_layer() -> None:
    modules = {p.stem for p in OPERATOR.glob("*.py")} - {"__init__"}
    assert modules == PURE | IO_MODULES, "place the new module in PURE or IO_MODULES"


def test_pure_core_imports_no_io() -> None:
    bad = {}
    for name in sorted(PURE):
        found = imports(OPERATOR / f"{name}.py")
        wrong = (found & IO_LIBRARIES) | {m for m in found if m.lstrip(".") in IO_MODULES}
        if wrong:
            bad[name] = sorted(wrong)
    assert not bad, f"pure modules importing I/O: {bad}"


def test_operator_never_imports_torch_or_vllm_and_worker_never_the_operator() -> None:
    for path in OPERATOR.glob("*.py"):
        assert not imports(path) & {"torch", "vllm", "safetensors"}, path.name
    for path in WORKER.rglob("*.py"):
        assert "refit_operator" not in imports(path), path
