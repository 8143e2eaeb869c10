"""The error a trainer-side call raises when a refit cannot be submitted or followed: the
base of client.RefitFailed and client.RefitTimeout, and what the document builder, the
checkpoint writers and the kubeconfig loading raise, so a trainer catches one class."""

from __future__ import annotations


class RefitError(Exception):
    """The refit could not be submitted or followed; the message says why."""
