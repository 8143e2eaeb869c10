"""A test-only worker extension: ``--worker-extension-cls tests.worker.hazard_extension.
HazardExtension`` (the refit RPCs plus the hooks below). It lives in tests/ so no production
pod can load it; every method is a way to inject a corruption, or to observe the model,
that the tests in this directory need on a real vLLM CPU engine. Each returns a dict or a
list: /collective_rpc turns any other result into its str().
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from refit_worker import backports, peers
from refit_worker.backports import moe_reload
from refit_worker.backports._patch import original_method
from refit_worker.extension import RefitWorkerExtension


class HazardExtension(RefitWorkerExtension):
    _hazard_hooks: list[Any]
    _hazard_counts: dict[str, list[int]]

    def _hazard_attention_layers(self) -> list[Any]:
        context = self.vllm_config.compilation_config.static_forward_context
        return [layer for layer in context.values() if hasattr(layer, "_k_scale_float")]

    # --- observe ---
    def hazard_backport_states(self) -> dict[str, str]:
        return {name: outcome.state.value for name, outcome in backports.status().items()}

    def hazard_count_experts(self) -> dict[str, int]:
        """Count, from now on, how often the router picks each expert of every MoE layer
        (top-k of the gate's logits, as the experts are chosen); returns the layers hooked."""
        self.hazard_expert_counts()  # drop earlier hooks
        self._hazard_counts = {}
        model = self._refit_model()
        for name, module in model.named_modules():
            gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
            if gate is None or experts is None:
                continue
            cfg = experts.moe_config
            counts = self._hazard_counts.setdefault(name, [0] * int(cfg.num_experts))

            def count(
                _m: Any,
                _i: Any,
                out: Any,
                counts: list[int] = counts,
                k: int = cfg.experts_per_token,
            ) -> None:
                logits = out[0] if isinstance(out, tuple) else out  # (tokens, experts)
                for expert in logits.topk(k, dim=-1).indices.flatten().tolist():
                    counts[expert] += 1

            self._hazard_hooks.append(gate.register_forward_hook(count))
        return {"layers": len(self._hazard_counts)}

    def hazard_expert_counts(self) -> dict[str, list[int]]:
        """The counts since hazard_count_experts, and stop counting."""
        for hook in getattr(self, "_hazard_hooks", []):
            hook.remove()
        self._hazard_hooks = []
        return dict(getattr(self, "_hazard_counts", {}))

    # --- inject ---
    def hazard_unpatch_moe_reload(self) -> dict[str, str]:
        """Put vLLM's own UnquantizedFusedMoEMethod._setup_kernel back (the #42821 bug on
        CPU); ``backports.status()`` installs the backport again."""
        cls = importlib.import_module(moe_reload.MODULE).UnquantizedFusedMoEMethod
        cls._setup_kernel = original_method(cls, "_setup_kernel")
        return {"_setup_kernel": cls._setup_kernel.__module__}

    def hazard_set_kv_scales(self, value: float) -> dict[str, int]:
        """Set every attention layer's KV cache scales, as the kernels read them (host
        floats and device tensors): what a level-2 wake that zeroed them leaves."""
        layers = self._hazard_attention_layers()
        for layer in layers:
            layer._k_scale_float = layer._v_scale_float = value
            layer._k_scale.fill_(value)
            layer._v_scale.fill_(value)
        return {"layers": len(layers)}

    def hazard_set_sinks(self, value: float | None) -> dict[str, int]:
        """Give every attention implementation per-head sink logits (None: none), read by
        the CPU kernel as ``s_aux``: a model whose sinks are not the reference's."""
        layers = self._hazard_attention_layers()
        for layer in layers:
            impl = layer.impl
            impl.sinks = None if value is None else torch.full((impl.num_heads,), value)
        return {"layers": len(layers)}

    def hazard_stale_staged_identity(self, worker: int) -> dict[str, Any]:
        """On worker ``worker`` of the engine (refit_worker.peers.worker_index) only: record
        the staged checkpoint's first file with another size, as if that worker had staged a
        file that has changed since; its refit_load refuses CheckpointChanged, the other
        workers' checks pass. Returns {"worker": index, "changed": file name or ""}."""
        index, _count = peers.worker_index()
        staged = getattr(self, "_refit_staged", None)
        if index != worker or staged is None:
            return {"worker": index, "changed": ""}
        identity = staged.identity
        name, file = next(iter(identity.files.items()))
        files = {**identity.files, name: dataclasses.replace(file, size=file.size + 1)}
        staged.identity = dataclasses.replace(identity, files=files)
        return {"worker": index, "changed": name}
