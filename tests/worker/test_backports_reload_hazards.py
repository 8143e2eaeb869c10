"""Reload hazards beyond attention scales, judged on vLLM's real classes (no server):
the MoE re-layout backport (#42821 on CPU), and the model facts behind the unsafe reasons
(drafters #52487, padded MoE #50523, sinks written outside weight_loader #57795) and
refit_info.kv_cache_scales (#57163). tests/worker/test_moe_reload.py runs the backport on a
real engine; docs/concepts.md has the table.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from refit_worker import backports
from refit_worker.backports import moe_reload, unsafe
from refit_worker.backports._patch import State, original_method
from refit_worker.backports.unsafe import ModelFacts, facts_from_model, model_reasons
from refit_worker.contract import CAP_MOE_RELAYOUT_ON_RELOAD
from torch import nn


@pytest.fixture
def moe_method() -> Iterator[type]:
    """vLLM's UnquantizedFusedMoEMethod, put back as vLLM ships it afterwards."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod as cls,
    )

    vllm_own = original_method(cls, "_setup_kernel")
    yield cls
    cls._setup_kernel = vllm_own  # type: ignore[method-assign]


def test_vllm_032_skips_the_cpu_prepack_on_reload_and_the_backport_adds_it(
    moe_method: type,
) -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    vllm_own = original_method(moe_method, "_setup_kernel")
    moe_method._setup_kernel = vllm_own  # type: ignore[attr-defined]
    assert not moe_reload.relayouts_on_update(moe_method, CPUUnquantizedExperts)
    outcome = moe_reload.apply()[CAP_MOE_RELAYOUT_ON_RELOAD]
    assert outcome.state is State.BACKPORTED
    assert moe_reload.relayouts_on_update(moe_method, CPUUnquantizedExperts)
    assert moe_reload.apply()[CAP_MOE_RELAYOUT_ON_RELOAD].state is State.BACKPORTED  # idempotent
    assert backports.status()[CAP_MOE_RELAYOUT_ON_RELOAD].state is State.BACKPORTED
    assert CAP_MOE_RELAYOUT_ON_RELOAD in backports.capabilities()


def test_the_backport_leaves_other_experts_alone(moe_method: type) -> None:
    """GPU experts' post-load passes fold scales: running them twice would be wrong."""

    class OtherExperts:
        pass

    moe_reload.apply()
    assert not moe_reload.relayouts_on_update(moe_method, OtherExperts)


@pytest.mark.parametrize(
    ("facts", "fragments"),
    [
        (ModelFacts(), []),
        (ModelFacts(draft_method="eagle3"), ["(eagle3)", "#52487"]),
        (ModelFacts(moe_layers=2), []),
        (ModelFacts(moe_layers=2, moe_relayout=False), ["2 MoE layers", "#42821"]),
        (ModelFacts(padded_moe_layers=("l0",)), ["padded", "l0", "#50523"]),
        (ModelFacts(padded_moe_layers=("l0",), zero_filled_rematerialization=True), []),
        (ModelFacts(bare_copy_sinks=("gpt_oss.py:727",)), ["gpt_oss.py:727", "#57795"]),
    ],
)
def test_model_reasons_table(facts: ModelFacts, fragments: list[str]) -> None:
    reasons = model_reasons(facts)
    assert len(reasons) == (1 if fragments else 0), reasons
    assert all(f in reasons[0] for f in fragments)


def test_draft_methods_with_weights_are_named() -> None:
    def names(t: Any) -> set[str]:
        args = typing.get_args(t)
        return set().union(*(names(a) for a in args)) if args else {t}

    from vllm.config.speculative import SpeculativeMethod

    assert unsafe.WEIGHTLESS_DRAFTS <= names(SpeculativeMethod)  # real method names
    dense = nn.Linear(2, 2)
    for method, drafter in (("ngram", ""), ("suffix", ""), ("eagle3", "eagle3"), ("mtp", "mtp")):
        cfg = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
        assert facts_from_model(cfg, dense).draft_method == drafter
    assert facts_from_model(SimpleNamespace(speculative_config=None), dense).draft_method == ""
    # A draft_model drafter is a hazard until the worker refits it (refit_worker.drafter).
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"))
    assert facts_from_model(cfg, dense).draft_method == "draft_model"
    assert facts_from_model(cfg, dense, refitted_drafter="draft_model").draft_method == ""
    eagle = SimpleNamespace(speculative_config=SimpleNamespace(method="eagle3"))
    assert facts_from_model(eagle, dense, refitted_drafter="draft_model").draft_method == "eagle3"


def test_vllm_032_reloads_only_the_target_model() -> None:
    """#52487: reload_weights loads into get_model(); the drafter (get_draft_model()) is
    another module it never touches. When vLLM changes this, revisit the refusal."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = inspect.getsource(GPUModelRunner.reload_weights)
    assert "self.get_model()" in source and "draft" not in source


class Experts(nn.Module):
    """Shaped like vLLM's RoutedExperts for the facts: a MoE config and fused weights."""

    def __init__(self, hidden: int, hidden_unpadded: int) -> None:
        super().__init__()
        self.moe_config = SimpleNamespace(
            hidden_dim=hidden,
            hidden_dim_unpadded=hidden_unpadded,
            intermediate_size_per_partition=64,
            intermediate_size_per_partition_unpadded=64,
        )
        self.w13_weight = nn.Parameter(torch.zeros(2, 128, hidden), requires_grad=False)


def test_padded_moe_weights_are_named_and_vllm_032_rematerializes_them_uninitialized() -> None:
    from vllm.model_executor.model_loader.reload import meta

    model = nn.ModuleDict({"plain": Experts(64, 64), "padded": Experts(128, 120)})
    facts = facts_from_model(SimpleNamespace(), model)
    assert (facts.moe_layers, facts.padded_moe_layers) == (2, ("padded",))
    # #50523: a reload rematerializes with torch.empty_strided, the padding is garbage.
    assert "empty_strided" in inspect.getsource(meta.materialize_meta_tensor)
    assert not facts.zero_filled_rematerialization
    assert "#50523" in model_reasons(facts)[0]


class BareCopySinks(nn.Module):
    """A model whose loader writes its sinks as GPT-OSS does in vLLM 0.32."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, weight in weights:
            if "sinks" in name:
                self.sinks.data.copy_(weight)


def test_sinks_written_outside_weight_loader_are_found() -> None:
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
    from vllm.model_executor.models.granite import GraniteForCausalLM

    sites = unsafe.bare_copy_sink_sites(GptOssForCausalLM)
    assert len(sites) == 3 and all(s.startswith("gpt_oss.py:") for s in sites)
    assert unsafe.bare_copy_sink_sites(GraniteForCausalLM) == ()  # via sharded_weight_loader
    facts = facts_from_model(SimpleNamespace(), BareCopySinks())
    line = inspect.getsourcelines(BareCopySinks.load_weights)[1] + 3
    assert facts.bare_copy_sinks == (f"{__name__.rpartition('.')[2]}.py:{line}",)
    assert facts_from_model(SimpleNamespace(), nn.Linear(2, 2)).bare_copy_sinks == ()


def test_kv_cache_scales_held_as_checkpoint_parameters() -> None:
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    attn: Any = nn.Module()  # an attention layer's stand-in: it holds a quant_method
    attn.quant_method = BaseKVCacheMethod(None)  # type: ignore[arg-type]
    BaseKVCacheMethod.create_weights(attn.quant_method, attn)  # k/v/q scale parameters
    model = nn.ModuleDict({"attn": attn})

    def cfg(dtype: str) -> Any:
        return SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=dtype),
            model_config=SimpleNamespace(quantization="compressed-tensors"),
        )

    assert unsafe.kv_cache_scales(cfg("fp8_e4m3"), model) == "compressed-tensors"
    assert unsafe.kv_cache_scales(cfg("auto"), model) == ""  # not quantized: scales unused
    assert unsafe.kv_cache_scales(cfg("fp8"), nn.Linear(2, 2)) == ""  # vLLM's default scales


def test_unsafe_reasons_reads_the_model() -> None:
    from vllm.config import VllmConfig

    assert backports.unsafe_reasons(VllmConfig(), model=nn.Linear(2, 2)) == []
    reasons = backports.unsafe_reasons(VllmConfig(), model=BareCopySinks())
    assert len(reasons) == 1 and "#57795" in reasons[0]
