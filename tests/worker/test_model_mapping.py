"""How refit_worker.model_tensors derives the checkpoint tensors a model needs (torch modules
shaped like vLLM's layers; the real Llama path runs in test_reload.py)."""

from __future__ import annotations

import pytest
import torch
from refit_worker.contract import ManifestTensor, RefitRejected
from refit_worker.model_tensors import (
    ExpectedParam,
    LoadRules,
    expected_checkpoint_tensors,
    verify_model_tensors,
)
from torch import nn


class QKV(nn.Module):
    """Like vLLM's QKVParallelLinear: one packed weight, full sizes as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.total_num_heads, self.total_num_kv_heads, self.head_size = 4, 2, 8
        self.input_size, self.output_size = 32, 64
        self.weight = nn.Parameter(torch.zeros(64, 32))


class GateUp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output_sizes = [48, 48]
        self.input_size, self.output_size = 32, 96
        self.weight = nn.Parameter(torch.zeros(96, 32))


class Vocab(nn.Module):
    """Like VocabParallelEmbedding: padded rows, and (misleadingly) input/output sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.org_vocab_size, self.embedding_dim = 100, 32
        self.input_size, self.output_size = 32, 128
        self.weight = nn.Parameter(torch.zeros(128, 32))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKV()
        self.gate_up_proj = GateUp()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))


class Model(nn.Module):
    packed_modules_mapping = {  # noqa: RUF012 (as vLLM declares it)
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.embed = Vocab()
        self.layer = Layer()


def checkpoint_tensors() -> dict[str, ManifestTensor]:
    def t(shape: tuple[int, ...], dtype: str = "BF16") -> ManifestTensor:
        return ManifestTensor("f", dtype, shape)

    return {
        "embed.weight": t((100, 32)),
        "layer.q_proj.weight": t((32, 32)),
        "layer.k_proj.weight": t((16, 32)),
        "layer.v_proj.weight": t((16, 32)),
        "layer.gate_proj.weight": t((48, 32)),
        "layer.up_proj.weight": t((48, 32)),
        "layer.norm.weight": t((32,)),
        "layer.rotary_emb.inv_freq": t((4,), "F32"),
    }


def verify(model: nn.Module, tensors: dict[str, ManifestTensor]) -> None:
    verify_model_tensors(model, tensors, LoadRules(exact_shapes=True, tied=False, partial=False))


def test_packed_and_padded_parameters_map_to_checkpoint_shapes() -> None:
    model = Model()
    expected = expected_checkpoint_tensors(model, exact_shapes=True)
    assert expected["layer.qkv_proj.weight#q"].shape == (32, 32)
    assert expected["layer.qkv_proj.weight#k"].shape == (16, 32)
    assert expected["layer.gate_up_proj.weight#1"].shape == (48, 32)
    assert expected["embed.weight"].shape == (100, 32)  # not the padded 128 rows
    assert expected["layer.norm.weight"] == ExpectedParam((32,), "BF16")
    verify(model, checkpoint_tensors())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"layer.k_proj.weight": None}, "lacks layer.qkv_proj.weight#k"),
        (
            {"layer.v_proj.weight": ManifestTensor("f", "BF16", (32, 32))},
            "layer.v_proj.weight (as layer.qkv_proj.weight#v)",
        ),
        ({"embed.weight": ManifestTensor("f", "BF16", (128, 32))}, "shape [128, 32]"),
        ({"layer.extra.weight": ManifestTensor("f", "BF16", (1,))}, "no parameter"),
        ({"layer.norm.weight": ManifestTensor("f", "I8", (32,))}, "dtype I8"),
    ],
)
def test_incompatible_checkpoints_are_refused(
    change: dict[str, ManifestTensor | None], needle: str
) -> None:
    tensors = checkpoint_tensors()
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    with pytest.raises(RefitRejected) as info:
        verify(Model(), tensors)
    assert info.value.code == "TensorMismatch"
    assert needle in info.value.detail


def test_unknown_shapes_are_not_checked_when_not_exact() -> None:
    expected = expected_checkpoint_tensors(Model(), exact_shapes=False)
    assert all(e.shape is None for e in expected.values())
