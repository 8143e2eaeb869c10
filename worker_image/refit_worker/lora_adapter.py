"""Whether a PEFT LoRA adapter directory fits the engine that is to serve it, judged before
vLLM loads it (refit_adapter_check: the operator asks every pod in its preflight, before any
pod leaves traffic). Pure: the adapter's config and the tensors its verified manifest lists in,
what the engine knows out (its --max-lora-rank, the modules a LoRA may target and their
sizes); a refusal is a contract.RefitRejected. Standard library only.

Each rule is one vLLM 0.32 applies when it loads an adapter (vllm/lora/worker_manager.py
_load_adapter, peft_helper.py PEFTHelper, lora_model.py from_local_checkpoint), where a
failure is an HTTP 500 (404 for a missing config) of /v1/load_lora_adapter: met inside a pod's
pass, after the pass may have taken the pod out of traffic. Checked here, the refit is refused
before any pod is touched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refit_worker.contract import ADAPTER_CONFIG_FILE, ManifestTensor, RefitRejected

# The one file of weights vLLM reads from a PEFT adapter directory when it is present (it falls
# back to adapter_model.bin or .pt, which no refit-manifest.json lists).
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix of every LoRA tensor name (vllm/lora/utils.py parse_fine_tuned_lora_name).
PEFT_PREFIX = "base_model.model."
# A module's (input features, output features) in the served model, unsharded; None where the
# engine cannot tell (the size is then not checked).
Sizes = tuple[int | None, int | None]


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json as a PEFT LoRA config vLLM takes; AdapterInvalid
    otherwise (vLLM: 404 "No adapter found" without the file, 500 for the rest)."""
    config_path = directory / ADAPTER_CONFIG_FILE
    try:
        doc = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise RefitRejected(
            "AdapterInvalid", f"{ADAPTER_CONFIG_FILE} is absent in {directory}"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RefitRejected("AdapterInvalid", f"{ADAPTER_CONFIG_FILE}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("peft_type") != "LORA":
        raise RefitRejected("AdapterInvalid", f"{ADAPTER_CONFIG_FILE}: peft_type is not LORA")
    for key in ("r", "lora_alpha", "target_modules"):  # PEFTHelper's required fields
        if key not in doc:
            raise RefitRejected("AdapterInvalid", f"{ADAPTER_CONFIG_FILE}: {key} is missing")
    if not _positive_int(doc["r"]):
        raise RefitRejected(
            "AdapterInvalid", f"{ADAPTER_CONFIG_FILE}: r={doc['r']!r} is not a rank"
        )
    pattern = doc.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(map(_positive_int, pattern.values())):
        raise RefitRejected(
            "AdapterInvalid", f"{ADAPTER_CONFIG_FILE}: rank_pattern {pattern!r} holds no ranks"
        )
    unsupported = _unsupported_features(doc)
    if unsupported:
        raise RefitRejected(
            "AdapterInvalid",
            f"{ADAPTER_CONFIG_FILE}: vLLM does not serve {', '.join(unsupported)}",
        )
    return doc


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _unsupported_features(doc: Mapping[str, Any]) -> list[str]:
    """PEFT features vLLM refuses to load (PEFTHelper._validate_features, validate_legal)."""
    found = []
    saved = doc.get("modules_to_save") or []
    if [m for m in saved if m not in ("classifier", "score")]:
        found.append(f"modules_to_save {saved!r}")
    for key, label in (("use_dora", "DoRA (use_dora)"), ("lora_bias", "LoRA bias (lora_bias)"),
                       ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
                       ("layer_replication", "layer_replication"),
                       ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
                       ("use_qalora", "QALoRA (use_qalora)")):  # fmt: skip
        if doc.get(key):
            found.append(label)
    if doc.get("bias", "none") != "none":
        found.append(f"bias={doc.get('bias')!r}")
    init = doc.get("init_lora_weights", True)
    # Inits that rewrite the base weights when PEFT loads the adapter (PiSSA, OLoRA, ...).
    if isinstance(init, str) and init.lower() not in (
        "gaussian", "eva", "orthogonal", "mica", "lora_ga",
    ):  # fmt: skip
        found.append(f"init_lora_weights={init!r}")
    return found


def adapter_rank(doc: Mapping[str, Any]) -> int:
    """The highest rank of any module (r, or rank_pattern's overrides): what vLLM holds
    against --max-lora-rank."""
    return max([doc["r"], *(doc.get("rank_pattern") or {}).values()])


def lora_module(tensor: str) -> tuple[str, str] | None:
    """(module path, "A" | "B" | "") of a PEFT LoRA tensor name, as vLLM parses it
    (parse_fine_tuned_lora_name, without a model's weights mapper); None for a name vLLM
    skips (a base layer's, saved beside the LoRA). Raises AdapterInvalid for a name vLLM
    refuses ("is unsupported LoRA weight")."""
    if tensor.endswith((".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")):
        return None
    if "base_layer" in tensor:
        return None
    name = tensor.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2][-1]
    if len(parts) >= 2 and parts[-1] in ("weight", "bias") and parts[-2] in ("score", "classifier"):
        return parts[-2], ""
    if parts[-1] in ("lora_embedding_A", "lora_embedding_B"):
        return ".".join(parts[:-1]), ""
    raise RefitRejected("AdapterInvalid", f"tensor {tensor!r} is no LoRA weight vLLM loads")


def check_adapter(
    directory: Path,
    tensors: Mapping[str, ManifestTensor],
    *,
    max_rank: int,
    modules: Mapping[str, Sizes],
) -> dict[str, Any]:
    """The adapter's rank, target modules and base model name, or the refusal:

    - AdapterInvalid: no PEFT LoRA config vLLM takes (read_adapter_config);
    - AdapterRankTooHigh: its rank (rank_pattern included) above ``max_rank``, the engine's
      --max-lora-rank (vLLM: 500 "LoRA rank N is greater than max_lora_rank M");
    - AdapterModulesUnknown: a tensor of a module that is not one the served model lets a
      LoRA target (``modules``: vLLM's expected_lora_modules, packed modules expanded; vLLM
      500 "expected target modules in ... but received ...");
    - AdapterBaseMismatch: a LoRA matrix whose size does not fit its module in the served
      model (``modules``' sizes): an adapter trained on another base model.

    ``max_rank`` 0 (no LoRA) or an empty ``modules`` (the engine cannot say) skip those rules.

    Why sizes and not base_model_name_or_path: vLLM never compares that name with what it
    serves when it loads an adapter (only its optional filesystem resolver picks adapters
    whose name equals --model exactly), and a refit fleet serves weights loaded from other
    paths or broadcast since it started (the demo's pods serve checkpoint A by broadcast while
    vLLM's model is the directory they started from): the name says nothing reliable about
    what a pod serves. What vLLM does with an adapter of another base whose module names match:
    a matrix larger than its module fails its load (a 500, inside the pass); a smaller one is
    copied into the zero-padded slot silently and serves wrong outputs, which only the probe
    after the swap would catch. So the sizes are what "fits the served model" means here; the
    name is reported (``baseModel``) and named in the refusal."""
    doc = read_adapter_config(directory)
    base = doc.get("base_model_name_or_path")
    base = base if isinstance(base, str) else ""
    trained_on = f" (trained on {base!r})" if base else ""
    rank = adapter_rank(doc)
    if max_rank > 0 and rank > max_rank:
        raise RefitRejected(
            "AdapterRankTooHigh",
            f"rank {rank} is above the engine's --max-lora-rank {max_rank}",
        )
    weights = {n: t for n, t in tensors.items() if t.file == ADAPTER_WEIGHTS_FILE}
    if not weights:
        raise RefitRejected(
            "AdapterInvalid", f"{ADAPTER_WEIGHTS_FILE} is absent or holds no tensor"
        )
    saved = set(doc.get("modules_to_save") or ())
    unknown: list[str] = []
    misfit: list[str] = []
    for tensor, meta in sorted(weights.items()):
        parsed = lora_module(tensor)
        if parsed is None or not modules:
            continue
        path, matrix = parsed
        # A fused MoE expert's LoRA is named after the part from ".experts" on.
        key = path[path.find(".experts") + 1 :] if ".experts" in path else path.rsplit(".", 1)[-1]
        if key not in modules:
            if ".experts" in path or key not in saved:
                unknown.append(path)
            continue
        fault = _size_fault(meta.shape, matrix, modules[key])
        if fault:
            misfit.append(f"{tensor} {list(meta.shape)}: {fault}")
    if unknown:
        shown = ", ".join(sorted(set(unknown))[:5])
        raise RefitRejected(
            "AdapterModulesUnknown",
            f"the served model has no LoRA-capable module {shown}{trained_on}; it takes "
            f"{', '.join(sorted(modules))}",
        )
    if misfit:
        raise RefitRejected(
            "AdapterBaseMismatch",
            f"the adapter does not fit the served model{trained_on}: "
            f"{'; '.join(misfit[:3])}{' and more' if len(misfit) > 3 else ''}",
        )
    targets = doc["target_modules"]
    return {
        "rank": rank,
        "targetModules": targets if isinstance(targets, list) else [],
        "baseModel": base,
    }


def _size_fault(shape: tuple[int, ...], matrix: str, sizes: Sizes) -> str:
    """Why a LoRA matrix does not fit its module: A is (rank, input features), B (output
    features, rank); "" when it fits or the size is unknown."""
    if len(shape) != 2 or matrix not in ("A", "B"):
        return ""
    features, which = (shape[1], 0) if matrix == "A" else (shape[0], 1)
    want = sizes[which]
    if want is None or features == want:
        return ""
    return f"{'input' if which == 0 else 'output'} features {features}, the module's {want}"
