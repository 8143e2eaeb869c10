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

    def hazard_mark_process(self, dir: str) -> dict[str, int]:
        """Leave a file named for this worker's process in dir: which workers a call reached,
        seen from outside (/collective_rpc may answer for fewer than it reached)."""
        import os

        with open(os.path.join(dir, f"worker-{os.getpid()}"), "w") as f:
            f.write("reached")
        return {"pid": os.getpid()}

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

    # --- runtime skew (the read-back checksums, docs/concepts.md) ---
    _hazard_skews: list[tuple[str, str, float]]
    _hazard_originals: dict[str, Any]

    def _hazard_tensor(self, kind: str, name: str) -> Any:
        model = self._refit_model()
        named = model.named_parameters() if kind == "parameter" else model.named_buffers()
        return dict(named)[name]

    def hazard_tensor_sizes(self, kind: str) -> dict[str, int]:
        """The model's parameters, or its buffers that are not parameters: name -> elements
        (0 for a linear weight vLLM's CPU build moved into a oneDNN or SGL pack)."""
        model = self._refit_model()
        named = model.named_parameters() if kind == "parameter" else model.named_buffers()
        return {n: int(t.numel()) for n, t in named}

    def hazard_skew_after_load(self, kind: str, name: str, delta: float) -> dict[str, Any]:
        """From now on, after every load, add ``delta`` to the first element of the
        parameter or buffer ``name``, and now too: a load path that leaves one tensor of one
        pod different from what its peers hold (a skipped buffer, a post-load transform gone
        wrong). ``hazard_clear_skews`` undoes it."""
        tensor = self._hazard_tensor(kind, name)  # KeyError: no such tensor
        if tensor.numel() == 0:
            raise ValueError(f"{kind} {name} is empty: nothing to skew")
        self._hazard_originals = getattr(self, "_hazard_originals", {})
        if kind != "parameter":  # a load rewrites parameters; nothing rewrites a buffer
            self._hazard_originals.setdefault(name, tensor.detach().clone())
        self._hazard_skews = [*getattr(self, "_hazard_skews", []), (kind, name, delta)]
        self._hazard_apply_skews()
        return {"tensor": name, "dtype": str(tensor.dtype), "elements": int(tensor.numel())}

    def _hazard_apply_skews(self) -> None:
        import torch

        with torch.no_grad():
            for kind, name, delta in getattr(self, "_hazard_skews", []):
                self._hazard_tensor(kind, name).view(-1)[0] += delta

    def hazard_clear_skews(self) -> dict[str, int]:
        """Stop skewing, and put back every skewed buffer's value from before its skew (a
        parameter gets its loaded value back at the next load; a buffer, which no load
        writes, would keep the skew)."""
        import torch

        originals = getattr(self, "_hazard_originals", {})
        with torch.no_grad():
            for name, value in originals.items():
                self._hazard_tensor("buffer", name).copy_(value)
        self._hazard_skews, self._hazard_originals = [], {}
        return {"restored": len(originals)}

    def _refit_reload(self, drafter: Any = None, **source: Any) -> None:
        super()._refit_reload(drafter, **source)
        if drafter is None:  # the skews are the target's
            self._hazard_apply_skews()
