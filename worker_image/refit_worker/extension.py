"""The worker extension: ``--worker-extension-cls refit_worker.extension.RefitWorkerExtension``.

vLLM mixes this class into its Worker; the operator calls its methods through
``POST /collective_rpc {"method": "refit_preflight", "args": [path]}`` and friends (names in
contract.RPC_*). Every method returns a JSON-able dict; every refusal raises
contract.RefitRejected, which /collective_rpc turns into HTTP 500 with the code in the body.

Preflight checks everything before anything touches the model, because vLLM's layerwise
reload moves every layer to the meta device first: a reload that fails half way leaves a
model that answers /health and crashes on the next request (reproduced on vLLM 0.32: a
reload from a bad path answers 500 with every layer left on the meta device).

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

Drafters: an engine that runs a speculative drafter with weights of its own that the worker
refits (refit_worker.drafter: vLLM's ``draft_model``) needs the drafter's checkpoint in the
checkpoint's ``drafter/`` (contract.DRAFTER_DIR). Preflight, staging and load verify it like
the target (path rules, manifest, digests, the drafter model's tensors) and the load reloads
it right after the target; a checkpoint without it is refused DrafterMissing before anything
is hashed or loaded, so a pod never serves a new target beside a stale drafter.

A broadcast (refit_worker.broadcast.gloo_engine) refits the drafter from the round's
drafter tensors (contract.DRAFTER_PREFIX); the extension hands the engine the drafter
(``weight_transfer_engine``, below).

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

from refit_worker import checkpoint, guard, peers
from refit_worker.contract import (
    CAP_ADMIN_GUARD,
    CAP_ERRORS_KEEP_CONNECTION,
    CAP_VERIFIED_RELOAD,
    PROBE_FILE,
    ContractError,
    Manifest,
    ProbeReference,
    RefitInfo,
    RefitRejected,
)
from refit_worker.drafter import Drafter, drafter_directory, drafter_of, reload_drafter
from refit_worker.lora_adapter import Sizes, check_adapter
from refit_worker.model_tensors import LoadRules, verify_model_tensors

if TYPE_CHECKING:
    import torch

ALLOWED_ROOT_ENV = "REFIT_ALLOWED_ROOT"
DEFAULT_VERSION = "default"
# Load formats whose loader can read a directory of safetensors again (get_all_weights).
_DISK_FORMATS = ("auto", "safetensors", "fastsafetensors")


def _features(size: Any) -> int | None:
    """A layer's size attribute as a feature count; None when it is none."""
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


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


class RefitWorkerExtension:
    """Mixed into vLLM's Worker: `self` is the worker (vllm_config, model_runner, ...)."""

    vllm_config: Any
    model_runner: Any
    _refit_version: str
    _refit_staged: checkpoint.StagedCheckpoint | None
    # The drafter's checkpoint, staged with _refit_staged (None: the engine runs no drafter
    # the worker refits).
    _refit_staged_drafter: checkpoint.StagedCheckpoint | None

    # --- helpers (underscored so they never collide with vLLM's worker attributes) ---
    def _refit_allowed_root(self) -> str:
        return os.environ.get(ALLOWED_ROOT_ENV, "")

    def _refit_model(self) -> Any:
        return self.model_runner.get_model()

    def _refit_drafter(self) -> Drafter | None:
        return drafter_of(self.vllm_config, self.model_runner)

    # vLLM's Worker sets self.weight_transfer_engine in load_model, handing the engine the
    # target model only; a broadcast that refits the drafter too needs the drafter, which
    # only the model runner knows. Class attributes of an extension never shadow the
    # Worker's (vLLM appends it to the bases), but a data descriptor catches the assignment
    # wherever it sits in the MRO: so the refit-gloo engine learns where the drafter is.
    @property
    def weight_transfer_engine(self) -> Any:
        return self.__dict__.get("_refit_transfer_engine")

    @weight_transfer_engine.setter
    def weight_transfer_engine(self, engine: Any) -> None:
        self.__dict__["_refit_transfer_engine"] = engine
        if hasattr(engine, "find_drafter"):  # refit-gloo (broadcast.gloo_engine)
            engine.find_drafter = self._refit_drafter

    def _refit_drafter_directory(self, path: str) -> Path | None:
        """The drafter's checkpoint directory under `path` when the engine runs a drafter
        the worker refits (DrafterMissing when absent), else None. Cheap: a stat."""
        if self._refit_drafter() is None:
            return None
        return drafter_directory(checkpoint.resolve_under_root(path, self._refit_allowed_root()))

    def _refit_pod_workers(self) -> int:
        """How many workers this pod runs: tensor x pipeline parallel (split over
        --nnodes pods), times the data-parallel engines this pod hosts."""
        cfg = self.vllm_config.parallel_config
        if cfg.nnodes > 1:
            return max(1, cfg.world_size // cfg.nnodes)
        return max(1, cfg.world_size * max(1, cfg.data_parallel_size_local))

    def _refit_check(self, path: str) -> dict[str, Any]:
        started = time.perf_counter()
        drafter_dir = self._refit_drafter_directory(path)  # DrafterMissing before any hashing
        directory, manifest = checkpoint.verify_checkpoint(path, self._refit_allowed_root())
        result = self._refit_check_model(directory, manifest, started)
        if drafter_dir is not None:
            root = self._refit_allowed_root()
            drafter_dir, drafter_manifest = checkpoint.verify_checkpoint(str(drafter_dir), root)
            result["drafter"] = self._refit_check_model(
                drafter_dir, drafter_manifest, started, drafter=self._refit_drafter()
            )
        return result

    def _refit_check_model(
        self,
        directory: Path,
        manifest: Manifest,
        started: float,
        drafter: Drafter | None = None,
    ) -> dict[str, Any]:
        """The model's side of preflight (every tensor it loads, shapes and dtypes) and the
        preflight result; of the drafter's model and checkpoint when `drafter` is given."""
        rules = LoadRules.of(self.vllm_config if drafter is None else drafter.config)
        model = self._refit_model() if drafter is None else drafter.model
        expected = verify_model_tensors(model, manifest.tensors, rules)
        return {
            "path": str(directory),
            "files": len(manifest.files),
            "bytes": sum(f.size for f in manifest.files),
            "tensors": len(manifest.tensors),
            "parameters": len(expected),
            "shapesChecked": rules.exact_shapes,
            "tensorParallelSize": self.vllm_config.parallel_config.tensor_parallel_size,
            "seconds": round(time.perf_counter() - started, 4),
        }

    def _refit_take_staged(self, path: str) -> list[checkpoint.StagedCheckpoint]:
        """The checkpoint staged for `path` and, for an engine with a drafter the worker
        refits, its drafter's, handed over (the worker holds none after this call); [] when
        `path` is not the one staged."""
        staged = [
            s
            for s in (getattr(self, "_refit_staged", None),
                      getattr(self, "_refit_staged_drafter", None))
            if s is not None
        ]  # fmt: skip
        self._refit_staged = self._refit_staged_drafter = None
        wanted = 1 if self._refit_drafter() is None else 2
        if len(staged) != wanted or staged[0].path != path:
            for one in staged:
                one.release()  # a load of another checkpoint: memory back
            return []
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

    def _refit_load_staged(
        self, staged: checkpoint.StagedCheckpoint, drafter: Drafter | None = None
    ) -> tuple[str, float]:
        """Load a staged checkpoint (its identities already re-checked) into the target, or
        into `drafter`'s model; returns (source, seconds of the reload)."""
        directory = str(staged.directory)
        model = self._refit_model() if drafter is None else drafter.model
        # A model that reloads weights from other sources too (secondary_weights) needs
        # vLLM's own loader: such a load reads from disk like one over the budget.
        from_memory = staged.in_memory and not getattr(model, "secondary_weights", None)
        started = time.perf_counter()
        if from_memory:
            # vLLM points model_config at weights_path itself; from an iterator it does
            # not, so refit_info's model would name the previous checkpoint.
            model_config = (drafter.config if drafter else self.vllm_config).model_config
            model_config.model = directory
            if hasattr(model_config, "model_weights"):
                model_config.model_weights = ""
            model_config.revision = None
            self._refit_reload(drafter, weights_iterator=_held_tensors(staged))
            return "memory", time.perf_counter() - started
        staged.release()
        self._refit_reload(drafter, weights_path=directory)
        seconds = time.perf_counter() - started
        staged.check_after_load()  # LoadFailed: the model was touched
        return "disk", seconds

    def _refit_reload(self, drafter: Drafter | None = None, **source: Any) -> None:
        """vLLM's reload into the target, or into `drafter`'s model (refit_worker.drafter:
        vLLM's reload_weights never loads a drafter)."""
        try:
            if drafter is None:
                self.reload_weights(is_checkpoint_format=True, **source)  # type: ignore[attr-defined]
            else:
                reload_drafter(self.vllm_config, drafter, **source)
        except Exception as exc:
            raise RefitRejected("LoadFailed", f"{type(exc).__name__}: {exc}") from exc

    # --- RPC methods (contract.RPC_*) ---
    @peers.collective
    def refit_info(self) -> dict[str, Any]:
        import vllm
        from vllm import envs

        from refit_worker import backports
        from refit_worker.backports import unsafe

        cfg = self.vllm_config
        caps = [*backports.capabilities(), CAP_VERIFIED_RELOAD]
        if guard.guard_configured():
            caps += [CAP_ADMIN_GUARD, CAP_ERRORS_KEEP_CONNECTION]
        backends = sorted(
            {
                m.attn_backend.get_name()
                for m in self._refit_model().modules()
                if getattr(m, "attn_backend", None) is not None
            }
        )
        drafter = self._refit_drafter()
        refitted = drafter.method if drafter is not None else ""
        info = RefitInfo(
            vllm_version=str(vllm.__version__),
            attention_backend=",".join(backends) or "unknown",
            kv_cache_dtype=str(cfg.cache_config.cache_dtype),
            cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
            capabilities=tuple(dict.fromkeys(caps)),
            unsafe_reasons=tuple(
                backports.unsafe_reasons(cfg, model=self._refit_model(), refitted_drafter=refitted)
            ),
            weight_version=getattr(self, "_refit_version", DEFAULT_VERSION),
            model=str(cfg.model_config.model),
            allowed_root=self._refit_allowed_root(),
            kv_cache_scales=unsafe.kv_cache_scales(cfg, self._refit_model()),
            tensor_parallel_size=int(cfg.parallel_config.tensor_parallel_size),
            pipeline_parallel_size=int(cfg.parallel_config.pipeline_parallel_size),
            data_parallel_size=int(cfg.parallel_config.data_parallel_size),
            max_lora_rank=int(cfg.lora_config.max_lora_rank) if cfg.lora_config else 0,
            runtime_lora_updating=bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING),
            drafter=refitted,
            vocab_size=int(cfg.model_config.get_vocab_size()),
            max_model_len=int(cfg.model_config.max_model_len),
        )
        return info.to_json_dict()

    @peers.collective
    def refit_preflight(self, path: str) -> dict[str, Any]:
        return self._refit_check(path)

    @peers.collective
    def refit_stage(self, path: str) -> dict[str, Any]:
        """Preflight, then stage the checkpoint (and its drafter's) for refit_load (see the
        module docstring). Staging the staged path again, unchanged, returns at the cost of
        a few stats."""
        started = time.perf_counter()
        # The budget is the pod's (REFIT_STAGING_BUDGET_BYTES): each of its workers stages
        # the whole checkpoint, so each gets its share and the pod never holds more.
        budget = checkpoint.staging_budget() // self._refit_pod_workers()
        previous = getattr(self, "_refit_staged", None)
        previous_drafter = getattr(self, "_refit_staged_drafter", None)
        self._refit_staged = self._refit_staged_drafter = None
        drafter_dir = self._refit_drafter_directory(path)  # DrafterMissing before any hashing
        staged = checkpoint.stage_checkpoint(
            path, self._refit_allowed_root(), budget, previous=previous
        )
        try:
            if not staged.reused:
                staged.summary = self._refit_check_model(staged.directory, staged.manifest, started)
            if drafter_dir is not None:
                self._refit_staged_drafter = self._refit_stage_drafter(
                    drafter_dir, staged, previous_drafter, started
                )
        except BaseException:
            staged.release()
            raise
        self._refit_staged = staged
        result = {
            **staged.summary,
            "seconds": round(time.perf_counter() - started, 4),
            "staged": staged.mode,
            "budgetBytes": staged.budget,  # this worker's share of the pod's budget
            "podWorkers": self._refit_pod_workers(),
            "note": staged.note(),
        }
        if self._refit_staged_drafter is not None:
            one = self._refit_staged_drafter
            result["drafter"] = {**one.summary, "staged": one.mode, "note": one.note()}
        return result

    def _refit_stage_drafter(
        self,
        directory: Path,
        target: checkpoint.StagedCheckpoint,
        previous: checkpoint.StagedCheckpoint | None,
        started: float,
    ) -> checkpoint.StagedCheckpoint:
        """Stage the drafter's checkpoint as the target's, within what the target left of
        this worker's budget (the drafter is part of the checkpoint the budget is for)."""
        budget = target.budget - (target.total_bytes if target.in_memory else 0)
        staged = checkpoint.stage_checkpoint(
            str(directory), self._refit_allowed_root(), budget, previous=previous
        )
        if not staged.reused:
            try:
                staged.summary = self._refit_check_model(
                    staged.directory, staged.manifest, started, drafter=self._refit_drafter()
                )
            except BaseException:
                staged.release()
                raise
        return staged

    @peers.collective
    def refit_load(self, path: str, version: str) -> dict[str, Any]:
        # Invariant: nothing below raises a code other than LoadFailed once reload_weights
        # has been called (module docstring); every other refusal comes first.
        staged = self._refit_take_staged(path)
        try:
            started = time.perf_counter()
            refusal: Exception | None = None
            result: dict[str, Any] = {}
            try:
                if not isinstance(version, str) or not version:
                    raise RefitRejected("LoadFailed", "version must be a non-empty string")
                if staged:
                    for one in staged:  # CheckpointChanged
                        one.check_before_load(self._refit_allowed_root())
                    seconds = round(time.perf_counter() - started, 4)
                    result = {**staged[0].summary, "seconds": seconds}
                    if len(staged) > 1:
                        result["drafter"] = dict(staged[1].summary)
                else:
                    result = self._refit_check(path)
            except Exception as exc:  # whatever it is, the other workers must hear of it
                refusal = exc
            # One worker's refusal refuses every worker, before any loads (refit_worker.peers).
            refusal = peers.exchange(refusal)
            if refusal is not None:
                raise refusal
            switched = self._refit_switch_load_format()
            source, load_seconds = self._refit_load_checked(result, staged)
        finally:
            for one in staged:
                one.release()
        self._refit_version = version
        return {
            **result,
            "version": version,
            "loadSeconds": round(load_seconds, 4),
            "switchedLoadFormatFrom": switched,
            "source": source,
        }

    def _refit_load_checked(
        self, result: dict[str, Any], staged: list[checkpoint.StagedCheckpoint]
    ) -> tuple[str, float]:
        """Load what refit_load checked: the target, then its drafter (after the load format
        switch: the drafter's load config is read now). Returns the target's (source, seconds
        of the reload); the drafter's go into result["drafter"]."""
        drafter = self._refit_drafter()
        if staged:
            source, seconds = self._refit_load_staged(staged[0])
            if drafter is not None:
                drafter_source, drafter_seconds = self._refit_load_staged(staged[1], drafter)
                result["drafter"].update(
                    source=drafter_source, loadSeconds=round(drafter_seconds, 4)
                )
            return source, seconds
        started = time.perf_counter()
        self._refit_reload(weights_path=result["path"])
        seconds = time.perf_counter() - started
        if drafter is not None:
            self._refit_reload(drafter, weights_path=result["drafter"]["path"])
            result["drafter"].update(
                source="unstaged", loadSeconds=round(time.perf_counter() - started - seconds, 4)
            )
        return "unstaged", seconds

    @peers.collective
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

    def refit_adapter_check(self, path: str) -> dict[str, Any]:
        """A LoRA adapter directory before vLLM loads it: the checkpoint's path, manifest and
        digest checks (vLLM loads a flipped byte without a word), a PEFT LoRA config, and that
        it fits this engine (refit_worker.lora_adapter.check_adapter: rank, target modules,
        their sizes)."""
        started = time.perf_counter()
        directory, manifest = checkpoint.verify_checkpoint(path, self._refit_allowed_root())
        lora = self.vllm_config.lora_config
        fit = check_adapter(
            directory,
            manifest.tensors,
            max_rank=int(lora.max_lora_rank) if lora else 0,
            modules=self._refit_lora_modules(),
        )
        return {
            **fit,
            "path": str(directory),
            "files": len(manifest.files),
            "bytes": sum(f.size for f in manifest.files),
            "tensors": len(manifest.tensors),
            "seconds": round(time.perf_counter() - started, 4),
        }

    def _refit_lora_modules(self) -> dict[str, Sizes]:
        """The modules a LoRA may target in this engine, as vLLM's _load_adapter expects them
        (vllm/lora/worker_manager.py: supported_lora_modules, a packed module expanded into its
        parts by packed_modules_mapping), each with its unsharded (input, output) features
        where every module of that name agrees; {} without LoRA (nothing to check against)."""
        runner_manager = getattr(self.model_runner, "lora_manager", None)
        manager = getattr(runner_manager, "_adapter_manager", None)
        if manager is None:
            return {}
        packed = dict(manager.packed_modules_mapping)
        sizes: dict[str, set[Sizes]] = {}

        def seen(name: str, size: Sizes) -> None:
            sizes.setdefault(name, set()).add(size)

        for full, module in self._refit_model().named_modules():
            layer = getattr(module, "base_layer", module)  # vLLM's *WithLoRA wraps the layer
            name = full.rsplit(".", 1)[-1]
            if name not in manager.supported_lora_modules or full.endswith(".base_layer"):
                continue
            in_size = getattr(layer, "input_size", None)
            out_size = getattr(layer, "output_size", None)
            parts = packed.get(name)
            if not parts:
                seen(name, (in_size, out_size))
                continue
            out_sizes = list(getattr(layer, "output_sizes", None) or [])
            # KV heads replicated across tensor-parallel ranks inflate output_sizes' k and v.
            exact = len(out_sizes) == len(parts) and getattr(layer, "num_kv_head_replicas", 1) == 1
            for i, part in enumerate(parts):
                seen(part, (in_size, out_sizes[i] if exact else None))
        expected: dict[str, Sizes] = {}
        for module in manager.supported_lora_modules:
            for part in packed.get(module) or [module]:
                expected[part] = (None, None)
            if module == "experts":
                expected[module] = (None, None)
        for name, found in sizes.items():
            if name in expected and len(found) == 1:  # one size across the layers: checkable
                ((in_size, out_size),) = found
                expected[name] = (_features(in_size), _features(out_size))
        return expected

    def refit_buffer_digests(self) -> dict[str, Any]:
        """The read-back's other half (contract.RPC_BUFFER_DIGESTS): vLLM's /weight_checker
        hashes parameters only, and a buffer that is not one (a routing bias, a rotary
        cache, a scale) is exactly what a load path can skip. Same keys and bytes as vLLM's
        digests (the worker's rank prefix, SHA-256 of the tensor's raw bytes)."""
        import hashlib

        import torch

        prefix = str(self._weight_checksum_prefix())  # type: ignore[attr-defined]
        buffers = {
            prefix + name: hashlib.sha256(
                buf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for name, buf in self._refit_model().named_buffers()
        }
        dtype = str(self.vllm_config.model_config.dtype).removeprefix("torch.")
        return {"dtype": dtype, "buffers": buffers}

    # --- Broadcast refits (docs/broadcast.md) ---
    @peers.collective
    def refit_received(self, digest: str = "", version: str = "") -> dict[str, Any]:
        """The last broadcast this worker's refit-gloo engine received: the manifest of what
        arrived, its digest, timings, and whether it was loaded. Raises the round's refusal
        again (TransferMismatch, TransferFailed, ManifestInvalid, TensorMismatch, LoadFailed)
        and TransferMismatch when the loaded digest is not `digest` (when given). `version`,
        once the check passes, becomes this worker's weight version (refit_info), as
        refit_load records its own."""
        from refit_worker.broadcast.gloo_engine import GlooWeightTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, GlooWeightTransferEngine):
            raise RefitRejected(
                "TransferFailed",
                "this server runs no refit-gloo weight transfer engine "
                """(--weight-transfer-config '{"backend": "refit-gloo"}')""",
            )
        result = engine.received(digest)
        if version:
            self._refit_version = version
        return {**result, "version": getattr(self, "_refit_version", DEFAULT_VERSION)}
