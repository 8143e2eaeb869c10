"""`refit`: the trainer-side tools that prepare a checkpoint directory for a refit.

    refit manifest DIR                 write DIR/refit-manifest.json
    refit reference DIR --texts FILE   write DIR/refit-probe.json (HF transformers)

Both formats are documented in docs/formats.md. Exit status 2 with a one-line message on bad
input; nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from refit_worker import checkpoint, reference
from refit_worker.dtypes import SCORING_DTYPES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("manifest", help="write refit-manifest.json for a checkpoint directory")
    m.add_argument("dir", type=Path)
    r = sub.add_parser("reference", help="write refit-probe.json (teacher-forced logprobs)")
    r.add_argument("dir", type=Path, help="checkpoint directory (HF format, safetensors)")
    r.add_argument("--texts", type=Path, required=True, help="probe texts, one per line")
    r.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: DIR)")
    r.add_argument("--dtype", default="float32", choices=SCORING_DTYPES)
    r.add_argument("--version", help="checkpoint version (default: the directory name)")
    r.add_argument("--max-tokens", type=int, default=128, help="tokens per probe (>= 2)")
    return p


def _check_checkpoint_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    if not checkpoint.safetensors_files(directory):
        raise FileNotFoundError(f"{directory}: no *.safetensors files")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_checkpoint_dir(args.dir)
        if args.command == "manifest":
            path = checkpoint.write_manifest(args.dir)
            print(path)
            return 0
        if args.max_tokens < 2:
            raise ValueError("--max-tokens must be at least 2")
        texts = reference.read_texts(args.texts)
        ref = reference.compute_reference(
            args.dir,
            texts,
            version=args.version or args.dir.resolve().name,
            tokenizer_dir=args.tokenizer,
            dtype=args.dtype,
            max_tokens=args.max_tokens,
        )
        path = reference.write_reference(args.dir, ref)
        nlls = ", ".join(f"{p.nll:.4f}" for p in ref.prompts)
        print(f"{path} ({len(ref.prompts)} prompts, NLL {nlls})")
        return 0
    except (OSError, ValueError) as exc:
        print(f"refit {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
