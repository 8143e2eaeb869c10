"""Run a callback right after a module is first imported (or now, if it already is).

The plugin runs in every vLLM process, but most processes never import the FlashInfer
or MLA backends (the API server, or a CPU pod). Importing them only to patch them would
add seconds to every start, so each backport waits for its module instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

Hook = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader and runs the hooks once the module has executed."""

    def __init__(self, inner: Any, hooks: list[Hook]) -> None:
        self._inner = inner
        self._hooks = hooks

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for inspect
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._inner.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run(module, self._hooks)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Hook]] = {}
        self.lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with self.lock:
            hooks = self.pending.pop(fullname, None)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            logger.warning("refit: cannot hook the import of %s", fullname)
            return spec
        spec.loader = _Loader(spec.loader, hooks)
        return spec


_FINDER = _Finder()


def _run(module: ModuleType, hooks: list[Hook]) -> None:
    for hook in hooks:
        try:
            hook(module)
        except Exception:  # never break vLLM's import; the capability shows as missing
            logger.exception("refit: backport hook for %s failed", module.__name__)


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _run(module, [hook])
        return
    with _FINDER.lock:
        hooks = _FINDER.pending.setdefault(name, [])
        if hook not in hooks:  # apply_all() may run more than once before the import
            hooks.append(hook)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
