"""The old import paths of the trainer-side SDK (refit_operator.tools.*): each module here
hands its importer the refit_client module that replaced it, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

# The release that drops refit_operator.tools (each warning names it).
REMOVED_IN = "0.2.0"


def _warn(shim: str, old: str, new: str) -> None:
    """Called by warn_moved or moved, called from the shim's body: the frames up from here are
    warn_moved's (2), the shim's (3) and the importer's (4; the import machinery's own frames
    are skipped)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in refit {REMOVED_IN}: import {new} instead",
        DeprecationWarning,
        stacklevel=3 if shim == "__main__" else 4,
    )


def warn_moved(shim: str, old: str, new: str) -> None:
    """From a shim's body (shim: its __name__): warn the import statement that loaded it, or,
    when it runs as `python -m OLD` ("__main__"), the script itself, which Python's default
    filters show."""
    _warn(shim, old, new)


def moved(shim: str, old: str, new: str) -> ModuleType:
    """From a shim's body: import `new`, warn as warn_moved does, and make `old` that same
    module (sys.modules), so its objects, private names and monkeypatching are the new
    module's. A shim run as a script stays __main__."""
    module = importlib.import_module(new)
    _warn(shim, old, new)
    if shim != "__main__":
        sys.modules[old] = module
    return module
