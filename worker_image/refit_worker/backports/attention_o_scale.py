"""vLLM's BMM scales fix, fused output quant: forget the cached output scale after a (re)load.

With attention + output-quant fusion, FlashInfer keeps the next quant op's input scale as
a host float in ``layer._o_scale_float``, read once. ``Attention.process_weights_after_
loading`` (which layerwise reload calls for every attention layer) now resets it, so the
next eager forward re-reads the reloaded scale.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from refit_worker.contract import CAP_ATTENTION_O_SCALE_RESET

from ._patch import Outcome, State, installed_by, patch_method

BACKPORT = "attention-o-scale-reset"
MODULE = "vllm.model_executor.layers.attention.attention"


def resets_o_scale(process_weights_after_loading: Callable[..., Any]) -> bool:
    """Run ``process_weights_after_loading`` on a minimal unquantized layer whose output
    scale is cached, and report whether the cache was cleared."""
    probe = SimpleNamespace(
        impl=SimpleNamespace(process_weights_after_loading=lambda act_dtype: None),
        quant_config=None,
        layer_name="refit-probe",
        _o_scale_float=0.5,
        _q_scale=torch.tensor(1.0),
        _k_scale=torch.tensor(1.0),
        _v_scale=torch.tensor(1.0),
        _prob_scale=torch.tensor(1.0),
    )
    process_weights_after_loading(probe, torch.float32)
    return probe._o_scale_float is None


def _make(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(self: Any, act_dtype: torch.dtype) -> None:
        original(self, act_dtype)
        self._o_scale_float = None

    return process_weights_after_loading


def apply(*, forward_rereads_scales: bool) -> dict[str, Outcome]:
    """``forward_rereads_scales``: the FlashInfer forward in effect recomputes its BMM
    scales every call. On the lazy original, clearing the o scale would divide the cached
    ``bmm2_scale`` by it a second time, so then nothing is patched."""
    cls = importlib.import_module(MODULE).Attention
    current = cls.__dict__["process_weights_after_loading"]
    if installed_by(current) == BACKPORT:
        return {CAP_ATTENTION_O_SCALE_RESET: Outcome(State.BACKPORTED, "reset after load")}
    try:
        native = resets_o_scale(current)
    except Exception as exc:  # unknown code: the wrapper still guarantees the reset
        native, why = False, f"probe failed ({exc!r}); "
    else:
        why = ""
    if native:
        return {CAP_ATTENTION_O_SCALE_RESET: Outcome(State.NATIVE, "resets _o_scale_float")}
    if not forward_rereads_scales:
        detail = "FlashInfer still caches its BMM scales; resetting the o scale is unsafe"
        return {CAP_ATTENTION_O_SCALE_RESET: Outcome.missing(detail)}
    patch_method(cls, "process_weights_after_loading", BACKPORT, _make)
    return {CAP_ATTENTION_O_SCALE_RESET: Outcome(State.BACKPORTED, why + "reset after load")}
