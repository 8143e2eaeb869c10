"""Trainer-side probe reference: teacher-forced log-probabilities of fixed token ids, computed
with HF transformers on the checkpoint itself (refit-probe.json).

The pod later scores the same token ids through /v1/completions with prompt_logprobs=0, so
the reference adds nothing to the ids (no BOS beyond what the tokenizer put there) and entry
0 is None, exactly as vLLM reports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refit_worker.contract import PROBE_FILE, ProbePrompt, ProbeReference
from refit_worker.dtypes import SCORING_DTYPES


def read_texts(path: Path) -> list[str]:
    """One probe text per non-empty line."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: texts file not found")
    texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{path}: no non-empty lines (one probe text per line)")
    return texts


def tokenize(tokenizer_dir: Path, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    out = []
    for i, text in enumerate(texts):
        ids = list(tokenizer(text)["input_ids"])[:max_tokens]
        if len(ids) < 2:
            raise ValueError(f"text {i + 1} gives {len(ids)} token(s); a probe needs at least 2")
        out.append(ids)
    return out


def score(model_dir: Path, token_ids: Sequence[Sequence[int]], dtype: str) -> list[ProbePrompt]:
    """logprob of token i given tokens[:i], for every prompt; entry 0 is None."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in SCORING_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(SCORING_DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), local_files_only=True
    )
    return score_model(model, token_ids)


def score_model(model: Any, token_ids: Sequence[Sequence[int]]) -> list[ProbePrompt]:
    """``score`` with a model already in memory (a trainer's, for a broadcast refit)."""
    import torch

    was_training = model.training
    model.eval()
    prompts = []
    try:
        with torch.inference_mode():
            for ids in token_ids:
                x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
                logits = model(input_ids=x).logits[0, :-1].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                picked = logprobs.gather(1, x[0, 1:].unsqueeze(1)).squeeze(1).tolist()
                prompts.append(ProbePrompt(tuple(ids), (None, *picked)))
    finally:
        model.train(was_training)
    return prompts


def reference_from_model(
    model: Any,
    token_ids: Sequence[Sequence[int]],
    *,
    version: str,
    tool: str,
    max_tokens: int = 128,
) -> ProbeReference:
    """The reference of a model in memory (a trainer's, for a broadcast refit or a checkpoint
    it has just written): the same scoring as for a checkpoint, in fp32."""
    extra: dict[str, Any] = {"tool": tool, "maxTokens": max_tokens}
    prompts = tuple(score_model(model, [list(ids)[:max_tokens] for ids in token_ids]))
    return ProbeReference(version=version, dtype="float32", prompts=prompts, extra=extra)


def compute_reference(
    model_dir: Path,
    texts: Sequence[str],
    *,
    version: str,
    tokenizer_dir: Path | None = None,
    dtype: str = "float32",
    max_tokens: int = 128,
) -> ProbeReference:
    ids = tokenize(tokenizer_dir or model_dir, texts, max_tokens)
    extra: dict[str, Any] = {"tool": "refit reference", "maxTokens": max_tokens}
    return ProbeReference(
        version=version, dtype=dtype, prompts=tuple(score(model_dir, ids, dtype)), extra=extra
    )


def write_reference(directory: Path, reference: ProbeReference) -> Path:
    """Write refit-probe.json atomically."""
    target = directory / PROBE_FILE
    tmp = directory / f".{PROBE_FILE}.tmp"
    tmp.write_text(json.dumps(reference.to_json_dict(), indent=1) + "\n")
    os.replace(tmp, target)
    return target
