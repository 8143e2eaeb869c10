"""Deprecated: refit_client.kubectl_plugin (refit_operator/tools/__init__.py says why); still
runs as `python -m refit_operator.tools.kubectl_plugin`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .moved import moved

if TYPE_CHECKING:
    from refit_client.kubectl_plugin import *  # noqa: F403

_new = moved(__name__, "refit_operator.tools.kubectl_plugin", "refit_client.kubectl_plugin")

if __name__ == "__main__":
    sys.exit(_new.main())
