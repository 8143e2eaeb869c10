"""vLLM PR #48251, MLA: ``W_UV``/``W_UK_T`` keep their storage across post-load processing.

``MLAAttention.process_weights_after_loading`` derives ``W_UV`` and ``W_UK_T`` from
``kv_b_proj``. Before the fix it registered new tensors each time, so CUDA graphs captured
before a reload kept reading the old allocations. vLLM 0.32 copies in place
(``replace_parameter(..., prefer_copy=True)``) and 0.33 always does; this module checks
that by behaviour and, where it is missing, copies the new values back into the previous
storage after the original method ran.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from refit_worker.contract import CAP_MLA_WEIGHTS_IN_PLACE

from ._patch import Outcome, State, installed_by, patch_method

BACKPORT = "mla-weights-in-place"
MODULE = "vllm.model_executor.layers.attention.mla_attention"
DERIVED = ("W_UV", "W_UK_T", "W_UK_T_dcp_qrep")

# Probe geometry: kv_lora_rank L, heads N, qk_nope P, v_head V.
_L, _N, _P, _V = 4, 2, 3, 5


def probe_layer(cls: type) -> Any:
    """An unquantized standard-MLA layer with only what post-load processing reads."""
    layer: Any = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    # A dtype other than the activation dtype, so deriving W_UV/W_UK_T copies (in the
    # same dtype they would alias kv_b_proj's storage and hide a rebinding).
    kv_b_proj = torch.nn.Linear(_L, _N * (_P + _V), bias=False, dtype=torch.bfloat16)
    kv_b_proj.weight.requires_grad_(False)  # as vLLM loads every weight
    kv_b_proj.quant_method = None  # type: ignore[assignment]
    layer.kv_b_proj = kv_b_proj
    layer.impl = SimpleNamespace(process_weights_after_loading=lambda act_dtype: None)
    for name, value in {
        "is_amx_bmm_enabled": False,
        "dcp_q_replicate": False,
        "is_aiter_triton_fp4_bmm_enabled": False,
        "is_aiter_triton_fp8_bmm_enabled": False,
        "q_pad_num_heads": None,
        "kv_lora_rank": _L,
        "num_heads": _N,
        "qk_nope_head_dim": _P,
        "v_head_dim": _V,
        "quant_config": None,
        "layer_name": "refit-probe",
    }.items():
        setattr(layer, name, value)
    for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
        layer.register_buffer(name, torch.tensor(1.0))
    return layer


def expected_weights(kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UV [N, L, V], W_UK_T [N, P, L]) as the MLA docstring defines them."""
    w = kv_b_weight.detach().float().T.reshape(_L, _N, _P + _V)
    w_uk, w_uv = w[..., :_P], w[..., _P:]
    return w_uv.transpose(0, 1), w_uk.permute(1, 2, 0)


def keeps_storage(cls: type) -> bool:
    """Two post-load passes with ``kv_b_proj`` changed in place in between (a reload):
    the derived weights must hold the new values at their first addresses."""
    layer = probe_layer(cls)
    process = cls.process_weights_after_loading  # type: ignore[attr-defined]
    process(layer, torch.float32)
    addresses = (layer.W_UV.data_ptr(), layer.W_UK_T.data_ptr())
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn_like(layer.kv_b_proj.weight))
    process(layer, torch.float32)
    w_uv, w_uk_t = expected_weights(layer.kv_b_proj.weight)
    return (
        torch.equal(layer.W_UV, w_uv)
        and torch.equal(layer.W_UK_T, w_uk_t)
        and (layer.W_UV.data_ptr(), layer.W_UK_T.data_ptr()) == addresses
    )


def _make(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(self: Any, act_dtype: torch.dtype) -> None:
        before = {name: getattr(self, name, None) for name in DERIVED}
        original(self, act_dtype)
        for name, old in before.items():
            new = getattr(self, name, None)
            if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
                continue
            if new is old or new.data_ptr() == old.data_ptr():
                continue
            same_layout = (old.shape, old.stride(), old.dtype, old.device) == (
                new.shape,
                new.stride(),
                new.dtype,
                new.device,
            )
            if not same_layout or (
                name in self._parameters and not isinstance(old, torch.nn.Parameter)
            ):
                continue  # a new geometry needs new storage (and a graph recapture)
            with torch.no_grad():
                old.copy_(new)
            setattr(self, name, old)

    return process_weights_after_loading


def apply(cls: type | None = None, *, patch_if_unknown: bool = True) -> dict[str, Outcome]:
    """``cls`` defaults to vLLM's MLAAttention (tests pass a stand-in for old code).
    ``patch_if_unknown=False`` leaves the class alone when the probe cannot run: inside
    an import hook, the probe's own lazy imports may meet half-imported vLLM modules;
    ``status()`` decides later."""
    if cls is None:
        cls = importlib.import_module(MODULE).MLAAttention
    assert cls is not None
    if installed_by(cls.__dict__.get("process_weights_after_loading")) == BACKPORT:
        return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome(State.BACKPORTED, "storage kept")}
    try:
        native = keeps_storage(cls)
    except Exception as exc:  # unknown code: the wrapper still restores the storage
        native, why = False, f"probe failed ({exc!r}); "
    else:
        why = ""
    if native:
        return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome(State.NATIVE, "copied in place")}
    if why and not patch_if_unknown:
        return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome.missing(why + "not decided yet")}
    patch_method(cls, "process_weights_after_loading", BACKPORT, _make)
    try:
        ok = keeps_storage(cls)
    except Exception as exc:
        return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome.missing(f"{why}check failed: {exc!r}")}
    if not ok:
        return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome.missing(why + "backport did not take")}
    return {CAP_MLA_WEIGHTS_IN_PLACE: Outcome(State.BACKPORTED, why + "storage kept")}
