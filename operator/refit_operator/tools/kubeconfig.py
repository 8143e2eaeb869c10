"""Deprecated: refit_client.kubeconfig (refit_operator/tools/__init__.py says why)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .moved import moved

if TYPE_CHECKING:
    from refit_client.kubeconfig import *  # noqa: F403

moved(__name__, "refit_operator.tools.kubeconfig", "refit_client.kubeconfig")
