"""The ``vllm.general_plugins`` entry point of the refit worker image.

vLLM calls every general plugin in each of its processes (API server, engine core,
workers), possibly more than once per process. ``register`` therefore only applies the
reload-safety backports, which are idempotent; it imports nothing outside ``refit_worker``
and vLLM's own dependencies.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Apply the backports; never raise into vLLM's plugin loader.

    A backport that cannot be applied is reported as a missing capability by
    ``refit_worker.backports.capabilities()``, so the operator refuses to refit the pod:
    failing closed there is safer than crashing the server at start.
    """
    from refit_worker import backports

    try:
        backports.apply_all()
    except Exception:  # the loader would only log it; say what it means for refits
        logger.exception("refit: applying reload-safety backports failed")
