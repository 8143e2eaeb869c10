"""Reload-safe attention backends: each backport is applied only where the installed vLLM
lacks the fix, and each is reported as a named capability (refit_worker.contract.CAP_*).

The fixes come from two upstream vLLM changes: the "BMM scales fix" ("[Bugfix][Attention]
Recompute FlashInfer BMM scales when a weight reload changes the KV scales") and PR #48251
("[Bugfix][Attention] Preserve post-load tensors across weight reloads"). One module per fix:
- flashinfer_scales: the BMM scales fix, FlashInfer BMM scales per forward + device scales
  while a trtllm-gen decode graph is captured;
- attention_o_scale: the BMM scales fix, ``Attention.process_weights_after_loading`` forgets
  the cached fused-output scale;
- mla_scales: the BMM scales fix, FlashInfer MLA / sparse MLA / Tokenspeed MLA scale caches;
- flashinfer_sinks, mla_weights: #48251, checked by behaviour (native in 0.32/0.33);
- moe_reload: vLLM #42821 on CPU, unquantized MoE experts prepacked again by every reload;
- unsafe: the configurations the BMM scales fix leaves uncovered under full CUDA graphs, and
  the models whose reload the backports cannot make complete (drafters, padded MoE, sinks).

A capability's state is native, backported, not-applicable (its code path cannot run
here, e.g. flashinfer is not installed) or missing; only "missing" withholds it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from refit_worker.contract import (
    CAP_ATTENTION_O_SCALE_RESET,
    CAP_FLASHINFER_BMM_SCALES,
    CAP_FLASHINFER_SINKS_IN_PLACE,
    CAP_MLA_DECODE_SCALES,
    CAP_MLA_WEIGHTS_IN_PLACE,
    CAP_MOE_RELAYOUT_ON_RELOAD,
    CAP_TRTLLM_DECODE_DEVICE_SCALES,
)

from . import (
    attention_o_scale,
    flashinfer_scales,
    flashinfer_sinks,
    mla_scales,
    mla_weights,
    moe_reload,
    unsafe,
)
from ._hooks import when_imported
from ._patch import Outcome, State

__all__ = ["Outcome", "State", "apply_all", "capabilities", "status", "unsafe_reasons"]

CAPABILITIES = (
    CAP_FLASHINFER_BMM_SCALES,
    CAP_ATTENTION_O_SCALE_RESET,
    CAP_TRTLLM_DECODE_DEVICE_SCALES,
    CAP_MLA_DECODE_SCALES,
    CAP_FLASHINFER_SINKS_IN_PLACE,
    CAP_MLA_WEIGHTS_IN_PLACE,
    CAP_MOE_RELAYOUT_ON_RELOAD,
)


def _flashinfer_rereads_scales() -> bool:
    if flashinfer_scales.MODULE not in sys.modules:
        return True  # its own hook patches forward when it is imported
    outcome = flashinfer_scales.apply()[CAP_FLASHINFER_BMM_SCALES]
    return outcome.state.in_effect


def _apply_o_scale() -> dict[str, Outcome]:
    return attention_o_scale.apply(forward_rereads_scales=_flashinfer_rereads_scales())


def _on_flashinfer(_: ModuleType) -> None:
    flashinfer_scales.apply()
    flashinfer_sinks.apply()


def _on_attention(_: ModuleType) -> None:
    _apply_o_scale()


def _on_mla_backend(module: ModuleType) -> None:
    for target in mla_scales.TARGETS:
        if target.module == module.__name__:
            mla_scales.apply_one(target)


def _on_mla_attention(_: ModuleType) -> None:
    mla_weights.apply(patch_if_unknown=False)


def _on_cpu_experts(_: ModuleType) -> None:
    # Not on vLLM's MoE method module: that one is imported while vLLM's fused_moe package
    # initialises, and the CPU experts' module (imported by vLLM only when it builds a MoE
    # layer on CPU, before the first load) cannot be imported from inside it.
    moe_reload.apply()


def apply_all() -> None:
    """Apply every backport the installed vLLM needs, each as soon as its vLLM module is
    imported (at once for modules already imported). Idempotent; never raises for one
    failed backport (``status()`` then shows it missing)."""
    when_imported(flashinfer_scales.MODULE, _on_flashinfer)
    when_imported(attention_o_scale.MODULE, _on_attention)
    for target in mla_scales.TARGETS:
        when_imported(target.module, _on_mla_backend)
    when_imported(mla_weights.MODULE, _on_mla_attention)
    when_imported(moe_reload.CPU_EXPERTS_MODULE, _on_cpu_experts)


def _guarded(fix: Callable[[], dict[str, Outcome]], names: tuple[str, ...]) -> dict[str, Any]:
    try:
        return fix()
    except Exception as exc:
        return dict.fromkeys(names, Outcome.missing(f"{exc.__class__.__name__}: {exc}"))


def status() -> dict[str, Outcome]:
    """Each capability's outcome. Imports the vLLM modules concerned (so their backports
    apply) and checks each fix; idempotent."""
    apply_all()
    importlib.import_module(attention_o_scale.MODULE)
    outcomes: dict[str, Outcome] = {}
    # FlashInfer first: whether the o-scale reset is safe depends on its forward.
    outcomes.update(_guarded(flashinfer_scales.apply, flashinfer_scales.CAPABILITIES))
    outcomes.update(_guarded(_apply_o_scale, (CAP_ATTENTION_O_SCALE_RESET,)))
    outcomes.update(_guarded(mla_scales.apply, (CAP_MLA_DECODE_SCALES,)))
    outcomes.update(_guarded(flashinfer_sinks.apply, (CAP_FLASHINFER_SINKS_IN_PLACE,)))
    outcomes.update(_guarded(mla_weights.apply, (CAP_MLA_WEIGHTS_IN_PLACE,)))
    outcomes.update(_guarded(moe_reload.apply, (CAP_MOE_RELAYOUT_ON_RELOAD,)))
    return {name: outcomes[name] for name in CAPABILITIES}


def capabilities() -> list[str]:
    """Names (refit_worker.contract.CAP_*) of the reload-safety properties now in effect,
    whether vLLM has them natively or a backport supplied them."""
    return [name for name, outcome in status().items() if outcome.state.in_effect]


def unsafe_reasons(
    vllm_config: Any,
    *,
    attention_backends: tuple[str, ...] | None = None,
    device_capability: int | None = None,
    model: Any = None,
    refitted_drafter: str = "",
) -> list[str]:
    """Why this configuration is not reload-safe: under full CUDA graphs, and (given the
    loaded ``model``) in the model itself; empty if safe. Reads the backends in use from
    the model's attention layers when not given. ``refitted_drafter``: the speculative
    method of the drafter the worker refits with its target (refit_worker.drafter), which
    is then no hazard."""
    reasons = unsafe.reasons_for(
        unsafe.config_from_vllm(
            vllm_config,
            attention_backends=attention_backends,
            device_capability=device_capability,
        )
    )
    if model is not None:
        relayout = _guarded(moe_reload.apply, (CAP_MOE_RELAYOUT_ON_RELOAD,))
        in_effect = relayout[CAP_MOE_RELAYOUT_ON_RELOAD].state.in_effect
        reasons += unsafe.model_reasons(
            unsafe.facts_from_model(
                vllm_config, model, moe_relayout=in_effect, refitted_drafter=refitted_drafter
            )
        )
    return reasons
