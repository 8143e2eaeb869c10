"""Tiny LoRA adapters for the tiny model (testbed/tiny_model.py), in PEFT's on-disk format
(adapter_config.json + adapter_model.safetensors), built deterministically and cached.

    ensure_tiny_adapters(tiny) -> TinyAdapters  (.dir(name), .reference(name))

Every adapter is trained-like noise on checkpoint A's attention projections (rank 8) with a
Refit manifest (refit-manifest.json, the checkpoint code) and a probe reference
(refit-probe.json) scored by HF transformers on checkpoint A with the adapter merged in, as
a trainer holding base + adapter would compute it. The variants:

    v1, v2    two good adapters (different seeds), versions "v1" and "v2"
    corrupt   v2's files with a flipped byte after the manifest was written (ManifestMismatch)
    wrong     v2's weights with v1's probe reference: verifies, loads, and fails its probe

They live under the tiny model's allowed root (adapters-<key>/<name>), so a pod's
REFIT_ALLOWED_ROOT covers them as it covers the checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from refit_worker import checkpoint, contract, reference

from testbed.tiny_model import TinyModel, build_once

BASE_CHECKPOINT = "A"  # the adapters apply to the model served at checkpoint A
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")
SEEDS = {"v1": 11, "v2": 22}
ADAPTERS = ("v1", "v2", "corrupt", "wrong")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class TinyAdapters:
    root: Path

    def dir(self, name: str) -> Path:
        return self.root / name

    def reference(self, name: str) -> contract.ProbeReference:
        doc = json.loads((self.dir(name) / contract.PROBE_FILE).read_text())
        return contract.ProbeReference.from_json_dict(doc)


def cache_key(tiny: TinyModel, base: str = BASE_CHECKPOINT) -> str:
    h = hashlib.sha256(f"{tiny.root.name}/{base}".encode())
    for module in (sys.modules[__name__], checkpoint, reference, contract):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.hexdigest()[:16]


def ensure_tiny_adapters(tiny: TinyModel, base: str = BASE_CHECKPOINT) -> TinyAdapters:
    """The cached adapters of this tiny model, built on its checkpoint ``base`` (another
    model of the test bed's shape, such as the bench's wide one, takes its own), built first
    if absent."""
    final = tiny.allowed_root / f"adapters-{cache_key(tiny, base)}"
    build_once(final, tiny.allowed_root / ".adapters.lock", lambda tmp: _build(tiny, base, tmp))
    return TinyAdapters(final)


def _lora_tensors(tiny: TinyModel, seed: int) -> dict[str, object]:
    import torch

    config = json.loads((tiny.base_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = hidden // int(config["num_attention_heads"])
    out_dims = {"q_proj": hidden, "v_proj": head_dim * int(config["num_key_value_heads"])}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, object] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(RANK, hidden, generator=gen) / hidden**0.5
            b = torch.randn(out_dims[target], RANK, generator=gen) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    return tensors


def _adapter_config(tiny: TinyModel, base: str) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(tiny.allowed_root / base),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }


def _merged_reference(
    tiny: TinyModel, base: str, tensors: dict[str, object], version: str, work: Path
) -> contract.ProbeReference:
    """The probe reference of checkpoint ``base`` with the adapter merged (W + alpha/r * B @ A)."""
    from safetensors.torch import load_file, save_file

    merged_dir = work / f"merged-{version}"
    shutil.copytree(tiny.allowed_root / base, merged_dir)
    scale = ALPHA / RANK
    for shard in checkpoint.safetensors_files(merged_dir):
        weights = load_file(str(shard))
        for name in list(weights):
            if not name.endswith(".weight"):
                continue
            prefix = "base_model.model." + name[: -len(".weight")]
            a = tensors.get(f"{prefix}.lora_A.weight")
            if a is not None:
                b = tensors[f"{prefix}.lora_B.weight"]
                weights[name] = (weights[name] + scale * (b @ a)).contiguous()  # type: ignore[operator]
        save_file(weights, str(shard), metadata={"format": "pt"})
    ref = reference.compute_reference(
        merged_dir,
        reference.read_texts(tiny.probe_texts_file),
        version=version,
        tokenizer_dir=tiny.base_dir,
        max_tokens=48,
    )
    shutil.rmtree(merged_dir)
    return ref


def _build(tiny: TinyModel, base: str, root: Path) -> None:
    from safetensors.torch import save_file

    work = root / ".work"
    work.mkdir()
    for name, seed in SEEDS.items():
        d = root / name
        d.mkdir()
        tensors = _lora_tensors(tiny, seed)
        save_file(tensors, str(d / WEIGHTS_FILE), metadata={"format": "pt"})  # type: ignore[arg-type]
        (d / CONFIG_FILE).write_text(json.dumps(_adapter_config(tiny, base), indent=1) + "\n")
        checkpoint.write_manifest(d)
        reference.write_reference(d, _merged_reference(tiny, base, tensors, name, work))
    shutil.rmtree(work)

    d = root / "corrupt"
    shutil.copytree(root / "v2", d)
    with (d / WEIGHTS_FILE).open("r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))

    d = root / "wrong"
    shutil.copytree(root / "v2", d)
    shutil.copy(root / "v1" / contract.PROBE_FILE, d / contract.PROBE_FILE)


if __name__ == "__main__":
    from testbed.tiny_model import ensure_tiny_model

    print(ensure_tiny_adapters(ensure_tiny_model()).root)
