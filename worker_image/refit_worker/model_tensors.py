"""The tensors a vLLM model loads, and the check of a checkpoint's (or a broadcast promise's)
tensors against them, through the model's own load mapping: every parameter present with its
full (unsharded) shape and a compatible dtype, nothing the model has no place for.

The model is read by duck typing (vLLM's layer attributes: packed_modules_mapping,
hf_to_vllm_mapper, output_sizes, moe_config, ...): this module imports neither vLLM nor, until
a model's dtypes are read, torch. LoadRules.of derives from the server's vLLM config how
strictly the check can be made; the worker extension's preflight and the refit-gloo engine
both check through verify_model_tensors with those rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from refit_worker.contract import ManifestTensor, RefitRejected
from refit_worker.dtypes import dtype_compatible, dtype_name_or_str

# Checkpoint tensors the model loaders skip on purpose (precomputed rotary tables).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class ExpectedParam:
    """A tensor the model will load, as preflight compares it with the checkpoint."""

    shape: tuple[int, ...] | None  # None: the shape cannot be derived, so it is not checked
    dtype: str  # safetensors dtype name


@dataclass(frozen=True)
class LoadRules:
    """How strictly a server's model can be checked, from its vLLM config (derived here only)."""

    # The full shapes can be derived from the layers (unquantized); otherwise only presence
    # and dtype are checked.
    exact_shapes: bool
    # tie_word_embeddings: the loader skips a checkpoint's lm_head.* (it shares the embedding).
    tied: bool
    # Pipeline parallelism: this worker holds only some layers, so tensors for the others are
    # not errors.
    partial: bool

    @classmethod
    def of(cls, vllm_config: Any) -> LoadRules:
        model_config = vllm_config.model_config
        return cls(
            exact_shapes=model_config.quantization is None,
            tied=bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
            partial=vllm_config.parallel_config.pipeline_parallel_size > 1,
        )


def verify_params(
    tensors: Mapping[str, ManifestTensor],
    expected: Mapping[str, ExpectedParam],
    ignored: Callable[[str], bool] = lambda name: False,
) -> None:
    """Every expected tensor is in the checkpoint with the same shape and a compatible dtype,
    and the checkpoint holds nothing the model would not know where to put (a name the
    model's loader has no parameter for fails inside vLLM's reload, after the old weights
    are gone). `ignored` names checkpoint tensors the model's loader skips on purpose."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise RefitRejected(
            "TensorMismatch", f"the checkpoint lacks {', '.join(missing[:5])}{more}"
        )
    unknown = sorted(n for n in set(tensors) - set(expected) if not ignored(n))
    if unknown:
        raise RefitRejected(
            "TensorMismatch", f"the model has no parameter for {', '.join(unknown[:5])}"
        )
    for name, want in sorted(expected.items()):
        got = tensors[name]
        if want.shape is not None and got.shape != want.shape:
            raise RefitRejected(
                "TensorMismatch",
                f"{name}: checkpoint shape {list(got.shape)}, the model expects {list(want.shape)}",
            )
        if not dtype_compatible(got.dtype, want.dtype):
            raise RefitRejected(
                "TensorMismatch",
                f"{name}: checkpoint dtype {got.dtype}, the model expects {want.dtype}",
            )


def _key(name: str, shard: Any) -> str:
    return name if shard is None else f"{name}#{shard}"


def _stacked_mapping(model: Any) -> dict[str, tuple[str, Any]]:
    """Checkpoint substring -> (packed parameter substring, shard id), from the model's own
    mapper when it declares one, else from its packed_modules_mapping (vLLM's convention:
    q/k/v for qkv_proj, 0..n-1 otherwise)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = dict(getattr(mapper, "orig_to_new_stacked", {}) or {})
    if stacked:
        return stacked
    for packed, parts in (getattr(model, "packed_modules_mapping", {}) or {}).items():
        for i, part in enumerate(parts):
            shard: Any = part[0] if packed == "qkv_proj" and part[0] in "qkv" else i
            stacked[f".{part}"] = (f".{packed}", shard)
    return stacked


def _map_checkpoint_name(model: Any, stacked: dict[str, tuple[str, Any]], name: str) -> str | None:
    """The model-side key a checkpoint tensor loads into (None: the loader drops it)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        mapped = mapper._map_name_with_shard(name)
        if mapped is None:
            return None
        new_name, shard = mapped
        if shard is None:  # a mapper without stacked entries: apply the packed mapping
            for old, (new, sid) in stacked.items():
                if old in new_name:
                    return _key(new_name.replace(old, new, 1), sid)
        return _key(new_name, shard)
    for old, (new, sid) in stacked.items():
        if old in name:
            return _key(name.replace(old, new, 1), sid)
    return name


def _packed_shard_sizes(module: Any, shards: list[Any]) -> list[int] | None:
    """Full (unsharded) output size of each shard of a packed linear layer."""
    if all(s in ("q", "k", "v") for s in shards) and hasattr(module, "total_num_heads"):
        head = module.head_size
        v_head = getattr(module, "v_head_size", head)
        sizes = {
            "q": module.total_num_heads * head,
            "k": module.total_num_kv_heads * head,
            "v": module.total_num_kv_heads * v_head,
        }
        return [sizes[s] for s in shards]
    out = getattr(module, "output_sizes", None)
    if out is not None and all(isinstance(s, int) for s in shards):
        return [int(out[s]) for s in shards]
    return None


def _is_moe(module: Any) -> bool:
    """vLLM's RoutedExperts: experts fused per layer, loaded by its own expert mapping."""
    return hasattr(module, "get_expert_mapping") and hasattr(module, "w13_weight")


def _expert_expectations(layer: Any, exact_shapes: bool) -> dict[str, ExpectedParam]:
    """The per-expert checkpoint tensors of an MoE layer. The layer holds each projection of
    every expert in one tensor (``w13_*``: gate and up, ``w2_*``: down), laid out for its
    kernel; the checkpoint holds one tensor per expert and projection, named by the layer's
    own mapping (``experts.<e>.<w1|w2|w3>.``). Full shapes come from the MoE config."""
    cfg = layer.moe_config
    hidden, inter = cfg.hidden_dim_unpadded or cfg.hidden_dim, cfg.intermediate_size
    full = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    params = [(a, p) for a, p in layer.named_parameters(recurse=False) if a.startswith("w")]
    expected: dict[str, ExpectedParam] = {}
    for _, weight_name, _, shard in layer.get_expert_mapping():
        fused = "w2_" if shard == "w2" else "w13_"
        for attr, param in params:
            if not attr.startswith(fused):
                continue
            suffix = attr.removeprefix(fused)  # weight, bias, weight_scale, ...
            shape = {"weight": full[shard], "bias": full[shard][:1]}.get(suffix)
            name = f"{layer.layer_name}.{weight_name.removeprefix('experts.')}{suffix}"
            dtype = dtype_name_or_str(param.dtype)
            expected[name] = ExpectedParam(shape if exact_shapes else None, dtype)
    return expected


def expected_checkpoint_tensors(model: Any, *, exact_shapes: bool) -> dict[str, ExpectedParam]:
    """What a checkpoint must hold for this model, keyed like _map_checkpoint_name's result.

    Shapes are the full (unsharded) checkpoint shapes, taken from the vLLM layers' own size
    attributes. Where a layer's checkpoint shape cannot be derived (quantized layers, unknown
    layers under tensor parallelism), the shape is not checked (exact_shapes=False marks
    the whole model so) and only presence and dtype are.
    """
    stacked = _stacked_mapping(model)
    shards_of: dict[str, list[Any]] = {}
    for new, sid in stacked.values():
        shards_of.setdefault(new.lstrip("."), []).append(sid)
    expected: dict[str, ExpectedParam] = {}
    for module in model.modules():
        if _is_moe(module):
            expected.update(_expert_expectations(module, exact_shapes))
    for pname, param in model.named_parameters():
        pname = pname.replace(".base_layer.", ".")
        module_name, _, attr = pname.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module = getattr(module, "base_layer", module)
        if _is_moe(module) and attr.startswith(("w13_", "w2_")):
            continue  # expected per expert, above
        leaf = module_name.rpartition(".")[2]
        dtype = dtype_name_or_str(param.dtype)
        shards = shards_of.get(leaf)
        linear = hasattr(module, "input_size") and hasattr(module, "output_size")
        linear = linear and not hasattr(module, "org_vocab_size")
        if shards:
            sizes = _packed_shard_sizes(module, shards) if exact_shapes else None
            for i, sid in enumerate(shards):
                shape: tuple[int, ...] | None = None
                if sizes is not None and linear and attr in ("weight", "bias"):
                    shape = (sizes[i], module.input_size) if attr == "weight" else (sizes[i],)
                expected[_key(pname, sid)] = ExpectedParam(shape, dtype)
            continue
        # Vocabulary layers first: they also carry input_size/output_size, padded.
        if exact_shapes and hasattr(module, "org_vocab_size") and attr == "weight":
            shape = (module.org_vocab_size, module.embedding_dim)
        elif exact_shapes and linear and attr in ("weight", "bias"):
            full = (module.output_size, module.input_size)
            shape = full if attr == "weight" else (module.output_size,)
        elif exact_shapes:
            shape = tuple(param.shape)
        else:
            shape = None
        expected[pname] = ExpectedParam(shape, dtype)
    return expected


def verify_model_tensors(
    model: Any, tensors: Mapping[str, ManifestTensor], rules: LoadRules
) -> dict[str, ExpectedParam]:
    """Map the checkpoint's tensors through the model's load mapping and check them against
    what the model expects (verify_params), as strictly as `rules` allow; returns the
    expectations checked. RefitRejected TensorMismatch, naming the checkpoint's tensor."""
    expected = expected_checkpoint_tensors(model, exact_shapes=rules.exact_shapes)
    stacked = _stacked_mapping(model)
    mapped: dict[str, ManifestTensor] = {}
    back: dict[str, str] = {}
    for name, tensor in tensors.items():
        # An expert's tensor is expected under its checkpoint name: the packed mapping
        # (gate_proj -> gate_up_proj) is for dense layers; vLLM's loaders skip experts there.
        key = name if name in expected else _map_checkpoint_name(model, stacked, name)
        if key is None:  # the model's mapper drops it
            continue
        if key in mapped:
            raise RefitRejected("TensorMismatch", f"{name} and {back[key]} both load into {key}")
        mapped[key] = tensor
        back[key] = name

    def ignored(key: str) -> bool:
        name = back.get(key, key)
        if name.endswith(_SKIPPED_SUFFIXES) or (rules.tied and name.startswith("lm_head.")):
            return True
        return rules.partial

    try:
        verify_params(mapped, expected, ignored)
    except RefitRejected as exc:
        # Name the checkpoint tensor each model-side key came from.
        detail = exc.detail
        for key, name in sorted(back.items(), key=lambda kv: -len(kv[0])):
            if key != name and key in detail:
                detail = detail.replace(key, f"{name} (as {key})")
        raise RefitRejected(exc.code, detail) from None
    return expected
