"""What a trainer writes into a checkpoint directory before it submits a refit of it: the
manifest and the probe reference the pods check the checkpoint against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .refit_error import RefitError


def write_checkpoint_files(
    checkpoint_dir: Path,
    version: str,
    *,
    write_manifest: bool,
    reference_texts: Sequence[str] | Path | None,
    tokenizer_dir: Path | None = None,
    dtype: str = "float32",
    max_tokens: int = 128,
) -> None:
    """refit-manifest.json and refit-probe.json through refit_worker's writers (the same
    code the pods verify with). The reference is computed by HF transformers on the
    checkpoint itself: torch is imported only here."""
    if not checkpoint_dir.is_dir():
        raise RefitError(f"checkpoint directory {checkpoint_dir} does not exist")
    if write_manifest:
        from refit_worker import checkpoint

        checkpoint.write_manifest(checkpoint_dir)
    if reference_texts is not None:
        from refit_worker import reference

        texts = (
            reference.read_texts(reference_texts)
            if isinstance(reference_texts, Path)
            else list(reference_texts)
        )
        if not texts:
            raise RefitError("write_reference_texts is empty: the probe needs prompts")
        ref = reference.compute_reference(
            checkpoint_dir,
            texts,
            version=version,
            tokenizer_dir=tokenizer_dir,
            dtype=dtype,
            max_tokens=max_tokens,
        )
        reference.write_reference(checkpoint_dir, ref)
