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
from collections.abc import Callable

from refit_worker.contract import ContractError, ProbeReference, RefitInfo

from ..core import admission, preflight_cache, probe
from ..core.admission import PreflightResult
from ..core.podview import PodView
from ..core.reasons import Problem, Reason
from ..edges.cluster import AccessDenied, Kube
from ..edges.worker_client import WorkerClient, WorkerError
from . import inputs
from .refit_state import Tick
from .sources import source_for

log = logging.getLogger(__name__)

PREFLIGHT_CONCURRENCY = 64


class Preflight:
    """The preflight of the engine's refits, over its cluster and its pods' clients."""

    def __init__(self, cluster: Kube, client: Callable[[Tick, PodView], WorkerClient]) -> None:
        self.cluster = cluster
        self.client = client
        # Per fleet, across refits: each pod's answers while its process is the same one.
        self.fleets = preflight_cache.Fleets()

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
        # Answers of an earlier preflight of the fleet, of each pod's process now, are not
        # asked again (core/preflight_cache.py): a refit of an unchanged fleet sends none.
        kept = self.answers(t)
        asked = [p for p in reachable if kept.get(p) is None]

        async def ask(pod: PodView) -> tuple[RefitInfo | str, int | str]:
            """The pod's refit_info and /get_world_size, or why it gave none (a str). Every
            pod is asked both: a pod whose workers the calls do not all reach is refused
            (admission.reach_problem), and a broadcast ranks each pod by the count."""
            async with sem:
                client = self.client(t, pod)
                info: RefitInfo | str
                size: int | str
                try:
                    info = await client.refit_info(timeout=t_step)
                    kept.saw_info(pod, info)
                except WorkerError as e:
                    info = f"refit_info failed ({e.kind}): {e.message}"
                try:
                    size = await client.world_size(timeout=t_step)
                    kept.saw_world_size(pod, size)
                except WorkerError as e:
                    size = f"get_world_size failed ({e.kind}): {e.message}"
                return info, size

        fresh = dict(zip([p.name for p in asked], await asyncio.gather(*map(ask, asked)),
                         strict=True))  # fmt: skip
        infos: dict[str, RefitInfo | str] = {}
        world_sizes: dict[str, int | str] = {}
        for pod in reachable:
            hit = kept.get(pod) if pod.name not in fresh else None
            if hit is not None and hit.world_size is not None:
                infos[pod.name], world_sizes[pod.name] = hit.info, hit.world_size
            else:
                infos[pod.name], world_sizes[pod.name] = fresh[pod.name]
        passes = t.state.passes
        source = source_for(spec)
        unsafe, level, adapter = (
            spec.allow_unsafe_backends, spec.sequence.sleep_level, not source.flow.reloads
        )  # fmt: skip
        passes.admitted = preflight_cache.admitted_identities(
            reachable,
            [name for name, info in infos.items()
             if admission.admission_problem(info, unsafe, level, adapter=adapter) is None],
        )  # fmt: skip
        problem = None
        known = {name: info for name, info in infos.items() if isinstance(info, RefitInfo)}
        passes.lora = {name for name, info in known.items() if info.max_lora_rank > 0}
        passes.drafters = {name: info.drafter for name, info in known.items() if info.drafter}
        if len(passes.admitted) == len(reachable):  # else decide() refuses a pod already
            # What the refit's source reads (an adapter's files, a broadcast's manifest).
            problem = await source.check(
                t, reachable, self.cluster, lambda pod: self.client(t, pod)
            )
            if problem is None:
                problem = await self.check_reference(t, reachable, kept)
        return PreflightResult(infos=infos, problem=problem, world_sizes=world_sizes)

    def answers(self, t: Tick) -> preflight_cache.FleetAnswers:
        """What earlier preflights of the refit's fleet kept, down to the pods listed now: the
        preflight's, and a late pod's admission (pod_pass), take their answers from it."""
        return self.fleets.of(_fleet_key(t), t.state.listing.pods)

    def of_process(self, t: Tick, pod: PodView) -> preflight_cache.PodAnswers | None:
        """What the pod's process now answered, if a preflight or admission kept it (no
        pruning: one lookup)."""
        kept = self.fleets.peek(_fleet_key(t))
        return kept.of_process(pod) if kept is not None else None

    async def check_reference(
        self, t: Tick, pods: list[PodView], kept: preflight_cache.FleetAnswers
    ) -> Problem | None:
        """Fetch the probe reference and check that the model scores it: a reference the
        model cannot score fails the refit before any pod is touched. Scored on one pod (one
        request for all prompts), a pod that serves (admission.reference_scorers); when every
        pod may be paused by an earlier failed pass, each pod's probe scores it after its pass
        resumed the pod. No forward pass where it could tell nothing more than the pods'
        answers (preflight_cache.reference_unchecked: every pass probes before its pod is back
        in traffic, every pod's refit_info shows a vocabulary and model length that take the
        token ids, and a pod already scored a reference with these credentials)."""
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
        prompts = [list(p.token_ids) for p in reference.prompts]
        api_key = t.state.secrets.api_key
        why = preflight_cache.reference_unchecked(
            prompts, [kept.of_process(p) for p in pods], api_key, source_for(view.spec).kind
        )
        if why is None:
            log.debug("%s/%s: reference checked without a forward pass", view.namespace, view.name)
            return None
        try:
            await client.score_prompts(
                prompts,
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
        kept.scored(pod, api_key)
        return None

    async def reference(self, t: Tick, path: str, client: WorkerClient) -> ProbeReference:
        view, references = t.view, t.state.references
        if path in references:
            return references[path]
        src = view.spec.probe.reference
        # A rollback probes the previous checkpoint against its own reference file.
        if src.source == "ConfigMap" and src.config_map_ref and path == view.spec.path:
            cm = src.config_map_ref
            text = await inputs.value(self.cluster, t, "ConfigMap", cm.name, cm.key)
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

    async def load_secrets(self, t: Tick) -> Problem | None:
        """Read the admin token and the /v1 API key the spec names; a problem or None."""
        secrets, fleet = t.state.secrets, t.view.spec.fleet
        for ref, attr in ((fleet.admin_token_secret_ref, "token"),
                          (fleet.api_key_secret_ref, "api_key")):  # fmt: skip
            if ref is None:
                continue
            value = await inputs.read_key(
                self.cluster, t, "Secret", ref.name, ref.key,
                missing=Reason.SecretMissing, forbidden=Reason.SecretForbidden,
            )  # fmt: skip
            if isinstance(value, Problem):
                return value
            setattr(secrets, attr, value)
        secrets.loaded = True
        return None


def _fleet_key(t: Tick) -> preflight_cache.FleetKey:
    fleet = t.view.spec.fleet
    groups = fleet.groups.model_dump_json() if fleet.groups is not None else ""
    return (t.namespace, fleet.selector.canonical(), groups)
