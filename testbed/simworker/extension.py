"""The refit_worker plugin's routes, answered as the real plugin answers them:
``/refit/ready`` (the readiness mark a pass vouches for) and ``/collective_rpc`` with the
extension's ``refit_info``, ``refit_preflight``, ``refit_stage``, ``refit_load``,
``refit_probe_reference``, ``refit_buffer_digests`` and ``refit_adapter_check``. The
handlers are methods of :class:`ExtensionRoutes`, a part of SimServer (``on_<step>``, as
:class:`testbed.simworker.routes.VllmRoutes`'s).

Checkpoints (the simulated model's: testbed.simworker.model)
    Preflight and load verify the directory with refit_worker's own checkpoint module and
    refuse like the real extension (HTTP 500 whose body carries
    ``refit-rejected: <Code>: <detail>``). ``refit_stage`` stages with the same module
    (checkpoint.stage_checkpoint: the bytes held within the staging budget, every file's
    identity recorded), so ``refit_load`` of the staged path refuses ``CheckpointChanged``
    when a file changed since and loads from the held bytes (``source: "memory"``), from
    disk over the budget (``"disk"``), or after a full check when the path is not staged
    (``"unstaged"``). The budget is the subprocess's ``REFIT_STAGING_BUDGET_BYTES`` (inherited
    from the process that starts the fleet), or per pod ``set_state(staging_budget="1Mi")``
    (the variable's text; None: the environment again). A restart forgets what was staged.

Adapters
    ``refit_adapter_check`` verifies the directory with refit_worker's own checks and
    refuses like the real extension (PathNotAllowed, CheckpointMissing, ManifestMismatch,
    ..., AdapterInvalid for a config that is not a PEFT LoRA one; AdapterRankTooHigh,
    AdapterModulesUnknown and AdapterBaseMismatch against max_lora_rank and
    SIM_LORA_MODULES). Loading one is vLLM's route: testbed.simworker.routes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from refit_worker import contract, readiness
from refit_worker.checkpoint import (
    STAGING_BUDGET_ENV,
    load_manifest,
    parse_staging_budget,
    resolve_under_root,
    stage_checkpoint,
    verify_checkpoint,
    verify_params,
)
from refit_worker.drafter import drafter_directory
from refit_worker.lora_adapter import check_adapter

from testbed.simworker.errors import rpc_failure
from testbed.simworker.model import (
    SIM_BUFFER,
    SIM_LORA_MODULES,
    SIM_MAX_MODEL_LEN,
    SIM_MODEL_ROOT,
    SIM_PARAMS,
    SIM_RANK_PREFIX,
    SIM_VLLM_VERSION,
    SIM_WEIGHTS_FILE,
    read_sim_weights,
    sim_weights,
)
from testbed.simworker.pod import PodState


class ExtensionRoutes:
    """The refit_worker plugin's routes: ``on_<step>(request, pod, body, fault)`` answers one
    call to ``pod`` (an RPC's step is its method's name)."""

    vocab: int  # the server's (refit_info reports it)

    async def on_refit_ready(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        if request.method == "POST":  # a pass vouches (admitted by the guard's rules above)
            raw = await request.read()
            try:
                version = readiness.parse_vouch(raw)
            except readiness.VouchError as exc:
                return web.json_response(
                    readiness.vouch_error_body(str(exc)), status=readiness.BAD_REQUEST_STATUS
                )
            try:
                answer = pod.ready_mark.vouch(version, readiness.vouched_process(raw))
            except readiness.VouchRefused as exc:
                return web.json_response(
                    readiness.vouch_refused_body(str(exc)),
                    status=readiness.PROCESS_CHANGED_STATUS,
                )
            return web.json_response(answer)
        status, answer = pod.ready_mark.answer()
        return web.json_response(answer, status=status)

    async def _rpc(
        self, request: web.Request, pod: PodState, body: Any, fn: Callable[..., Any]
    ) -> web.Response:
        args = body.get("args") or []
        kwargs = body.get("kwargs") or {}
        try:
            result = fn(pod, *args, **kwargs)
        except contract.RefitRejected as exc:
            return rpc_failure(request, str(exc))
        except (TypeError, ValueError) as exc:  # a bad argument, a malformed staging budget
            return rpc_failure(request, str(exc))
        return web.json_response({"results": [result]})

    async def on_refit_info(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def info(pod: PodState) -> dict[str, Any]:
            caps = pod.reported_capabilities()
            version = pod.loaded_version
            if fault is not None and fault.kind == "wrong_version":
                version = str(fault.value or "sim-wrong-version")
            return contract.RefitInfo(
                vllm_version=SIM_VLLM_VERSION,
                attention_backend="CPU_ATTN",
                kv_cache_dtype="auto",
                cudagraph_mode="NONE",
                capabilities=tuple(caps),
                unsafe_reasons=tuple(pod.unsafe_reasons),
                weight_version=version,
                model=SIM_MODEL_ROOT,
                allowed_root=pod.allowed_root,
                tensor_parallel_size=pod.tensor_parallel_size,
                max_lora_rank=pod.max_lora_rank,
                runtime_lora_updating=pod.runtime_lora_updating,
                drafter=pod.drafter,
                vocab_size=self.vocab,
                max_model_len=SIM_MAX_MODEL_LEN,
            ).to_json_dict()

        return await self._rpc(request, pod, body, info)

    async def on_refit_preflight(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        return await self._rpc(request, pod, body, self._preflight)

    def _preflight(self, pod: PodState, path: str) -> dict[str, Any]:
        drafter = self._drafter(pod, path)  # DrafterMissing before any hashing
        directory, manifest = verify_checkpoint(path, pod.allowed_root)
        verify_params(manifest.tensors, SIM_PARAMS)
        checked = self._checked(directory, manifest)
        return checked if drafter is None else {**checked, "drafter": {"path": str(drafter)}}

    @staticmethod
    def _drafter(pod: PodState, path: str) -> Path | None:
        """The drafter's checkpoint under ``path``, verified as the target's, when the pod runs
        a drafter the worker refits (None otherwise); DrafterMissing without one, as the real
        extension refuses it: before either model is touched. (Read from disk at the load:
        the simulator stages only the target's bytes.)"""
        if not pod.drafter:
            return None
        sub = drafter_directory(resolve_under_root(path, pod.allowed_root))
        directory, manifest = verify_checkpoint(str(sub), pod.allowed_root)
        verify_params(manifest.tensors, SIM_PARAMS)
        return directory

    @staticmethod
    def _checked(directory: Path, manifest: contract.Manifest) -> dict[str, Any]:
        return {  # the keys refit_worker.extension answers with
            "path": str(directory),
            "files": len(manifest.files),
            "bytes": sum(f.size for f in manifest.files),
            "tensors": len(manifest.tensors),
            "parameters": len(SIM_PARAMS),
            "shapesChecked": True,
            "tensorParallelSize": 1,
            "seconds": 0.0,
        }

    async def on_refit_adapter_check(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def check(pod: PodState, path: str) -> dict[str, Any]:
            directory, manifest = verify_checkpoint(path, pod.allowed_root)
            fit = check_adapter(  # the extension's own check, over the simulated engine
                directory,
                manifest.tensors,
                max_rank=pod.max_lora_rank,
                modules=SIM_LORA_MODULES if pod.max_lora_rank else {},
            )
            return {  # the keys refit_worker.extension answers with
                **fit,
                "path": str(directory),
                "files": len(manifest.files),
                "bytes": sum(f.size for f in manifest.files),
                "tensors": len(manifest.tensors),
                "seconds": 0.0,
            }

        return await self._rpc(request, pod, body, check)

    async def on_refit_stage(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def stage(pod: PodState, path: str) -> dict[str, Any]:
            text = pod.staging_budget
            budget = parse_staging_budget(
                text if text is not None else os.environ.get(STAGING_BUDGET_ENV)
            )
            self._drafter(pod, path)  # refused before anything is staged
            previous, pod.staged = pod.staged, None
            staged = stage_checkpoint(path, pod.allowed_root, budget, previous=previous)
            if not staged.reused:
                try:
                    verify_params(staged.manifest.tensors, SIM_PARAMS)
                except contract.RefitRejected:
                    staged.release()
                    raise
                staged.summary = self._checked(staged.directory, staged.manifest)
            pod.staged = staged
            return {
                **staged.summary,
                "staged": staged.mode,
                "budgetBytes": staged.budget,
                "podWorkers": 1,  # one simulated worker: the whole budget is its share
                "note": staged.note(),
            }

        return await self._rpc(request, pod, body, stage)

    async def on_refit_load(self, request: web.Request, pod: PodState, body: Any, fault: Any):
        def load(pod: PodState, path: str, version: str) -> dict[str, Any]:
            # As the real extension: any load releases what was staged; only LoadFailed
            # comes after the (simulated) model was touched.
            staged, pod.staged = pod.staged, None
            if staged is not None and staged.path != path:
                staged.release()
                staged = None
            try:
                if not isinstance(version, str) or not version:
                    raise contract.RefitRejected("LoadFailed", "version must be a non-empty string")
                drafter = self._drafter(pod, path)  # before either model is touched
                if staged is None:
                    checked = self._preflight(pod, path)
                    pod.seed, pod.drift = read_sim_weights(Path(checked["path"]))
                    source = "unstaged"
                else:
                    staged.check_before_load(pod.allowed_root)
                    checked = staged.summary
                    if staged.in_memory:
                        data = dict(staged.take_shards())[SIM_WEIGHTS_FILE]
                        header_len = int.from_bytes(data[:8], "little")
                        pod.seed, pod.drift = sim_weights(data[8 : 8 + header_len])
                        source = "memory"
                    else:
                        pod.seed, pod.drift = read_sim_weights(staged.directory)
                        source = "disk"
                        try:
                            staged.check_after_load()
                        except contract.RefitRejected:
                            pod.weights_discarded = True  # mixed bytes: garbage scores
                            raise
            finally:
                if staged is not None:
                    staged.release()
            pod.loaded_version, pod.loaded_path = version, path
            pod.weights_discarded = False
            if drafter is not None:  # the drafter is reloaded right after its target
                pod.drafter_seed = read_sim_weights(drafter)[0]
            # A dummy-started vLLM switches its load format on the first load from disk.
            switched, pod.load_format = (pod.load_format, "safetensors")
            return {
                **checked,
                "version": version,
                "loadSeconds": 0.0,
                "switchedLoadFormatFrom": switched if switched != "safetensors" else None,
                "source": source,
            }

        return await self._rpc(request, pod, body, load)

    async def on_refit_probe_reference(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def reference(pod: PodState, path: str) -> dict[str, Any]:
            directory = resolve_under_root(path, pod.allowed_root)
            load_manifest(directory)
            try:
                doc = json.loads((directory / contract.PROBE_FILE).read_text())
                return contract.ProbeReference.from_json_dict(doc).to_json_dict()
            except (OSError, ValueError) as exc:  # ContractError is a ValueError
                raise contract.RefitRejected("ProbeReferenceInvalid", str(exc)) from None

        return await self._rpc(request, pod, body, reference)

    async def on_refit_buffer_digests(
        self, request: web.Request, pod: PodState, body: Any, fault: Any
    ):
        def digests(pod: PodState) -> dict[str, Any]:
            held = "rotary" if fault is None else f"rotary|skew:{fault.value}"
            digest = hashlib.sha256(held.encode()).hexdigest()
            return {"dtype": "float32", "buffers": {SIM_RANK_PREFIX + SIM_BUFFER: digest}}

        return await self._rpc(request, pod, body, digests)
