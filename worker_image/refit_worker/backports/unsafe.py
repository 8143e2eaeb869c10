"""Configurations the backports cannot make reload-safe under full CUDA graphs.

Seed 000 lists the decode paths whose kernels take the scales as host scalars, so a graph
captured before a reload replays with the old ones: non-trtllm FlashInfer decode, DCP
decode, XQA (SM90/SM12x), the MLA trtllm decode kernels, and NVFP4 fused output. Eager
and piecewise execution are correct on all of them. ``reasons_for`` is a pure function of
plain values; ``config_from_vllm`` reads them from a live ``VllmConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WORKAROUND = "use cudagraph_mode=PIECEWISE or --enforce-eager to refit this pod"
# Backends whose decode kernels take host-scalar BMM scales (seed 000).
FLASHINFER = "FLASHINFER"
MLA_HOST_SCALE_PREFIXES = ("FLASHINFER_MLA", "TOKENSPEED_MLA")
# Quantization methods whose fused attention output is FP8 only; any other quantized
# model may fuse an NVFP4 output (o_sf_scale is a host float).
FP8_ONLY_QUANTIZATION = frozenset({"fp8", "fbgemm_fp8", "ptpc_fp8", "modelopt"})


@dataclass(frozen=True)
class GraphConfig:
    attention_backends: tuple[str, ...]  # names as AttentionBackend.get_name() gives them
    kv_cache_dtype: str  # "auto", "bfloat16", "fp8", "fp8_e4m3", "nvfp4", ...
    cudagraph_mode: str  # CUDAGraphMode name: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, ...
    enforce_eager: bool = False
    dcp_size: int = 1  # decode_context_parallel_size
    device_capability: int | None = None  # 90 for SM90, 100 for SM100; None = unknown/CPU
    trtllm_decode: bool | None = None  # head geometry accepted by trtllm decode; None=unknown
    fuse_attn_quant: bool = False
    quantization: str | None = None


def quantized_kv(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype.startswith(("fp8", "nvfp4", "int8", "fp4"))


def full_graphs(cfg: GraphConfig) -> bool:
    return not cfg.enforce_eager and "FULL" in cfg.cudagraph_mode.upper()


def reasons_for(cfg: GraphConfig) -> list[str]:
    """Human-readable reasons this configuration is not reload-safe; empty when safe."""
    if not full_graphs(cfg) or not quantized_kv(cfg.kv_cache_dtype):
        return []  # replayed graphs bake no reloadable scales in
    where = f"with kv_cache_dtype={cfg.kv_cache_dtype} under cudagraph_mode={cfg.cudagraph_mode}"
    reasons: list[str] = []
    backends = {b.upper() for b in cfg.attention_backends}
    if not backends:
        reasons.append(f"attention backend unknown {where}; cannot rule out host-scale decode")
    for backend in sorted(b for b in backends if b.startswith(MLA_HOST_SCALE_PREFIXES)):
        reasons.append(
            f"{backend}: MLA trtllm decode takes host-scalar scales; full graphs captured "
            f"before a reload keep the old k/v scales {where}"
        )
    if FLASHINFER in backends:
        reasons.extend(_flashinfer_reasons(cfg, where))
    return [f"{r} ({WORKAROUND})" for r in reasons]


def _flashinfer_reasons(cfg: GraphConfig, where: str) -> list[str]:
    reasons = []
    if cfg.dcp_size > 1:
        reasons.append(
            f"FLASHINFER: DCP decode (decode_context_parallel_size={cfg.dcp_size}) takes "
            f"host-scalar scales {where}"
        )
    cap = cfg.device_capability
    if cap is None:
        reasons.append(f"FLASHINFER: GPU architecture unknown, decode kernel undetermined {where}")
    elif cap == 90 or cap // 10 == 12:
        reasons.append(f"FLASHINFER: XQA decode (SM{cap}) takes host-scalar scales {where}")
    elif cap // 10 != 10 or cfg.trtllm_decode is False:
        reasons.append(
            f"FLASHINFER: non-trtllm decode (BatchDecodeWithPagedKVCacheWrapper, SM{cap}) "
            f"folds host-scalar scales into the graph {where}"
        )
    elif cfg.trtllm_decode is None:
        reasons.append(f"FLASHINFER: trtllm decode eligibility unknown {where}")
    if cfg.fuse_attn_quant and cfg.quantization not in (None, *FP8_ONLY_QUANTIZATION):
        reasons.append(
            f"FLASHINFER: fused NVFP4 output (quantization={cfg.quantization}) passes "
            f"o_sf_scale as a host float {where}"
        )
    return reasons


def config_from_vllm(
    vllm_config: Any,
    *,
    attention_backends: tuple[str, ...] | None = None,
    device_capability: int | None = None,
) -> GraphConfig:
    """Plain values from a VllmConfig. The backends in use and trtllm eligibility come
    from the model's attention layers where the model is built (the worker process);
    callers elsewhere may pass them."""
    layers = list(vllm_config.compilation_config.static_forward_context.values())
    backends = attention_backends
    if backends is None:
        backends = tuple(sorted({_backend_name(layer) for layer in layers} - {""}))
    if not backends:
        configured = vllm_config.attention_config.backend
        backends = (configured.name,) if configured is not None else ()
    trtllm = [
        layer.impl.supports_xqa_or_trtllm_gen_decode
        for layer in layers
        if hasattr(getattr(layer, "impl", None), "supports_xqa_or_trtllm_gen_decode")
    ]
    if device_capability is None:
        device_capability = _device_capability()
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    return GraphConfig(
        attention_backends=backends,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        cudagraph_mode=getattr(mode, "name", str(mode)),
        enforce_eager=bool(vllm_config.model_config.enforce_eager)
        if vllm_config.model_config is not None
        else False,
        dcp_size=int(vllm_config.parallel_config.decode_context_parallel_size),
        device_capability=device_capability,
        trtllm_decode=all(trtllm) if trtllm else None,
        fuse_attn_quant=bool(getattr(compilation.pass_config, "fuse_attn_quant", False)),
        quantization=vllm_config.model_config.quantization
        if vllm_config.model_config is not None
        else None,
    )


def _backend_name(layer: Any) -> str:
    get_backend = getattr(layer, "get_attn_backend", None)
    if get_backend is None:
        return ""
    try:
        return str(get_backend().get_name())
    except Exception:
        return ""


def _device_capability() -> int | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else int(capability.to_int())
