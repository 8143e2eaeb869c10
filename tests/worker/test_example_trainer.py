"""What a trainer's broadcast sends (examples/trainer_loop.py and the TRL integration both use
refit_worker.broadcast.model_tensors and refit_worker.reference.reference_from_model) is what
a checkpoint would hold: the tensors from the model in memory are the checkpoint's own, bit
for bit, and the probe reference computed from memory is the one computed from the
checkpoint's files."""

from __future__ import annotations

import torch
from refit_worker import broadcast, reference
from transformers import AutoModelForCausalLM

from testbed.tiny_model import TinyModel


def test_the_broadcast_mode_sends_the_checkpoints_tensors_and_reference(tiny_model: TinyModel):
    model = AutoModelForCausalLM.from_pretrained(tiny_model.checkpoints["B"], dtype=torch.float32)
    sent = broadcast.model_tensors(model)
    files = broadcast.load_tensors(tiny_model.checkpoints["B"])
    assert sorted(sent) == sorted(files)
    assert all(torch.equal(sent[k], files[k]) for k in files)
    # The promise of a broadcast of these tensors is the promise of the checkpoint's.
    assert broadcast.build_manifest(sent).digest == broadcast.build_manifest(files).digest
    texts = reference.read_texts(tiny_model.probe_texts_file)
    model.train()  # a trainer's model: scoring it must not change its mode
    ids = reference.tokenize(tiny_model.base_dir, texts, 128)
    ref = reference.reference_from_model(model, ids, version="B", tool="test")
    on_disk = tiny_model.reference("B")
    assert [p.token_ids for p in ref.prompts] == [p.token_ids for p in on_disk.prompts]
    worst = max(
        abs(a - b)  # type: ignore[operator]
        for got, want in zip(ref.prompts, on_disk.prompts, strict=True)
        for a, b in zip(got.logprobs[1:], want.logprobs[1:], strict=True)
    )
    assert worst < 1e-5
    assert model.training is True
