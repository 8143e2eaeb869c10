"""examples/trainer_loop.py's broadcast mode sends what a checkpoint would hold: the tensors
from the model in memory are the checkpoint's own, bit for bit, and the probe reference it
computes from memory is the one computed from the checkpoint's files."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from refit_worker import broadcast, reference
from transformers import AutoModelForCausalLM

from testbed.tiny_model import TinyModel

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from trainer_loop import reference_of, weights_to_send


def test_the_broadcast_mode_sends_the_checkpoints_tensors_and_reference(tiny_model: TinyModel):
    model = AutoModelForCausalLM.from_pretrained(tiny_model.checkpoints["B"], dtype=torch.float32)
    sent = weights_to_send(model)
    files = broadcast.load_tensors(tiny_model.checkpoints["B"])
    assert sorted(sent) == sorted(files)
    assert all(torch.equal(sent[k], files[k]) for k in files)
    # The promise of a broadcast of these tensors is the promise of the checkpoint's.
    assert broadcast.build_manifest(sent).digest == broadcast.build_manifest(files).digest
    texts = reference.read_texts(tiny_model.probe_texts_file)
    model.train()  # a trainer's model: scoring it must not change its mode
    ref = reference_of(model, tiny_model.base_dir, texts, "B")
    on_disk = tiny_model.reference("B")
    assert [p.token_ids for p in ref.prompts] == [p.token_ids for p in on_disk.prompts]
    worst = max(
        abs(a - b)  # type: ignore[operator]
        for got, want in zip(ref.prompts, on_disk.prompts, strict=True)
        for a, b in zip(got.logprobs[1:], want.logprobs[1:], strict=True)
    )
    assert worst < 1e-5
    assert model.training is True
