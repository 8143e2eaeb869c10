"""A speculative drafter refitted together with its target (contract.DRAFTER_DIR).

vLLM's reload_weights loads into the target model only (``get_model()``; vLLM #52487), so a
``draft_model`` drafter, a whole second model with weights of its own, keeps the old ones:
on the CPU build the greedy acceptance of a drafter left on A beside a target refitted to B
falls from 1.000 to 0.461 (tests/worker/test_drafter.py), and the probe, which scores the
target, cannot see it. The worker loads the drafter itself, as vLLM's RL router loads draft
weights (``/start_draft_weight_update``, ``gpu_worker.py:1517-1546``: the load retargeted at
``get_draft_model()`` with ``speculative_config.draft_model_config``, then the layerwise
reload): vLLM's own ``reload_weights`` (``model_loader/reload/inplace.py``) on the draft
model under the draft model's config, which also runs the drafter's
``process_weights_after_loading``.

Only ``draft_model`` is refitted. Its proposer shares neither embeddings nor lm_head with
the target (``v1/spec_decode/draft_model.py``, ``_maybe_share_*``), so its checkpoint is an
ordinary checkpoint of the draft model. EAGLE, MTP, Medusa and the other heads share target
layers and load formats of their own; they stay unsafe (backports.unsafe).

No vLLM import at module level: the unit tests read this module without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit_worker.contract import DRAFTER_DIR, MANIFEST_FILE, RefitRejected

# Speculative methods whose drafter the worker loads from the checkpoint's DRAFTER_DIR.
REFITTED_METHODS = frozenset({"draft_model"})


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's view of the server's vLLM config: exactly what vLLM's reload_weights
    (model_config, load_config, lora_config) and model_tensors.LoadRules.of (model_config,
    parallel_config) read. Not a VllmConfig: rebuilding one re-runs its validation and
    post-init (compilation, platform checks) on a live engine, for four attributes."""

    model_config: Any
    load_config: Any
    parallel_config: Any
    lora_config: Any = None


@dataclass(frozen=True)
class Drafter:
    """A drafter this worker refits: its speculative method, its model, its config."""

    method: str
    model: Any
    config: DrafterConfig


def method_of(vllm_config: Any) -> str:
    """The engine's speculative method ("" without speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return str(getattr(spec, "method", "") or "") if spec is not None else ""


def drafter_of(vllm_config: Any, model_runner: Any) -> Drafter | None:
    """The drafter this worker refits with its target, or None: no speculative decoding, a
    method it does not refit (backports.unsafe names those), or a runner that exposes no
    draft model (both of vLLM 0.32's runners have get_draft_model)."""
    method = method_of(vllm_config)
    if method not in REFITTED_METHODS:
        return None
    get_draft_model = getattr(model_runner, "get_draft_model", None)
    model = get_draft_model() if callable(get_draft_model) else None
    spec = vllm_config.speculative_config
    if model is None or spec.draft_model_config is None:
        return None
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    config = DrafterConfig(
        model_config=spec.draft_model_config,
        # The load config the drafter was built with (speculative_config.draft_load_config,
        # else the target's): read at each call, after a --load-format dummy switch.
        load_config=get_draft_load_config(vllm_config),
        parallel_config=spec.draft_parallel_config,
        lora_config=getattr(vllm_config, "lora_config", None),
    )
    return Drafter(method=method, model=model, config=config)


def drafter_directory(directory: Path) -> Path:
    """The drafter's checkpoint inside the target's `directory`; DrafterMissing when there is
    no DRAFTER_DIR holding a manifest. Checked before anything is hashed or loaded: a
    refit that cannot load the drafter must not load the target either."""
    sub = directory / DRAFTER_DIR
    if not (sub / MANIFEST_FILE).is_file():
        raise RefitRejected(
            "DrafterMissing",
            f"this engine runs a draft_model drafter and {directory} has no {DRAFTER_DIR}/ "
            f"with a {MANIFEST_FILE}: write the drafter's checkpoint there, or the target "
            "would serve beside a stale drafter",
        )
    return sub


def reload_drafter(vllm_config: Any, drafter: Drafter, **source: Any) -> None:
    """Load the drafter's weights in place from `source` (weights_iterator= or
    weights_path=), as vLLM reloads the target: its layerwise reload, then the drafter's
    post-load processing. Runs under the engine's config, as vLLM's own draft weight
    update does (start_draft_weight_update sets the worker's)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    source.setdefault("weights_iterator", None)
    source.setdefault("weights_path", None)
    with set_current_vllm_config(vllm_config):
        reload_weights(drafter.config, drafter.model, is_checkpoint_format=True, **source)  # type: ignore[arg-type]
