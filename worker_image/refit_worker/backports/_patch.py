"""Shared machinery of the backports: outcomes, idempotent method patching, and the
feature probes that decide whether the installed vLLM already has a fix."""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Set on every wrapper this package installs; its value names the backport, so applying
# the same backport twice finds it and changes nothing.
MARKER = "__refit_backport__"


class State(enum.Enum):
    NATIVE = "native"  # the installed vLLM has the fix
    BACKPORTED = "backported"  # this package supplied it
    NOT_APPLICABLE = "not-applicable"  # the code path cannot run here (kernel lib absent)
    MISSING = "missing"  # neither: the capability is not in effect

    @property
    def in_effect(self) -> bool:
        return self is not State.MISSING


@dataclass(frozen=True)
class Outcome:
    state: State
    detail: str

    @classmethod
    def missing(cls, detail: str) -> Outcome:
        return cls(State.MISSING, detail)


def import_backend(name: str) -> ModuleType | None:
    """Import a vLLM backend module; None when the module, or a third-party kernel package
    it needs, is not installed (then its code path cannot be selected in this image). Any
    other import failure raises: the fix cannot be verified, so the caller fails closed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] != "vllm":
            return None
        # This vLLM has no such backend at all, so it cannot be selected either.
        if name == missing or name.startswith(missing + "."):
            return None
        raise


def source_of(func: Any) -> str | None:
    try:
        return inspect.getsource(inspect.unwrap(func))
    except (OSError, TypeError):
        return None


def parameter_names(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(func)).parameters)


def installed_by(func: Any) -> str | None:
    """The backport name that installed ``func``, or None for vLLM's own code."""
    return getattr(func, MARKER, None)


def patch_method(
    cls: type, name: str, backport: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``cls.<name>`` with ``make(original)`` unless this backport already did.
    The original stays reachable as ``wrapper.__wrapped__`` (tests compare against it)."""
    current = cls.__dict__.get(name) or getattr(cls, name, None)
    if current is None:
        raise AttributeError(f"{cls.__qualname__} has no {name}()")
    if installed_by(current) == backport:
        return
    wrapper = functools.wraps(current)(make(current))
    setattr(wrapper, MARKER, backport)
    setattr(cls, name, wrapper)


def original_method(cls: type, name: str) -> Callable[..., Any]:
    """``cls.<name>`` as vLLM shipped it, with any backport wrapper peeled off."""
    func = cls.__dict__.get(name) or getattr(cls, name)
    while installed_by(func) is not None:
        func = func.__wrapped__
    return func
