"""Deprecated: refit_client.client (refit_operator/tools/__init__.py says why)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .moved import moved

if TYPE_CHECKING:
    from refit_client.client import *  # noqa: F403

moved(__name__, "refit_operator.tools.client", "refit_client.client")
