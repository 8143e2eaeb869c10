"""Configurations the backports cannot make reload-safe.

Under full CUDA graphs (``reasons_for``): vLLM's BMM scales fix ("Recompute FlashInfer BMM
scales when a weight reload changes the KV scales") lists as not covered the decode paths
whose kernels take the scales as host scalars, so a graph captured before a reload replays
with the old ones:
non-trtllm FlashInfer decode, DCP decode, XQA (SM90/SM12x), the MLA trtllm decode kernels,
and NVFP4 fused output. Eager and piecewise execution are correct on all of them.

In the model itself (``model_reasons``), from vLLM's reload trackers (RFCs #48312, #48310):
a speculative drafter with weights of its own that the worker does not refit with its target
(vLLM's reload never does, #52487; the worker refits ``draft_model`` drafters itself,
refit_worker.drafter);
MoE layers whose reload does not lay the weights out for the kernel again (#42821) or whose
padding the reload leaves uninitialized (#50523); attention sinks a model's loader writes
with a bare copy, which a layerwise reload never sees (#57795).

``reasons_for`` and ``model_reasons`` are pure functions of plain values;
``config_from_vllm`` and ``facts_from_model`` read them from a live ``VllmConfig`` / model.
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKAROUND = "use cudagraph_mode=PIECEWISE or --enforce-eager to refit this pod"
# Backends whose decode kernels take host-scalar BMM scales (the BMM scales fix).
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


# ---------------------------------------------------------------------------------------
# Hazards in the model itself (not graph-related)
# ---------------------------------------------------------------------------------------
# Speculative methods without weights of their own: nothing for a refit to miss.
WEIGHTLESS_DRAFTS = frozenset({"ngram", "ngram_gpu", "suffix"})


@dataclass(frozen=True)
class ModelFacts:
    # speculative method of a drafter with weights the worker does not refit; "" for none
    draft_method: str = ""
    moe_layers: int = 0  # MoE layers (vLLM RoutedExperts)
    moe_relayout: bool = True  # their reload lays the weights out again (#42821 fixed)
    padded_moe_layers: tuple[str, ...] = ()  # weights padded beyond the checkpoint shape
    zero_filled_rematerialization: bool = False  # vLLM's reload zero-fills (#50523 fixed)
    bare_copy_sinks: tuple[str, ...] = ()  # file:line of sink writes outside weight_loader


def model_reasons(facts: ModelFacts) -> list[str]:
    """Why a reload of this model cannot be trusted to be complete; empty when it can."""
    reasons = []
    if facts.draft_method:
        reasons.append(
            f"speculative decoding ({facts.draft_method}) has a drafter with its own weights "
            "that the refit cannot load: vLLM's reload loads only the target model "
            "(vLLM #52487) and the worker refits only draft_model drafters (from the "
            "checkpoint's drafter/), so this drafter keeps stale weights, or discarded ones "
            "after sleepLevel 2; serve without it, or with a draft_model drafter, to refit"
        )
    if facts.moe_layers and not facts.moe_relayout:
        reasons.append(
            f"{facts.moe_layers} MoE layers whose reload does not lay the weights out for "
            "the kernel again: a reload serves corrupt experts (vLLM #42821)"
        )
    if facts.padded_moe_layers and not facts.zero_filled_rematerialization:
        reasons.append(
            f"MoE weights padded beyond the checkpoint ({', '.join(facts.padded_moe_layers[:3])}"
            f"{', ...' if len(facts.padded_moe_layers) > 3 else ''}): vLLM's layerwise reload "
            "leaves the padding uninitialized (vLLM #50523)"
        )
    if facts.bare_copy_sinks:
        reasons.append(
            "attention sinks loaded with a bare copy outside weight_loader "
            f"({', '.join(facts.bare_copy_sinks)}): a reload keeps the old sinks (vLLM #57795)"
        )
    return reasons


def facts_from_model(
    vllm_config: Any, model: Any, *, moe_relayout: bool = True, refitted_drafter: str = ""
) -> ModelFacts:
    """Plain values from a live model (the worker process). ``moe_relayout``: whether the
    MoE re-layout capability is in effect (refit_worker.backports decides);
    ``refitted_drafter``: the method of the drafter the worker refits (refit_worker.drafter)."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = str(getattr(spec, "method", "") or "") if spec is not None else ""
    moe = [(n, m) for n, m in model.named_modules() if _is_moe_layer(m)]
    padded = tuple(n for n, m in moe if _padded(m.moe_config))
    sinks = [n for n, _ in model.named_parameters() if "sink" in n.rpartition(".")[2]]
    return ModelFacts(
        draft_method="" if method in WEIGHTLESS_DRAFTS or method == refitted_drafter else method,
        moe_layers=len(moe),
        moe_relayout=moe_relayout,
        padded_moe_layers=padded,
        zero_filled_rematerialization=bool(padded) and _rematerialization_zero_fills(),
        bare_copy_sinks=bare_copy_sink_sites(type(model)) if sinks else (),
    )


def _is_moe_layer(module: Any) -> bool:
    return hasattr(module, "moe_config") and hasattr(module, "w13_weight")


def _padded(moe_config: Any) -> bool:
    """Kernel padding beyond the checkpoint's sizes (rounded up at creation)."""
    hidden = getattr(moe_config, "hidden_dim_unpadded", None)
    inter = getattr(moe_config, "intermediate_size_per_partition_unpadded", None)
    return (hidden is not None and moe_config.hidden_dim != hidden) or (
        inter is not None and moe_config.intermediate_size_per_partition != inter
    )


def _rematerialization_zero_fills() -> bool:
    """vLLM #50523's fix: reload rematerializes tensors zero-filled, not uninitialized."""
    from vllm.model_executor.model_loader.reload import meta

    try:
        source = inspect.getsource(meta.materialize_meta_tensor)
    except (OSError, TypeError, AttributeError):
        return False  # cannot tell: treat the padding as uninitialized
    return "zero" in source


def bare_copy_sink_sites(model_cls: type) -> tuple[str, ...]:
    """``file:line`` of every branch on a sink name that writes with ``.copy_(`` in the
    module defining ``model_cls`` (and its bases): vLLM #57795's audit. A write through the
    parameter's weight_loader is what a layerwise reload sees; a bare copy lands on the
    meta placeholder and is lost."""
    sites: list[tuple[str, int]] = []
    for module_name in dict.fromkeys(c.__module__ for c in model_cls.__mro__):
        path = Path(getattr(sys.modules.get(module_name), "__file__", "") or "")
        if module_name.startswith("torch.") or path.suffix != ".py" or not path.is_file():
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.If) or "sink" not in (
                ast.get_source_segment(source, node.test) or ""
            ):
                continue
            for call in (c for stmt in node.body for c in ast.walk(stmt)):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "copy_":
                    sites.append((path.name, call.lineno))
    return tuple(f"{name}:{line}" for name, line in sorted(set(sites)))


def kv_cache_scales(vllm_config: Any, model: Any) -> str:
    """The quantization method whose checkpoint parameters hold the quantized KV cache's
    scales (refit_info.kv_cache_scales); "" when the KV cache is not quantized or uses
    vLLM's default scales. Those parameters live with the weights: sleep level 2 discards
    them and waking does not restore them (vLLM #57163)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    if not quantized_kv(str(vllm_config.cache_config.cache_dtype)):
        return ""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, BaseKVCacheMethod) and hasattr(module, "k_scale"):
            return str(vllm_config.model_config.quantization or type(method).__name__)
    return ""
