"""The fleet's preflight, and the inputs it reads: before a refit touches any pod, every pod
answers refit_info and /get_world_size, the probe reference is read and scored on one pod, and
a broadcast's transfer manifest is read and checked against the spec (decision.decide judges
the answers, core/admission the rules). The Secrets, the reference and the manifest are read
again by the first tick that starts a pass after a restart, where no preflight runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from refit_worker.contract import ContractError, ProbeReference, RefitInfo, TransferManifest

from ..core import admission, probe
from ..core.admission import PreflightResult
from ..core.api import WeightRefitSpec
from ..core.podview import PodView
from ..core.reasons import Problem, Reason
from ..edges.cluster import AccessDenied, Kube
from ..edges.worker_client import WorkerClient, WorkerError
from .pass_context import BroadcastSource
from .refit_state import Tick
from .rounds import Rounds

log = logging.getLogger(__name__)

PREFLIGHT_CONCURRENCY = 64


async def adapter_admission(
    client: WorkerClient,
    spec: WeightRefitSpec,
    pod: PodView,
    t_step: float,
    *,
    unreachable: bool = True,
) -> Problem | None:
    """Whether ``pod`` may take the refit's adapter, asked before it leaves traffic: the
    worker's refit_adapter_check (path rules, manifest and digests, a PEFT LoRA config vLLM
    serves, a rank within --max-lora-rank, target modules the served model has, matrices of its
    sizes), then the name against the models the pod serves (admission.adapter_name_problem).
    A refusal is the pod's problem, named; a pod that does not answer is PodUnreachable
    (``unreachable``; else None: the pass meets it again in its first step, with retries)."""
    adapter = spec.adapter
    assert adapter is not None
    try:
        await client.adapter_check(adapter.path, timeout=t_step)
        served = await client.served_models(timeout=t_step)
    except WorkerError as e:
        if e.kind == "rejected" and e.code:
            return Problem(e.code, f"pod {pod.name}: adapter {adapter.path}: {e.message}")
        if not unreachable:
            return None
        return Problem(
            Reason.PodUnreachable, f"pod {pod.name}: checking the adapter failed: {e.message}"
        )
    problem = admission.adapter_name_problem(
        adapter.name, served, ours=adapter.name in pod.adapter_records
    )
    if problem is not None:
        return Problem(problem.reason, f"pod {pod.name}: {problem.message}")
    return None


class Preflight:
    """The preflight of the engine's refits, over its cluster and its pods' clients."""

    def __init__(self, cluster: Kube, client: Callable[[Tick, PodView], WorkerClient]) -> None:
        self.cluster = cluster
        self.client = client

    async def run(self, t: Tick) -> PreflightResult:
        spec, pods = t.view.spec, t.state.listing.pods
        if admission.fleet_problem(pods) is not None:
            # decide() reports it. Nothing is sent to any pod: the admin token goes in clear
            # to a pod's IP, and only to pods the Pod objects vouch for (PodView.vetted).
            return PreflightResult()
        problem = await self.load_secrets(t)
        if problem is not None:
            return PreflightResult(problem=problem)
        reachable = sorted(pods, key=lambda p: p.name)
        sem = asyncio.Semaphore(PREFLIGHT_CONCURRENCY)
        t_step = float(spec.sequence.step_timeout_seconds)

        async def each(ask: Callable[[WorkerClient], Awaitable[Any]], what: str) -> dict[str, Any]:
            """Every reachable pod's answer, or why it gave none (a str)."""

            async def one(pod: PodView) -> Any:
                async with sem:
                    try:
                        return await ask(self.client(t, pod))
                    except WorkerError as e:
                        return f"{what} failed ({e.kind}): {e.message}"

            answers = await asyncio.gather(*map(one, reachable))
            return dict(zip([p.name for p in reachable], answers, strict=True))

        infos: dict[str, RefitInfo | str] = await each(
            lambda c: c.refit_info(timeout=t_step), "refit_info"
        )
        identity = {p.name: (p.uid, p.restarts) for p in reachable}
        passes = t.state.passes
        unsafe, level, adapter = (
            spec.allow_unsafe_backends, spec.sequence.sleep_level, spec.adapter is not None
        )  # fmt: skip
        passes.admitted = {
            name: identity[name]
            for name, info in infos.items()
            if admission.admission_problem(info, unsafe, level, adapter=adapter) is None
        }
        problem = None
        known = {name: info for name, info in infos.items() if isinstance(info, RefitInfo)}
        passes.lora = {name for name, info in known.items() if info.max_lora_rank > 0}
        passes.drafters = {name: info.drafter for name, info in known.items() if info.drafter}
        if len(passes.admitted) == len(reachable):  # else decide() refuses a pod already
            if spec.adapter is not None:
                problem = await self.check_adapter(t, reachable)
            if problem is None:
                problem = await self.check_reference(t, reachable)
        if spec.broadcast is not None and problem is None:
            problem = await self.load_broadcast(t)
        # Every refit: a pod whose workers the calls do not all reach is refused
        # (admission.reach_problem); a broadcast also ranks each pod by this count.
        world_sizes: dict[str, int | str] = await each(
            lambda c: c.world_size(timeout=t_step), "get_world_size"
        )
        return PreflightResult(infos=infos, problem=problem, world_sizes=world_sizes)

    async def check_adapter(self, t: Tick, pods: list[PodView]) -> Problem | None:
        """An adapter refit's adapter, checked on every pod before any pod is touched
        (adapter_admission); the first pod's problem by name, or None. Adapters are small:
        every pod verifies the files it would load."""
        sem = asyncio.Semaphore(PREFLIGHT_CONCURRENCY)
        t_step = float(t.view.spec.sequence.step_timeout_seconds)

        async def one(pod: PodView) -> Problem | None:
            async with sem:
                return await adapter_admission(self.client(t, pod), t.view.spec, pod, t_step)

        problems = await asyncio.gather(*map(one, pods))
        return next((p for p in problems if p is not None), None)

    async def check_reference(self, t: Tick, pods: list[PodView]) -> Problem | None:
        """Fetch the probe reference and score it on one pod (one request for all prompts): a
        reference the model cannot score fails the refit before any pod is touched. Scored on
        a pod that serves (admission.reference_scorers); when every pod may be paused by an
        earlier failed pass, each pod's probe scores it after its pass resumed the pod."""
        view = t.view
        scorers = admission.reference_scorers(pods)
        pod = scorers[0] if scorers else pods[0]
        client = self.client(t, pod)
        try:
            reference = await self.reference(t, view.spec.path, client)
        except probe.ReferenceMismatch as e:
            return Problem(e.reason, str(e))
        except (WorkerError, ContractError, ValueError, AccessDenied) as e:
            return Problem(Reason.ReferenceInvalid, f"probe reference unusable: {e}")
        if not scorers:
            log.info(
                "%s/%s: every pod may be paused by an earlier failed pass; the reference is "
                "scored by each pod's probe", view.namespace, view.name,
            )  # fmt: skip
            return None
        try:
            await client.score_prompts(
                [list(p.token_ids) for p in reference.prompts],
                timeout=float(view.spec.sequence.probe_timeout_seconds),
                batch=pod.name not in t.state.passes.lora,
            )
        except WorkerError as e:
            if e.kind == "http" and e.status in (401, 403):
                return Problem(
                    Reason.ProbeUnauthorized,
                    f"pod {pod.name} refused the probe's /v1 request (HTTP {e.status}): set "
                    "spec.fleet.apiKeySecretRef to the Secret holding the pods' --api-key",
                )
            if e.kind == "http" and e.status is not None and 400 <= e.status < 500:
                return Problem(
                    Reason.ReferenceUnscorable,
                    f"pod {pod.name} cannot score the reference: {e.message}",
                )
            return Problem(Reason.PodUnreachable, f"pod {pod.name}: scoring failed: {e.message}")
        return None

    async def reference(self, t: Tick, path: str, client: WorkerClient) -> ProbeReference:
        view, references = t.view, t.state.references
        if path in references:
            return references[path]
        src = view.spec.probe.reference
        # A rollback probes the previous checkpoint against its own reference file.
        if src.source == "ConfigMap" and src.config_map_ref and path == view.spec.path:
            cm = src.config_map_ref
            text = await self.cluster.read_key("ConfigMap", view.namespace, cm.name, cm.key)
            if text is None:
                raise ValueError(f"ConfigMap {cm.name} has no key {cm.key!r}")
            reference = ProbeReference.from_json_dict(json.loads(text))
            # Before it is kept: every read of it is checked, the preflight's and a pass's
            # after an operator restart (the ConfigMap may have been rewritten meanwhile).
            probe.check_reference_version(
                reference, view.spec.version, f"ConfigMap {cm.name} key {cm.key!r}"
            )
        else:
            reference = await client.probe_reference(
                path, timeout=float(view.spec.sequence.step_timeout_seconds)
            )
        references[path] = reference
        return reference

    async def load_broadcast(self, t: Tick) -> Problem | None:
        """Read the trainer's transfer manifest from its ConfigMap and check it against the
        spec's digest, before any pod is touched; a problem or None."""
        view, st = t.view, t.state
        b = view.spec.broadcast
        assert b is not None
        ref = b.manifest.config_map_ref
        text = await self._read_key(
            "ConfigMap", view.namespace, ref.name, ref.key,
            missing=Reason.ManifestMissing, forbidden=Reason.ManifestForbidden,
        )  # fmt: skip
        if isinstance(text, Problem):
            return text
        try:
            manifest = TransferManifest.from_json_dict(json.loads(text))
        except (ValueError, ContractError) as e:
            return Problem(Reason.ManifestInvalid, f"ConfigMap {ref.name} key {ref.key!r}: {e}")
        if manifest.digest != b.manifest.digest:
            return Problem(
                Reason.ManifestMismatch,
                f"ConfigMap {ref.name} holds the manifest {manifest.digest}, not "
                f"spec.broadcast.manifest.digest {b.manifest.digest}",
            )
        shown = view.status.broadcast.round if view.status.broadcast is not None else 0
        rounds = Rounds(shown, st.wake.set)
        st.broadcast = BroadcastSource(b, manifest.to_json_dict(), rounds)
        return None

    async def load_secrets(self, t: Tick) -> Problem | None:
        """Read the admin token and the /v1 API key the spec names; a problem or None."""
        secrets, fleet = t.state.secrets, t.view.spec.fleet
        for ref, attr in ((fleet.admin_token_secret_ref, "token"),
                          (fleet.api_key_secret_ref, "api_key")):  # fmt: skip
            if ref is None:
                continue
            value = await self._read_key(
                "Secret", t.namespace, ref.name, ref.key,
                missing=Reason.SecretMissing, forbidden=Reason.SecretForbidden,
            )  # fmt: skip
            if isinstance(value, Problem):
                return value
            setattr(secrets, attr, value)
        secrets.loaded = True
        return None

    async def _read_key(
        self,
        kind: str,
        namespace: str,
        name: str,
        key: str,
        *,
        missing: Reason,
        forbidden: Reason,
    ) -> str | Problem:
        """A Secret's or ConfigMap's value, or the problem: ``forbidden`` when RBAC forbids
        the read, ``missing`` when the object or key is absent."""
        try:
            value = await self.cluster.read_key(kind, namespace, name, key)
        except AccessDenied as e:
            return Problem(forbidden, str(e))
        if value is None:
            return Problem(missing, f"{kind} {name} has no key {key!r}")
        return value
