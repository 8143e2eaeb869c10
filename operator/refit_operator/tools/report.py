"""Deprecated: refit_client.report, and refit_client.grpo_report for render_grpo (the two
pictures this module drew are one module each now; refit_operator/tools/__init__.py says
why). Still runs as `python -m refit_operator.tools.report`.

Not the new module itself, as the other old paths are: one old module, two new ones. Its
names are looked up in both (the same objects)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from refit_client import grpo_report as _grpo
from refit_client import report as _report

from .moved import warn_moved

if TYPE_CHECKING:
    from refit_client.grpo_report import *  # noqa: F403
    from refit_client.report import *  # noqa: F403

warn_moved(
    __name__,
    "refit_operator.tools.report",
    "refit_client.report (render_grpo: refit_client.grpo_report)",
)


def __getattr__(name: str) -> Any:
    for module in (_report, _grpo):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(_report.main())
