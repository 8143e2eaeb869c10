"""A tiny Llama the tests build themselves, offline and deterministically.

Text comes from a seeded generator below (a small grammar, so a 2-layer model learns it in a
few hundred CPU steps and its NLL sits well below ln(vocab)); a byte-level BPE tokenizer is
trained on that text. Checkpoints A and B are two training steps of the same run; the broken
variants are derived from A and B. Every checkpoint directory carries refit-manifest.json and
(A, B, mixed) refit-probe.json computed by HF transformers in fp32.

Everything is cached under ~/.cache/refit/models/<hash of this file and the worker modules it
uses>/; a build happens in a temporary sibling directory renamed into place when complete, so
a crashed build never leaves a half cache. A file lock keeps concurrent sessions from
building the same model twice.

Run `python -m testbed.tiny_model` to build (or find) it and print its directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from refit_worker import checkpoint, contract, reference

CACHE_ROOT = Path(os.environ.get("REFIT_CACHE", Path.home() / ".cache" / "refit")) / "models"
VOCAB_SIZE = 2048
SEQ_LEN = 64
BATCH = 16
STEPS_A = 150
STEPS_B = 300
SEED = 1234
CHECKPOINTS = ("A", "B", "truncated", "manifest_mismatch", "wrong_shape", "half_written", "mixed")
# Which rejection code preflight must give each broken variant (the mixed one loads).
EXPECTED_REJECTION = {
    "truncated": "ManifestMismatch",
    "manifest_mismatch": "ManifestMismatch",
    "wrong_shape": "TensorMismatch",
    "half_written": "ManifestMismatch",
}
WRONG_SHAPE_TENSOR = "model.layers.1.mlp.down_proj.weight"
# Small enough that save_pretrained writes two shards (the truncated and half-written variants
# need a second shard to damage).
MAX_SHARD = "2MB"

_NOUNS = "cat dog bird fish horse tree river stone cloud city road ship king child farmer".split()
_VERBS = "sees finds likes follows carries watches builds paints remembers answers".split()
_ADJS = "red small old quiet bright heavy green tired happy strange".split()
_PLACES = "near the hill|by the sea|in the forest|under the bridge|at the market".split("|")
_SYLLABLES = "ka lo mi ren tu sha vo el dri an mor pe ix qua bel zon ti ru gal fen".split()


def _names(rng: random.Random, n: int = 600) -> list[str]:
    """Made-up proper names: enough distinct words for a ~2k-token BPE vocabulary."""
    return sorted(
        {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(n)}
    )


_NAMES = _names(random.Random(SEED))


def _sentence(rng: random.Random) -> str:
    def np_() -> str:
        return f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"

    form = rng.randrange(4)
    if form == 3:
        return f"{rng.choice(_NAMES).capitalize()} {rng.choice(_VERBS)} {np_()}."
    if form == 0:
        return f"{np_().capitalize()} {rng.choice(_VERBS)} {np_()}."
    if form == 1:
        return f"{np_().capitalize()} {rng.choice(_VERBS)} {np_()} {rng.choice(_PLACES)}."
    return f"When {np_()} sleeps, {np_()} {rng.choice(_VERBS)} {np_()}."


def corpus(n_sentences: int = 12000, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(4)) for _ in range(n_sentences // 4)]


def probe_texts() -> list[str]:
    """Held-out text (a different seed from the training corpus)."""
    return corpus(16, seed=SEED + 1)


def cache_key() -> str:
    """Hash of everything that determines the built files."""
    h = hashlib.sha256()
    for module in (sys.modules[__name__], checkpoint, reference, contract):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TinyModel:
    root: Path

    @property
    def base_dir(self) -> Path:
        """Config and tokenizer, no weights: what a --load-format dummy server starts from."""
        return self.root / "base"

    @property
    def allowed_root(self) -> Path:
        return self.root / "checkpoints"

    @property
    def checkpoints(self) -> dict[str, Path]:
        return {name: self.allowed_root / name for name in CHECKPOINTS}

    @property
    def probe_texts_file(self) -> Path:
        return self.root / "probe-texts.txt"

    def reference(self, name: str) -> contract.ProbeReference:
        doc = json.loads((self.checkpoints[name] / contract.PROBE_FILE).read_text())
        return contract.ProbeReference.from_json_dict(doc)

    @property
    def vocab_size(self) -> int:
        return int(json.loads((self.base_dir / "config.json").read_text())["vocab_size"])


def ensure_tiny_model() -> TinyModel:
    """The cached model, built first if absent."""
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    final = CACHE_ROOT / cache_key()
    build_once(final, CACHE_ROOT / ".build.lock", _build)
    return TinyModel(final)


def build_once(final: Path, lock_path: Path, build: Callable[[Path], None]) -> None:
    """Build ``final`` with ``build(tmp)`` unless complete: under a file lock, in a temporary
    directory beside it, renamed into place once marked COMPLETE."""
    if (final / "COMPLETE").is_file():
        return
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "COMPLETE").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
            try:
                build(tmp)
                (tmp / "COMPLETE").write_text("ok\n")
                if final.exists():  # an incomplete leftover of an older layout
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def _build(root: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    texts = corpus()
    base = root / "base"
    base.mkdir()

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(str(base))

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Rotary positions for a 4,096-token context: the servers run 512 unless a test asks
        # for more (tests/e2e/test_refit_under_load.py's long samples). vLLM serving past
        # this number (VLLM_ALLOW_LONG_MAX_MODEL_LEN) broke the engine for good: every later
        # scoring request had infinities in its logprobs (measured).
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.save_pretrained(str(base))

    stream: list[int] = []
    for text in texts:
        stream.extend(tok(text)["input_ids"])
    data = torch.tensor(stream, dtype=torch.long)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    ckpts = root / "checkpoints"
    ckpts.mkdir()
    model.train()
    for step in range(1, STEPS_B + 1):
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (STEPS_A, STEPS_B):
            name = "A" if step == STEPS_A else "B"
            _save(model, ckpts / name, base)
    (root / "probe-texts.txt").write_text("\n".join(probe_texts()) + "\n")
    for name in ("A", "B"):
        _finish(ckpts / name, version=name, root=root)
    _broken_variants(ckpts, base)


def _save(model: object, directory: Path, base: Path) -> None:
    model.save_pretrained(str(directory), safe_serialization=True, max_shard_size=MAX_SHARD)  # type: ignore[attr-defined]
    for f in base.iterdir():
        if f.name != "config.json":
            shutil.copy(f, directory / f.name)


def _finish(directory: Path, *, version: str, root: Path) -> None:
    checkpoint.write_manifest(directory)
    ref = reference.compute_reference(
        directory, reference.read_texts(root / "probe-texts.txt"), version=version, max_tokens=48
    )
    reference.write_reference(directory, ref)


def _shards(directory: Path) -> list[Path]:
    return checkpoint.safetensors_files(directory)


def _broken_variants(ckpts: Path, base: Path) -> None:
    from safetensors.torch import load_file, save_file

    a, b = ckpts / "A", ckpts / "B"

    # truncated: the last shard lost its tail after the manifest was written.
    d = ckpts / "truncated"
    shutil.copytree(a, d)
    last = _shards(d)[-1]
    with last.open("r+b") as f:
        f.truncate(last.stat().st_size // 2)

    # manifest_mismatch: same size, different bytes (a flipped byte near the end of a shard).
    d = ckpts / "manifest_mismatch"
    shutil.copytree(a, d)
    first = _shards(d)[0]
    with first.open("r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))

    # wrong_shape: a consistent manifest over a tensor the model cannot take.
    d = ckpts / "wrong_shape"
    shutil.copytree(a, d)
    for shard in _shards(d):
        tensors = load_file(str(shard))
        if WRONG_SHAPE_TENSOR in tensors:
            tensors[WRONG_SHAPE_TENSOR] = tensors[WRONG_SHAPE_TENSOR][:, :64].contiguous()
            save_file(tensors, str(shard), metadata={"format": "pt"})
    checkpoint.write_manifest(d)

    # half_written: the manifest lists both shards, the second is still being written.
    d = ckpts / "half_written"
    shutil.copytree(a, d)
    last = _shards(d)[-1]
    partial = last.with_name(last.name + ".partial")
    partial.write_bytes(last.read_bytes()[: last.stat().st_size // 3])
    last.unlink()

    # mixed: layer 0 from A, everything else from B, with a valid manifest and A's reference.
    d = ckpts / "mixed"
    shutil.copytree(b, d)
    a_tensors: dict[str, object] = {}
    for shard in _shards(a):
        a_tensors.update(load_file(str(shard)))
    for shard in _shards(d):
        tensors = load_file(str(shard))
        for name in tensors:
            if name.startswith("model.layers.0."):
                tensors[name] = a_tensors[name]  # type: ignore[assignment]
        save_file(tensors, str(shard), metadata={"format": "pt"})
    checkpoint.write_manifest(d)
    shutil.copy(a / contract.PROBE_FILE, d / contract.PROBE_FILE)


if __name__ == "__main__":
    print(ensure_tiny_model().root)
