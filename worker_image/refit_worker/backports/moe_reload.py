"""vLLM #42821 on CPU: unquantized MoE experts laid out again by every reload.

``UnquantizedFusedMoEMethod._setup_kernel`` runs after every (re)load of an MoE layer. On
an update (the kernel already built) vLLM 0.32 re-converts the freshly loaded weights for
GPU backends but skips ``fused_experts.process_weights_after_loading``: the pass in which
the CPU experts pad the intermediate dimension and prepack the weights for their
grouped GEMM (``CPUUnquantizedExperts``). Layerwise reload then copies the checkpoint-layout
weights into the prepacked kernel tensors, and the MoE serves garbage with no error
(measured on the tiny Mixtral: max |Δlogprob| 9.8 against HF, tests/worker/test_moe_reload.py).

The backport runs the CPU experts' pass on updates too. It is idempotent on what a reload
hands it (fresh checkpoint-layout tensors), and only CPU experts are touched: their pass
re-lays the weights from scratch, whereas GPU experts' passes (scale folding) must not run
twice. On other platforms no CPU expert can be selected: not applicable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from refit_worker.contract import CAP_MOE_RELAYOUT_ON_RELOAD

from ._patch import Outcome, State, installed_by, patch_method

BACKPORT = "moe-relayout-on-reload"
MODULE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def relayouts_on_update(method_cls: type, experts_cls: type) -> bool:
    """Run ``_setup_kernel`` as a reload does (kernel already built) with experts of
    ``experts_cls`` whose post-load pass records its calls: is the pass run again?"""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    calls: list[Any] = []
    experts: Any = object.__new__(experts_cls)
    experts.process_weights_after_loading = calls.append  # instance attr: no kernel runs
    method: Any = object.__new__(method_cls)
    method.unquantized_backend = UnquantizedMoeBackend.CPU
    method.moe_kernel = type("Kernel", (), {"fused_experts": experts})()
    layer = torch.nn.Module()
    setattr(layer, "moe_config", None)  # noqa: B010 (the CPU backend's conversion ignores it)
    layer.w13_weight = torch.nn.Parameter(torch.zeros(1, 4, 2), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(1, 2, 2), requires_grad=False)
    method_cls._setup_kernel(method, layer, layer.w13_weight, layer.w2_weight)  # type: ignore[attr-defined]
    return bool(calls)


def _make(cpu_experts: type[Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
            update = self.moe_kernel is not None  # as vLLM decides it, before the call
            original(self, layer, w13, w2)
            experts = self.moe_kernel.fused_experts
            if update and isinstance(experts, cpu_experts):
                # Pad and prepack the reloaded weights; layerwise reload then copies
                # them into the kernel tensors the first load prepacked.
                experts.process_weights_after_loading(layer)

        return _setup_kernel

    return make


def apply() -> dict[str, Outcome]:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        na = Outcome(State.NOT_APPLICABLE, "CPU MoE experts cannot run on this platform")
        return {CAP_MOE_RELAYOUT_ON_RELOAD: na}
    cls = importlib.import_module(MODULE).UnquantizedFusedMoEMethod
    cpu_experts = importlib.import_module(CPU_EXPERTS_MODULE).CPUUnquantizedExperts
    if installed_by(cls.__dict__.get("_setup_kernel")) == BACKPORT:
        return {CAP_MOE_RELAYOUT_ON_RELOAD: Outcome(State.BACKPORTED, "relayout on update")}
    if relayouts_on_update(cls, cpu_experts):
        return {CAP_MOE_RELAYOUT_ON_RELOAD: Outcome(State.NATIVE, "relayout on update")}
    patch_method(cls, "_setup_kernel", BACKPORT, _make(cpu_experts))
    if not relayouts_on_update(cls, cpu_experts):
        return {CAP_MOE_RELAYOUT_ON_RELOAD: Outcome.missing("backport did not take")}
    return {CAP_MOE_RELAYOUT_ON_RELOAD: Outcome(State.BACKPORTED, "relayout on update")}
