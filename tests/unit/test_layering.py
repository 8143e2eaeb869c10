"""The layers of the house, read from the imports of its source (no import runs), written as
import-linter's contracts read: each test below is one contract.

    refit_operator.tools        what users import: the trainer client, kubectl refit, reports,
                                framework integrations
    refit_operator.controller   the controller: the reconcile loop, the per-pod pass and its
                                steps, the preflight, the broadcast rounds; beside it at the top
                                level the kopf glue (handlers) and the entry point (main)
    refit_operator.edges        thin I/O edges: the Kubernetes API, the pods' HTTP, the Lease,
                                the Prometheus metrics
    refit_operator.core         the pure core: plain data in, decisions out

- layers: a module imports its own layer and the layers below it, never one above;
- independence: the tools never import the controller, nor the controller the tools (a
  trainer's process never loads the engine; the operator's image never needs a tool);
- forbidden: the core imports no I/O library; the operator imports neither torch nor vLLM; the
  worker plugin (refit_worker) imports nothing of the operator;
- acyclic: no module of either package imports another that imports it back, lazily or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "refit_operator"
WORKER = ROOT / "worker_image" / "refit_worker"

CONTROLLER = "refit_operator"  # controller/ and the top-level glue (handlers, main)
# Lowest first: a layer may import the layers before it in this tuple.
LAYERS = ("refit_operator.core", "refit_operator.edges", CONTROLLER, "refit_operator.tools")
INDEPENDENT = (CONTROLLER, "refit_operator.tools")
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


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for a package and its subpackages."""
    out = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source: at the top, inside
    functions (lazy imports) and under TYPE_CHECKING alike. An import is an edge to each module
    it names: ``from refit_worker.checkpoint import X`` to refit_worker.checkpoint, ``from
    refit_worker import checkpoint`` to refit_worker and refit_worker.checkpoint, ``from
    .digests import X`` to the sibling module. The parent packages Python initializes first
    are not edges (a package's __init__ imports its own modules for its interface)."""
    files = module_files(package_dir)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                named |= {f"{module}.{a.name}" for a in node.names} | {module}
        targets = set()
        for dotted in named:
            parts = dotted.split(".")
            for n in range(len(parts), 0, -1):  # the longest prefix that is a module
                if ".".join(parts[:n]) in files:
                    targets.add(".".join(parts[:n]))
                    break
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_among_worker_modules() -> None:
    graph = import_graph(WORKER)
    # Lazy imports count: the extension reaches the refit-gloo engine only inside a method.
    assert "refit_worker.broadcast.gloo_engine" in graph["refit_worker.extension"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_package_modules_import_their_siblings_never_their_package() -> None:
    """A package's __init__ imports its modules for its interface; a module that imported its
    own package back would see it half-initialized."""
    graph = import_graph(WORKER)
    for name, targets in graph.items():
        parent = name.rpartition(".")[0]
        if parent != "refit_worker" and name != parent:
            assert parent not in targets, f"{name} imports its own package {parent}"


TESTS = ROOT / "tests"


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/fixtures/, named for what it holds: a helper inside a
    test module is found by no one looking for it, and changing that test breaks another."""
    graph = import_graph(TESTS)
    assert "tests.fixtures.reload" in graph["tests.worker.test_reload"]  # the graph sees tests
    wrong = {}
    for name, targets in graph.items():
        if found := sorted(t for t in targets if t.rpartition(".")[2].startswith("test_")):
            wrong[name] = found
    assert not wrong, f"modules importing test modules (move what they share): {wrong}"


INTEGRATIONS = OPERATOR / "tools" / "integrations"
# What an integration may import at module level: the client it drives and the pure document
# it names refits with (refit_document), the pure reading of a pod and its records (podflow,
# podview), the standard library and httpx. Its framework and torch only inside functions
# (the operator's image has neither).
INTEGRATION_TOP_LEVEL = {"__future__", "logging", "time", "collections", "dataclasses",
                         "pathlib", "typing", "httpx", "..client", "...core",
                         "..refit_document"}  # fmt: skip


def top_level_imports(path: Path) -> set[str]:
    """``imports`` of the statements at module level only (not inside functions)."""
    module = ast.parse(path.read_text())
    top = ast.Module(body=[n for n in module.body if isinstance(n, ast.Import | ast.ImportFrom)],
                     type_ignores=[])  # fmt: skip
    out = set()
    for node in top.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or "").split(".")[0])
    return out


def test_integrations_import_their_framework_lazily() -> None:
    path = INTEGRATIONS / "trl.py"
    found = top_level_imports(path)
    assert found <= INTEGRATION_TOP_LEVEL, sorted(found - INTEGRATION_TOP_LEVEL)
    lazily = imports(path)
    assert {"torch", "transformers", "kubernetes", "refit_worker"} <= lazily
    assert "vllm" not in lazily and "trl" not in lazily  # it drives TRL, never imports it


def layer_of(module: str) -> str:
    for layer in LAYERS:
        if layer != CONTROLLER and (module == layer or module.startswith(layer + ".")):
            return layer
    return CONTROLLER


def test_the_top_level_holds_only_the_glue() -> None:
    top = {p.stem for p in OPERATOR.glob("*.py")} - {"__init__"}
    assert top == {"handlers", "main"}, (
        "a new module goes in core/ (pure), edges/ (I/O), controller/ (the reconcile loop and "
        "the per-pod pass) or tools/ (what users import)"
    )
    folders = {p.name for p in OPERATOR.iterdir() if (p / "__init__.py").is_file()}
    assert folders == {"controller", "core", "edges", "tools"}


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of a module from a layer above its own."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if t not in LAYERS and rank[layer_of(t)] > rank[layer_of(m)])  # fmt: skip


def crossing(graph: dict[str, set[str]]) -> list[str]:
    """The imports between the tools and the controller, either way."""
    pair = set(INDEPENDENT)
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if t not in LAYERS and {layer_of(m), layer_of(t)} == pair)  # fmt: skip


def test_contract_layers() -> None:
    up = upward(import_graph(OPERATOR))
    assert not up, f"imports of a higher layer: {up}"


def test_contract_tools_and_controller_are_independent() -> None:
    both = crossing(import_graph(OPERATOR))
    assert not both, f"tools and controller import each other: {both}"


def test_the_contracts_see_a_violation() -> None:
    assert layer_of("refit_operator.tools.integrations.trl") == "refit_operator.tools"
    graph = {"refit_operator.core.plan": {"refit_operator.edges.cluster"},
             "refit_operator.tools.client": {"refit_operator.controller.rounds",
                                             "refit_operator.core"},
             "refit_operator.controller.reconcile_loop": {"refit_operator.core.plan"}}  # fmt: skip
    assert upward(graph) == ["refit_operator.core.plan -> refit_operator.edges.cluster"]
    assert crossing(graph) == ["refit_operator.tools.client -> refit_operator.controller.rounds"]


def test_contract_the_core_imports_no_io() -> None:
    bad = {p.stem: sorted(imports(p) & IO_LIBRARIES) for p in (OPERATOR / "core").glob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, f"pure modules importing I/O: {bad}"


def test_contract_operator_and_worker_never_import_each_other() -> None:
    for path in OPERATOR.rglob("*.py"):
        if INTEGRATIONS not in path.parents:  # an integration loads torch in the trainer only
            assert not imports(path) & {"torch", "vllm", "safetensors"}, path
    for path in WORKER.rglob("*.py"):
        assert "refit_operator" not in imports(path), path


def test_contract_no_import_cycle_among_operator_modules() -> None:
    cycle = find_cycle(import_graph(OPERATOR))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
