"""FlashInfer: BMM scales that follow a weight reload (vLLM's "[Bugfix][Attention] Recompute
FlashInfer BMM scales when a weight reload changes the KV scales", the BMM scales fix).

vLLM 0.32/0.33 ``FlashInferImpl.forward`` computes ``bmm1_scale``/``bmm2_scale`` (and the
fused-output factor) once, on the first forward, and never again. A reload that changes
the layer's k/v (or the next quant op's) scales then leaves every attention layer
dequantizing the FP8 KV cache with the start-up scales. The backport wraps ``forward`` and
sets those three attributes from the layer before the original code runs, so its lazy
``is None`` branches never fire:

- eager / piecewise: host floats from ``layer._q/_k/_v_scale_float`` and
  ``layer._o_scale_float`` (a few multiplies, no kernels);
- while a CUDA graph is captured for a trtllm-gen decode batch with a quantized KV cache:
  float32 device tensors computed from the ``_q_scale``/``_k_scale``/``_v_scale`` buffers
  (and the fused FP8 output scale). A reload updates those buffers in place, so a graph
  captured before the reload replays with the new scales.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refit_worker.contract import CAP_FLASHINFER_BMM_SCALES, CAP_TRTLLM_DECODE_DEVICE_SCALES

from ._patch import (
    Outcome,
    State,
    import_backend,
    installed_by,
    parameter_names,
    patch_method,
    source_of,
)

BACKPORT = "flashinfer-bmm-scales"
MODULE = "vllm.v1.attention.backends.flashinfer"
CAPABILITIES = (CAP_FLASHINFER_BMM_SCALES, CAP_TRTLLM_DECODE_DEVICE_SCALES)
# The upstream fix names its device-scale helper this way.
NATIVE_DEVICE_SCALES_METHOD = "trtllm_gen_decode_bmm_scales"
_FORWARD_PARAMETERS = (
    "self",
    "layer",
    "query",
    "key",
    "value",
    "kv_cache",
    "attn_metadata",
    "output",
    "output_scale",
    "output_block_scale",
)
_MODULE_NAMES = (
    "FP8_DTYPE",
    "FP4_DTYPE",
    "is_quantized_kv_cache",
    "FlashInferTrtllmAPIDecode",
    "FlashInferDecodeKernel",
)


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def has_lazy_scale_cache(forward: Any) -> bool:
    """Whether ``forward`` fills ``bmm1_scale``/``bmm2_scale`` only while they are None
    (the bug the BMM scales fix removes). Without readable source, assume the bug: the
    wrapper is harmless on a fixed forward."""
    source = source_of(forward)
    return (
        source is None
        or "self.bmm1_scale is None" in source
        or ("self.bmm2_scale is None" in source)
    )


def device_scales(
    impl: Any, layer: Any, output: torch.Tensor, output_scale: torch.Tensor | None, fp8: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """trtllm-gen BMM scales as float32 device tensors read from the layer's buffers."""
    bmm1 = (layer._q_scale * layer._k_scale * impl.scale).float()
    bmm2 = layer._v_scale.float()
    if output_scale is not None and output.dtype == fp8:
        bmm2 = bmm2 / output_scale.float()
    return bmm1, bmm2


def _make_forward(original: Callable[..., Any], mod: Any) -> Callable[..., Any]:
    fp8, fp4 = mod.FP8_DTYPE, mod.FP4_DTYPE
    quantized_kv = mod.is_quantized_kv_cache
    api_decode = mod.FlashInferTrtllmAPIDecode
    trtllm_gen = mod.FlashInferDecodeKernel.TRTLLM_GEN

    def forward(
        self: Any,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is not None:  # None is the profiling run
            quantized = quantized_kv(self.kv_cache_dtype)
            # Same expressions, in the same order, as the original lazy branches.
            bmm1: Any = self.scale
            bmm2: Any = 1.0
            if quantized:
                bmm1 *= layer._q_scale_float * layer._k_scale_float
                bmm2 *= layer._v_scale_float
            o_sf_scale = None
            if output_scale is not None:
                if layer._o_scale_float is None:  # reset by process_weights_after_loading
                    layer._o_scale_float = output_scale.cpu().item()
                if output.dtype == fp8:
                    bmm2 = bmm2 / layer._o_scale_float
                elif output.dtype == fp4:
                    o_sf_scale = layer._o_scale_float  # host-only: NVFP4 is not covered
            decode = attn_metadata.decode
            if (
                quantized
                and isinstance(decode, api_decode)
                and decode.kernel == trtllm_gen
                and attn_metadata.num_prefill_tokens == 0
                and getattr(self, "dcp_world_size", 1) <= 1  # DCP decode takes host scalars
                and is_capturing()
            ):
                bmm1, bmm2 = device_scales(self, layer, output, output_scale, fp8)
            self.bmm1_scale = bmm1
            self.bmm2_scale = bmm2
            self.o_sf_scale = o_sf_scale
        return original(
            self,
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale,
            output_block_scale,
        )

    return forward


def apply() -> dict[str, Outcome]:
    mod = import_backend(MODULE)
    if mod is None:
        na = Outcome(State.NOT_APPLICABLE, "flashinfer is not installed")
        return dict.fromkeys(CAPABILITIES, na)
    cls = mod.FlashInferImpl
    forward = cls.__dict__.get("forward")
    if installed_by(forward) == BACKPORT:
        done = Outcome(State.BACKPORTED, "FlashInferImpl.forward wrapped")
        return dict.fromkeys(CAPABILITIES, done)
    native_device = hasattr(cls, NATIVE_DEVICE_SCALES_METHOD)
    if forward is None or not has_lazy_scale_cache(forward):
        return {
            CAP_FLASHINFER_BMM_SCALES: Outcome(State.NATIVE, "no lazy BMM scale cache"),
            CAP_TRTLLM_DECODE_DEVICE_SCALES: (
                Outcome(State.NATIVE, f"FlashInferImpl.{NATIVE_DEVICE_SCALES_METHOD}")
                if native_device
                else Outcome.missing("forward changed upstream; no device-scale support found")
            ),
        }
    absent = [n for n in _MODULE_NAMES if not hasattr(mod, n)]
    if absent or parameter_names(forward) != _FORWARD_PARAMETERS:
        why = f"FlashInferImpl.forward differs from the backported shape (absent: {absent})"
        return dict.fromkeys(CAPABILITIES, Outcome.missing(why))
    patch_method(cls, "forward", BACKPORT, lambda original: _make_forward(original, mod))
    done = Outcome(State.BACKPORTED, "FlashInferImpl.forward wrapped")
    return dict.fromkeys(CAPABILITIES, done)
