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
    try:
        register_transfer_engines()
    except Exception:  # a server that enables refit-gloo then fails at start, naming it
        logger.exception("refit: registering the refit-gloo weight transfer engine failed")


def register_transfer_engines() -> None:
    """Register refit-gloo (docs/broadcast.md) in vLLM's worker and trainer weight transfer
    factories. By module path: refit_worker.broadcast.gloo_engine and gloo_trainer are
    imported only where an engine is made. Idempotent. A trainer that uses vLLM's
    WeightTransferTrainerFactory calls it."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from refit_worker.contract import TRANSFER_BACKEND

    for factory, module, cls in (
        (
            WeightTransferEngineFactory,
            "refit_worker.broadcast.gloo_engine",
            "GlooWeightTransferEngine",
        ),
        (
            WeightTransferTrainerFactory,
            "refit_worker.broadcast.gloo_trainer",
            "GlooTrainerWeightTransferEngine",
        ),
    ):
        try:
            factory.register_engine(TRANSFER_BACKEND, module, cls)
        except ValueError:
            pass  # registered already (plugins run more than once per process)
