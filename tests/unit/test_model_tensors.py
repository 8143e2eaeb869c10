"""refit_worker.model_tensors without a model: the comparison of a checkpoint's tensors with
what a model expects, and the load rules read from a vLLM config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from refit_worker.contract import ManifestTensor, RefitRejected
from refit_worker.model_tensors import ExpectedParam, LoadRules, verify_params


def rejected(expected: dict[str, ExpectedParam]) -> str:
    with pytest.raises(RefitRejected) as info:
        verify_params(TENSORS, expected, lambda n: n == "inv_freq")
    assert info.value.code == "TensorMismatch", info.value
    return info.value.detail


TENSORS = {
    "w": ManifestTensor("f", "BF16", (4, 8)),
    "s": ManifestTensor("f", "F8_E4M3", (4,)),
    "inv_freq": ManifestTensor("f", "F32", (2,)),
}


def test_verify_params_accepts_compatible_tensors() -> None:
    expected = {"w": ExpectedParam((4, 8), "F32"), "s": ExpectedParam(None, "F8_E4M3")}
    verify_params(TENSORS, expected, ignored=lambda n: n == "inv_freq")


@pytest.mark.parametrize(
    ("expected", "needle"),
    [
        (
            {
                "w": ExpectedParam((4, 8), "F32"),
                "s": ExpectedParam((4,), "F8_E4M3"),
                "x": ExpectedParam((1,), "F32"),
            },
            "lacks x",
        ),
        ({"w": ExpectedParam((8, 4), "F32"), "s": ExpectedParam((4,), "F8_E4M3")}, "shape [4, 8]"),
        ({"w": ExpectedParam((4, 8), "F32"), "s": ExpectedParam((4,), "BF16")}, "dtype F8_E4M3"),
        ({"w": ExpectedParam((4, 8), "F32")}, "no parameter for s"),
    ],
)
def test_verify_params_refuses(expected: dict[str, ExpectedParam], needle: str) -> None:
    assert needle in rejected(expected)


def config(quantization: str | None, tie: bool | None, pp: int) -> SimpleNamespace:
    hf_config = SimpleNamespace() if tie is None else SimpleNamespace(tie_word_embeddings=tie)
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quantization, hf_config=hf_config),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
    )


def test_load_rules_from_the_vllm_config() -> None:
    assert LoadRules.of(config(None, None, 1)) == LoadRules(
        exact_shapes=True, tied=False, partial=False
    )
    assert LoadRules.of(config("fp8", True, 2)) == LoadRules(
        exact_shapes=False, tied=True, partial=True
    )
