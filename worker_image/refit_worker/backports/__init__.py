"""Reload-safe attention backends: each backport is applied only where the installed vLLM
lacks the fix. (Placeholder interface; filled in by the backports work.)"""

from __future__ import annotations

from typing import Any


def apply_all() -> None:
    """Apply every backport the installed vLLM needs. Idempotent."""


def capabilities() -> list[str]:
    """Names (refit_worker.contract.CAP_*) of the reload-safety properties now in effect,
    whether vLLM has them natively or a backport supplied them."""
    return []


def unsafe_reasons(vllm_config: Any) -> list[str]:
    """Why this configuration is not reload-safe under full CUDA graphs; empty if safe."""
    return []
