"""A bad adapter is refused before any pod leaves traffic: the pure checks behind it.

refit_worker.lora_adapter.check_adapter judges an adapter directory against what the engine
knows (its --max-lora-rank, the modules a LoRA may target and their sizes), each rule one
vLLM 0.32 applies at load time (AdapterInvalid, AdapterRankTooHigh, AdapterModulesUnknown,
AdapterBaseMismatch); core.admission.adapter_name_problem judges the adapter's name against
the models a pod serves (AdapterNameConflict). The same check on real files and through the
simulated worker's refit_adapter_check is at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from refit_operator.core.admission import adapter_name_problem
from refit_operator.core.reasons import Reason
from refit_worker import contract
from refit_worker.checkpoint import verify_checkpoint
from refit_worker.contract import ManifestTensor, RefitRejected
from refit_worker.lora_adapter import ADAPTER_WEIGHTS_FILE, check_adapter, lora_module

from testbed.simworker import SIM_LORA_MODULES, make_sim_adapter

# A Llama-like engine: hidden 64, q 64, k/v 16 (grouped-query), MLP 128.
MODULES: dict[str, tuple[int | None, int | None]] = {
    "q_proj": (64, 64), "k_proj": (64, 16), "v_proj": (64, 16), "o_proj": (64, 64),
    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
}  # fmt: skip
GOOD = {
    "peft_type": "LORA",
    "base_model_name_or_path": "org/llama-tiny",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
    "modules_to_save": None,
}


def lora(module: str, rank: int, in_f: int, out_f: int, layer: int = 0) -> dict[str, Any]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
    return {
        f"{prefix}.lora_A.weight": ManifestTensor(ADAPTER_WEIGHTS_FILE, "F32", (rank, in_f)),
        f"{prefix}.lora_B.weight": ManifestTensor(ADAPTER_WEIGHTS_FILE, "F32", (out_f, rank)),
    }


TENSORS = {**lora("q_proj", 8, 64, 64), **lora("v_proj", 8, 64, 16)}


def adapter_dir(tmp_path: Path, config: dict[str, Any] | None = GOOD, raw: str = "") -> Path:
    d = tmp_path / "adapter"
    d.mkdir(exist_ok=True)
    if raw:
        (d / contract.ADAPTER_CONFIG_FILE).write_text(raw)
    elif config is not None:
        (d / contract.ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return d


def check(d: Path, tensors: dict[str, Any] = TENSORS, **engine: Any) -> dict[str, Any]:
    return check_adapter(d, tensors, **{"max_rank": 8, "modules": MODULES, **engine})


def refusal(d: Path, tensors: dict[str, Any] = TENSORS, **engine: Any) -> tuple[str, str]:
    with pytest.raises(RefitRejected) as err:
        check(d, tensors, **engine)
    return err.value.code, err.value.detail


def test_a_good_adapter_fits(tmp_path: Path) -> None:
    assert check(adapter_dir(tmp_path)) == {
        "rank": 8, "targetModules": ["q_proj", "v_proj"], "baseModel": "org/llama-tiny",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("config", "raw", "says"),
    [
        (None, "", "is absent"),
        (GOOD, "{not json", "adapter_config.json"),
        ({**GOOD, "peft_type": "PREFIX_TUNING"}, "", "peft_type is not LORA"),
        ({**GOOD, "r": 0}, "", "is not a rank"),
        ({**GOOD, "r": True}, "", "is not a rank"),
        ({k: v for k, v in GOOD.items() if k != "lora_alpha"}, "", "lora_alpha is missing"),
        ({**GOOD, "rank_pattern": {"q_proj": -1}}, "", "rank_pattern"),
        ({**GOOD, "use_dora": True}, "", "DoRA"),
        ({**GOOD, "bias": "all"}, "", "bias='all'"),
        ({**GOOD, "modules_to_save": ["lm_head"]}, "", "modules_to_save"),
        ({**GOOD, "init_lora_weights": "pissa"}, "", "init_lora_weights='pissa'"),
    ],
    ids=[
        "absent",
        "unparsable",
        "not-lora",
        "rank-0",
        "rank-bool",
        "no-alpha",
        "bad-pattern",
        "dora",
        "bias",
        "modules-to-save",
        "pissa",
    ],
)
def test_a_config_vllm_would_not_load_is_invalid(
    tmp_path: Path, config: dict[str, Any] | None, raw: str, says: str
) -> None:
    code, detail = refusal(adapter_dir(tmp_path, config, raw))
    assert code == "AdapterInvalid" and says in detail, detail


def test_no_weights_file_is_invalid(tmp_path: Path) -> None:
    other = {k: ManifestTensor("other.safetensors", t.dtype, t.shape) for k, t in TENSORS.items()}
    code, detail = refusal(adapter_dir(tmp_path), other)
    assert code == "AdapterInvalid" and ADAPTER_WEIGHTS_FILE in detail


def test_a_tensor_vllm_cannot_parse_is_invalid(tmp_path: Path) -> None:
    odd = {**TENSORS, "base_model.model.model.norm.weight": TENSORS[next(iter(TENSORS))]}
    assert refusal(adapter_dir(tmp_path), odd)[0] == "AdapterInvalid"


def test_rank_above_the_engines_max_is_refused(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path)
    code, detail = refusal(d, max_rank=4)
    assert code == "AdapterRankTooHigh" and "rank 8" in detail and "--max-lora-rank 4" in detail
    # vLLM holds the highest rank of rank_pattern to the limit too
    d = adapter_dir(tmp_path, {**GOOD, "r": 4, "rank_pattern": {"v_proj": 16}})
    assert refusal(d)[0] == "AdapterRankTooHigh"
    # an engine without LoRA (max 0) is AdapterUnsupported's, in the operator's admission
    assert check(adapter_dir(tmp_path), max_rank=0)["rank"] == 8


def test_modules_the_model_does_not_have_are_refused(tmp_path: Path) -> None:
    foreign = {**TENSORS, **lora("query_key_value", 8, 64, 192)}  # a GPT-NeoX module
    code, detail = refusal(adapter_dir(tmp_path), foreign)
    assert code == "AdapterModulesUnknown", detail
    assert "model.layers.0.self_attn.query_key_value" in detail and "q_proj" in detail
    assert "trained on 'org/llama-tiny'" in detail
    # vLLM judges the tensors, not target_modules: a target PEFT found no module for is no harm
    d = adapter_dir(tmp_path, {**GOOD, "target_modules": ["q_proj", "v_proj", "dense"]})
    assert check(d)["targetModules"] == ["q_proj", "v_proj", "dense"]
    # modules_to_save's classifier heads are no LoRA targets, and vLLM takes them
    d = adapter_dir(tmp_path, {**GOOD, "modules_to_save": ["score"]})
    head = {"base_model.model.score.weight": ManifestTensor(ADAPTER_WEIGHTS_FILE, "F32", (2, 64))}
    assert check(d, {**TENSORS, **head})["rank"] == 8
    # an engine that cannot say which modules it has: not judged
    assert check(adapter_dir(tmp_path), foreign, modules={})["rank"] == 8


def test_matrices_of_another_base_model_are_refused(tmp_path: Path) -> None:
    wider = {**lora("q_proj", 8, 96, 96), **lora("v_proj", 8, 96, 16)}  # hidden 96, not 64
    code, detail = refusal(adapter_dir(tmp_path), wider)
    assert code == "AdapterBaseMismatch", detail
    assert "input features 96, the module's 64" in detail and "org/llama-tiny" in detail
    narrower_out = {**TENSORS, **lora("v_proj", 8, 64, 32)}  # v of 32, the model's 16
    assert "output features 32, the module's 16" in refusal(adapter_dir(tmp_path), narrower_out)[1]
    # a size the engine cannot tell (layers disagree, replicated KV heads) is not judged
    unknown = {**MODULES, "v_proj": (64, None)}
    assert check(adapter_dir(tmp_path), narrower_out, modules=unknown)["rank"] == 8


def test_the_base_model_name_alone_is_not_judged(tmp_path: Path) -> None:
    """vLLM never compares base_model_name_or_path with what it serves when it loads an
    adapter, and a refit fleet serves weights loaded from other paths since it started: an
    adapter whose matrices fit is taken whatever base it names."""
    d = adapter_dir(tmp_path, {**GOOD, "base_model_name_or_path": "/ckpt/step-100"})
    assert check(d)["baseModel"] == "/ckpt/step-100"
    d = adapter_dir(tmp_path, {k: v for k, v in GOOD.items() if k != "base_model_name_or_path"})
    assert check(d)["baseModel"] == ""


def test_lora_module_parses_tensor_names_as_vllm_does() -> None:
    name = "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    assert lora_module(name) == ("model.layers.3.mlp.down_proj", "B")
    assert lora_module("model.embed_tokens.lora_embedding_A") == ("model.embed_tokens", "")
    assert lora_module("base_model.model.model.embed_tokens.base_layer.weight") is None
    assert lora_module("base_model.model.score.weight") == ("score", "")
    with pytest.raises(RefitRejected):
        lora_module("base_model.model.model.norm.weight")


def test_experts_are_matched_from_their_experts_suffix(tmp_path: Path) -> None:
    expert = "base_model.model.model.layers.0.mlp.experts.0.w1.lora_A.weight"
    t = {expert: ManifestTensor(ADAPTER_WEIGHTS_FILE, "F32", (8, 64))}
    assert refusal(adapter_dir(tmp_path), t)[0] == "AdapterModulesUnknown"
    assert check(adapter_dir(tmp_path), t, modules={"experts.0.w1": (None, None)})["rank"] == 8


# ------------------------------------------------------------------ the name of an adapter
BASE = [("sim-model", None), ("sim-alias", None)]


@pytest.mark.parametrize(
    ("name", "served", "ours", "says"),
    [
        ("sim-model", BASE, False, "base model name"),
        ("sim-alias", BASE, True, "base model name"),  # an alias (--served-model-name)
        ("policy", [*BASE, ("policy", "sim-model")], False, "no refit of this adapter track"),
        ("policy@s2", BASE, False, "staged name"),
    ],
    ids=["base", "alias", "loaded-by-others", "staged-pattern"],
)
def test_a_name_the_pods_serve_otherwise_is_refused(
    name: str, served: list[tuple[str, str | None]], ours: bool, says: str
) -> None:
    problem = adapter_name_problem(name, served, ours)
    assert problem is not None and problem.reason == Reason.AdapterNameConflict
    assert says in problem.message, problem.message


def test_the_tracks_own_adapter_and_a_new_name_pass() -> None:
    assert adapter_name_problem("policy", [*BASE, ("policy", "sim-model")], True) is None
    assert adapter_name_problem("policy", [*BASE, ("critic", "sim-model")], False) is None
    # another adapter's staged name does not collide: names hold no '@'
    assert adapter_name_problem("policy", [*BASE, ("policy@s1", "sim-model")], False) is None


# ------------------------------------------------------------------ on real files
def test_the_check_on_a_written_adapter(tmp_path: Path) -> None:
    """A simulated adapter on disk, verified by the checkpoint code as refit_adapter_check
    does, fits the simulated engine; rewritten to rank 16, it does not."""
    d = make_sim_adapter(tmp_path / "a", "a")
    directory, manifest = verify_checkpoint(str(d), str(tmp_path))
    fit = check_adapter(directory, manifest.tensors, max_rank=8, modules=SIM_LORA_MODULES)
    assert fit == {"rank": 8, "targetModules": ["q_proj", "v_proj"], "baseModel": fit["baseModel"]}
    wide = make_sim_adapter(tmp_path / "w", "w", rank=16)
    directory, manifest = verify_checkpoint(str(wide), str(tmp_path))
    with pytest.raises(RefitRejected) as err:
        check_adapter(directory, manifest.tensors, max_rank=8, modules=SIM_LORA_MODULES)
    assert err.value.code == "AdapterRankTooHigh"
