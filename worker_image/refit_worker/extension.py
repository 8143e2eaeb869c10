"""The worker extension: ``--worker-extension-cls refit_worker.extension.RefitWorkerExtension``.

vLLM mixes this class into its Worker; the operator calls its methods through
``POST /collective_rpc {"method": "refit_preflight", "args": [path]}`` and friends (names in
contract.RPC_*). Every method returns a JSON-able dict; every refusal raises
contract.RefitRejected, which /collective_rpc turns into HTTP 500 with the code in the body.

Preflight checks everything before anything touches the model, because vLLM's layerwise
reload moves every layer to the meta device first: a reload that fails half way leaves a
model that answers /health and crashes on the next request (notes/vllm-refit-facts.md).

Staging: the operator calls refit_stage while the pod still serves, then drains it and calls
refit_load. refit_stage does everything preflight does and, within the staging budget
(REFIT_STAGING_BUDGET_BYTES, checkpoint.parse_staging_budget), keeps the verified bytes in
this process's memory; refit_load of the staged path then only re-checks the files'
identities (stat, no byte read) and loads exactly the bytes whose digests matched. Over the
budget it loads from disk, with the identities checked before and after the load. One
checkpoint is staged at a time; any refit_load releases it.

Refusal codes and the model: every RefitRejected code except LoadFailed is raised before
reload_weights is called, so the model still holds its old weights and the operator puts
the pod back into traffic on them. LoadFailed is the only code that may come after the
model was touched (a reload that raised, or files that changed during a load from disk).

Weight version: vLLM 0.32/0.33 keeps the served weight version in the engine core
(EngineCore._weight_version, set by POST /update_weight_version, read by GET /weight_info),
which a worker cannot reach (with several workers they are separate processes). So
refit_load records the version it loaded in the worker and refit_info reports that record;
the operator stamps the engine's version over HTTP after a successful load and reads it back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refit_worker import checkpoint, guard
from refit_worker.contract import (
    CAP_ADMIN_GUARD,
    CAP_VERIFIED_RELOAD,
    PROBE_FILE,
    ContractError,
    Manifest,
    ProbeReference,
    RefitInfo,
    RefitRejected,
)

if TYPE_CHECKING:
    import torch

ALLOWED_ROOT_ENV = "REFIT_ALLOWED_ROOT"
DEFAULT_VERSION = "default"
# Checkpoint tensors the model loaders skip on purpose (precomputed rotary tables).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Load formats whose loader can read a directory of safetensors again (get_all_weights).
_DISK_FORMATS = ("auto", "safetensors", "fastsafetensors")


def _torch_dtype_name(dtype: torch.dtype) -> str:
    import torch

    names = {
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float64: "F64",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.int16: "I16",
        torch.int32: "I32",
        torch.int64: "I64",
        torch.bool: "BOOL",
    }
    return names.get(dtype, str(dtype))


def _held_tensors(staged: checkpoint.StagedCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """The staged shards' tensors, shard by shard in manifest order, as vLLM's safetensors
    iterator yields them from disk. Each shard's held bytes are dropped once its tensors are
    made (safetensors copies them), so the load needs at most one shard more than the budget."""
    from safetensors.torch import load

    for _name, data in staged.take_shards():
        tensors = load(data)
        del data
        while tensors:
            name = next(iter(tensors))
            yield name, tensors.pop(name)


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


def _expert_expectations(layer: Any, exact_shapes: bool) -> dict[str, checkpoint.ExpectedParam]:
    """The per-expert checkpoint tensors of an MoE layer. The layer holds each projection of
    every expert in one tensor (``w13_*``: gate and up, ``w2_*``: down), laid out for its
    kernel; the checkpoint holds one tensor per expert and projection, named by the layer's
    own mapping (``experts.<e>.<w1|w2|w3>.``). Full shapes come from the MoE config."""
    cfg = layer.moe_config
    hidden, inter = cfg.hidden_dim_unpadded or cfg.hidden_dim, cfg.intermediate_size
    full = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter)}
    params = [(a, p) for a, p in layer.named_parameters(recurse=False) if a.startswith("w")]
    expected: dict[str, checkpoint.ExpectedParam] = {}
    for _, weight_name, _, shard in layer.get_expert_mapping():
        fused = "w2_" if shard == "w2" else "w13_"
        for attr, param in params:
            if not attr.startswith(fused):
                continue
            suffix = attr.removeprefix(fused)  # weight, bias, weight_scale, ...
            shape = {"weight": full[shard], "bias": full[shard][:1]}.get(suffix)
            name = f"{layer.layer_name}.{weight_name.removeprefix('experts.')}{suffix}"
            dtype = _torch_dtype_name(param.dtype)
            expected[name] = checkpoint.ExpectedParam(shape if exact_shapes else None, dtype)
    return expected


def expected_checkpoint_tensors(
    model: Any, *, exact_shapes: bool
) -> dict[str, checkpoint.ExpectedParam]:
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
    expected: dict[str, checkpoint.ExpectedParam] = {}
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
        dtype = _torch_dtype_name(param.dtype)
        shards = shards_of.get(leaf)
        linear = hasattr(module, "input_size") and hasattr(module, "output_size")
        linear = linear and not hasattr(module, "org_vocab_size")
        if shards:
            sizes = _packed_shard_sizes(module, shards) if exact_shapes else None
            for i, sid in enumerate(shards):
                shape: tuple[int, ...] | None = None
                if sizes is not None and linear and attr in ("weight", "bias"):
                    shape = (sizes[i], module.input_size) if attr == "weight" else (sizes[i],)
                expected[_key(pname, sid)] = checkpoint.ExpectedParam(shape, dtype)
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
        expected[pname] = checkpoint.ExpectedParam(shape, dtype)
    return expected


def verify_model_tensors(
    model: Any,
    tensors: dict[str, checkpoint.ManifestTensor],
    *,
    exact_shapes: bool,
    tied: bool,
    partial: bool,
) -> dict[str, checkpoint.ExpectedParam]:
    """Map the checkpoint's tensors through the model's load mapping and check them against
    what the model expects (checkpoint.verify_params); returns the expectations checked.
    `partial`: this worker holds only some layers (pipeline parallelism), so checkpoint
    tensors for other layers are not errors."""
    expected = expected_checkpoint_tensors(model, exact_shapes=exact_shapes)
    stacked = _stacked_mapping(model)
    mapped: dict[str, checkpoint.ManifestTensor] = {}
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
        if name.endswith(_SKIPPED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            return True
        return partial

    try:
        checkpoint.verify_params(mapped, expected, ignored)
    except RefitRejected as exc:
        # Name the checkpoint tensor each model-side key came from.
        detail = exc.detail
        for key, name in sorted(back.items(), key=lambda kv: -len(kv[0])):
            if key != name and key in detail:
                detail = detail.replace(key, f"{name} (as {key})")
        raise RefitRejected(exc.code, detail) from None
    return expected


class RefitWorkerExtension:
    """Mixed into vLLM's Worker: `self` is the worker (vllm_config, model_runner, ...)."""

    vllm_config: Any
    model_runner: Any
    _refit_version: str
    _refit_staged: checkpoint.StagedCheckpoint | None

    # --- helpers (underscored so they never collide with vLLM's worker attributes) ---
    def _refit_allowed_root(self) -> str:
        return os.environ.get(ALLOWED_ROOT_ENV, "")

    def _refit_model(self) -> Any:
        return self.model_runner.get_model()

    def _refit_check(self, path: str) -> dict[str, Any]:
        started = time.perf_counter()
        directory, manifest = checkpoint.verify_checkpoint(path, self._refit_allowed_root())
        return self._refit_check_model(directory, manifest, started)

    def _refit_check_model(
        self, directory: Path, manifest: Manifest, started: float
    ) -> dict[str, Any]:
        """The model's side of preflight (every tensor it loads, shapes and dtypes) and the
        preflight result."""
        model = self._refit_model()
        cfg = self.vllm_config
        quantized = cfg.model_config.quantization is not None
        tp = cfg.parallel_config.tensor_parallel_size
        pp = cfg.parallel_config.pipeline_parallel_size
        tied = bool(getattr(cfg.model_config.hf_config, "tie_word_embeddings", False))
        expected = verify_model_tensors(
            model, manifest.tensors, exact_shapes=not quantized, tied=tied, partial=pp > 1
        )
        return {
            "path": str(directory),
            "files": len(manifest.files),
            "bytes": sum(f.size for f in manifest.files),
            "tensors": len(manifest.tensors),
            "parameters": len(expected),
            "shapesChecked": not quantized,
            "tensorParallelSize": tp,
            "seconds": round(time.perf_counter() - started, 4),
        }

    def _refit_take_staged(self, path: str) -> checkpoint.StagedCheckpoint | None:
        """The checkpoint staged for `path`, handed over (the worker holds none after this
        call); None when `path` is not the one staged."""
        staged = getattr(self, "_refit_staged", None)
        self._refit_staged = None
        if staged is None or staged.path != path:
            if staged is not None:
                staged.release()  # a load of another checkpoint: memory back
            return None
        return staged

    def _refit_switch_load_format(self) -> str | None:
        """A --load-format dummy start cannot read a directory until the format changes;
        returns the format switched from (None: no switch)."""
        load_format = str(getattr(self.vllm_config.load_config.load_format, "value", ""))
        load_format = load_format or str(self.vllm_config.load_config.load_format)
        if load_format in _DISK_FORMATS:
            return None
        self.update_config({"load_config": {"load_format": "safetensors"}})  # type: ignore[attr-defined]
        return load_format

    def _refit_load_staged(self, staged: checkpoint.StagedCheckpoint) -> tuple[str, float]:
        """Load a staged checkpoint (its identities already re-checked); returns (source,
        seconds of the reload)."""
        directory = str(staged.directory)
        # A model that reloads weights from other sources too (secondary_weights) needs
        # vLLM's own loader: such a load reads from disk like one over the budget.
        from_memory = staged.in_memory and not getattr(
            self._refit_model(), "secondary_weights", None
        )
        started = time.perf_counter()
        if from_memory:
            # vLLM points model_config at weights_path itself; from an iterator it does
            # not, so refit_info's model would name the previous checkpoint.
            model_config = self.vllm_config.model_config
            model_config.model = directory
            if hasattr(model_config, "model_weights"):
                model_config.model_weights = ""
            model_config.revision = None
            self._refit_reload(weights_iterator=_held_tensors(staged))
            return "memory", time.perf_counter() - started
        staged.release()
        self._refit_reload(weights_path=directory)
        seconds = time.perf_counter() - started
        staged.check_after_load()  # LoadFailed: the model was touched
        return "disk", seconds

    def _refit_reload(self, **source: Any) -> None:
        try:
            self.reload_weights(is_checkpoint_format=True, **source)  # type: ignore[attr-defined]
        except Exception as exc:
            raise RefitRejected("LoadFailed", f"{type(exc).__name__}: {exc}") from exc

    # --- RPC methods (contract.RPC_*) ---
    def refit_info(self) -> dict[str, Any]:
        import vllm

        from refit_worker import backports
        from refit_worker.backports import unsafe

        cfg = self.vllm_config
        caps = [*backports.capabilities(), CAP_VERIFIED_RELOAD]
        if guard.guard_configured():
            caps.append(CAP_ADMIN_GUARD)
        backends = sorted(
            {
                m.attn_backend.get_name()
                for m in self._refit_model().modules()
                if getattr(m, "attn_backend", None) is not None
            }
        )
        info = RefitInfo(
            vllm_version=str(vllm.__version__),
            attention_backend=",".join(backends) or "unknown",
            kv_cache_dtype=str(cfg.cache_config.cache_dtype),
            cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
            capabilities=tuple(dict.fromkeys(caps)),
            unsafe_reasons=tuple(backports.unsafe_reasons(cfg, model=self._refit_model())),
            weight_version=getattr(self, "_refit_version", DEFAULT_VERSION),
            model=str(cfg.model_config.model),
            allowed_root=self._refit_allowed_root(),
            kv_cache_scales=unsafe.kv_cache_scales(cfg, self._refit_model()),
        )
        return info.to_json_dict()

    def refit_preflight(self, path: str) -> dict[str, Any]:
        return self._refit_check(path)

    def refit_stage(self, path: str) -> dict[str, Any]:
        """Preflight, then stage the checkpoint for refit_load (see the module docstring).
        Staging the staged path again, unchanged, returns at the cost of a few stats."""
        started = time.perf_counter()
        budget = checkpoint.staging_budget()  # ValueError on a malformed value
        previous = getattr(self, "_refit_staged", None)
        self._refit_staged = None
        staged = checkpoint.stage_checkpoint(
            path, self._refit_allowed_root(), budget, previous=previous
        )
        if not staged.reused:
            try:
                staged.summary = self._refit_check_model(staged.directory, staged.manifest, started)
            except BaseException:
                staged.release()
                raise
        self._refit_staged = staged
        return {
            **staged.summary,
            "seconds": round(time.perf_counter() - started, 4),
            "staged": staged.mode,
            "budgetBytes": staged.budget,
            "note": staged.note(),
        }

    def refit_load(self, path: str, version: str) -> dict[str, Any]:
        # Invariant: nothing below raises a code other than LoadFailed once reload_weights
        # has been called (module docstring); every other refusal comes first.
        staged = self._refit_take_staged(path)
        try:
            if not isinstance(version, str) or not version:
                raise RefitRejected("LoadFailed", "version must be a non-empty string")
            started = time.perf_counter()
            if staged is not None:
                staged.check_before_load(self._refit_allowed_root())  # CheckpointChanged
                result = {**staged.summary, "seconds": round(time.perf_counter() - started, 4)}
            else:
                result = self._refit_check(path)
            switched = self._refit_switch_load_format()
            if staged is not None:
                source, load_seconds = self._refit_load_staged(staged)
            else:
                source, started = "unstaged", time.perf_counter()
                self._refit_reload(weights_path=result["path"])
                load_seconds = time.perf_counter() - started
        finally:
            if staged is not None:
                staged.release()
        self._refit_version = version
        return {
            **result,
            "version": version,
            "loadSeconds": round(load_seconds, 4),
            "switchedLoadFormatFrom": switched,
            "source": source,
        }

    def refit_probe_reference(self, path: str) -> dict[str, Any]:
        # Path rules and a readable manifest, not the shard hashes: the reference is read
        # after refit_load verified those, and hashing a large checkpoint twice is slow.
        directory = checkpoint.resolve_under_root(path, self._refit_allowed_root())
        checkpoint.load_manifest(directory)
        probe = directory / PROBE_FILE
        if not probe.is_file():
            raise RefitRejected("ProbeReferenceInvalid", f"{PROBE_FILE} is absent in {directory}")
        try:
            reference = ProbeReference.from_json_dict(json.loads(probe.read_text()))
        except (ValueError, ContractError) as exc:
            raise RefitRejected("ProbeReferenceInvalid", str(exc)) from None
        return reference.to_json_dict()

    # --- Broadcast refits (docs/broadcast.md) ---
    def refit_received(self, digest: str = "", version: str = "") -> dict[str, Any]:
        """The last broadcast this worker's refit-gloo engine received: the manifest of what
        arrived, its digest, timings, and whether it was loaded. Raises the round's refusal
        again (TransferMismatch, TransferFailed, ManifestInvalid, TensorMismatch, LoadFailed)
        and TransferMismatch when the loaded digest is not `digest` (when given). `version`,
        once the check passes, becomes this worker's weight version (refit_info), as
        refit_load records its own."""
        from refit_worker import transfer

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, transfer.GlooWeightTransferEngine):
            raise RefitRejected(
                "TransferFailed",
                "this server runs no refit-gloo weight transfer engine "
                """(--weight-transfer-config '{"backend": "refit-gloo"}')""",
            )
        result = engine.received(digest)
        if version:
            self._refit_version = version
        return {**result, "version": getattr(self, "_refit_version", DEFAULT_VERSION)}
