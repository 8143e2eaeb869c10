"""The reconcile loop of one WeightRefit: observe, decide (reconcile.decide), act.

Acting means running the fleet preflight, starting pod passes (runner.run_pass) as tasks, and
writing the CR status at most once per tick and only when it changed, so API writes do not
grow with pod events (a 1000-pod refit writes status once per tick, not once per pod step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import aiohttp
from refit_worker.contract import ContractError, ProbeReference, RefitInfo

from . import metrics, plan, reconcile
from .api import Previous, WeightRefitSpec, WeightRefitStatus
from .cluster import AccessDenied, Cluster
from .podflow import Progress
from .reconcile import Decision, Observed, PodView, PreflightResult, RefitView
from .runner import PassContext, run_pass
from .worker import WorkerClient, WorkerError

log = logging.getLogger(__name__)

PREFLIGHT_CONCURRENCY = 64
ACTIVE_PHASES = frozenset({"Preflight", "Progressing", "RollingBack"})
RESULTS = {"Succeeded": "succeeded", "Failed": "failed", "Halted": "halted",
           "RolledBack": "rolled_back", "Superseded": "superseded"}  # fmt: skip


@dataclass
class _RefitState:
    """In-memory state of one refit: nothing here is needed to resume after a restart."""

    tasks: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    token: str | None = None  # the pods' admin token
    api_key: str | None = None  # vLLM's --api-key, for /v1
    secrets_loaded: bool = False
    references: dict[str, ProbeReference] = field(default_factory=dict)
    pods: list[PodView] = field(default_factory=list)
    admitted: dict[str, tuple[str, int]] = field(default_factory=dict)  # see PassContext
    live: dict[str, Progress] = field(default_factory=dict)  # progress of passes (runner)
    written: dict[str, Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    def __init__(self, cluster: Cluster, http: aiohttp.ClientSession) -> None:
        self.cluster = cluster
        self.http = http  # worker.session(): one for every pod
        self.refits: dict[str, _RefitState] = {}
        self.thresholds_published: set[str] = set()  # refit uids

    def state(self, uid: str) -> _RefitState:
        return self.refits.setdefault(uid, _RefitState())

    async def tick(self, namespace: str, name: str, *, deleting: bool = False) -> Decision | None:
        doc = await self.cluster.get_refit(namespace, name)
        if doc is None:
            return None
        meta = doc["metadata"]
        spec = WeightRefitSpec.model_validate(doc["spec"])
        status = WeightRefitStatus.model_validate(doc.get("status") or {})
        view = RefitView(
            name=name,
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            created=meta["creationTimestamp"],
            spec=spec,
            status=status,
            deleting=deleting or bool(meta.get("deletionTimestamp")),
            namespace=namespace,
        )
        st = self.state(view.uid)
        st.tasks = {n: t for n, t in st.tasks.items() if not t.done()}
        selector = spec.fleet.selector.canonical()
        fleet, previous = await self._fleet(namespace, view, selector)
        st.pods = self._with_live(await self.cluster.list_pods(namespace, selector), st)
        present = {p.name for p in st.pods if not p.deleting}
        vanished = frozenset(n for n in st.tasks if n not in present)
        for pod in vanished:  # deleted mid-pass: nothing left to make safe
            st.tasks.pop(pod).cancel()
        for gone in {p.name for p in view.status.pods} - present:
            metrics.forget_pod(namespace, selector, gone)
        obs = Observed(
            refit=view, fleet=fleet, pods=st.pods, in_flight=frozenset(st.tasks),
            now=time.time(), previous=previous, vanished=vanished,
        )  # fmt: skip
        d = reconcile.decide(obs)
        if d.need_preflight:
            d = reconcile.decide(replace(obs, preflight=await self._preflight(view, st)))
        if d.start:
            await self._start(namespace, doc, view, st, d)
        await self._write(namespace, doc, view, st, d)
        metrics.reconcile_done()
        return d

    @staticmethod
    def _with_live(pods: list[PodView], st: _RefitState) -> list[PodView]:
        """Pods as listed, with the in-memory progress of the passes in flight: a pass records
        its progress on the pod only at checkpoints, and the status shows every step."""
        for name in [n for n in st.live if n not in st.tasks]:  # in place: passes hold it
            del st.live[name]
        return [
            replace(pod, progress=st.live[pod.name]) if pod.name in st.live else pod for pod in pods
        ]

    async def _fleet(
        self, namespace: str, me: RefitView, selector: str
    ) -> tuple[list[plan.RefitRef], Previous | None]:
        refs, succeeded = [], []
        for r in await self.cluster.list_refits(namespace):
            try:
                spec = WeightRefitSpec.model_validate(r["spec"])
            except ValueError:
                continue
            if spec.fleet.selector.canonical() != selector:
                continue
            rmeta = r["metadata"]
            phase = (r.get("status") or {}).get("phase", "Pending")
            if rmeta["uid"] == me.uid:
                phase = me.status.phase
            ref = plan.RefitRef(rmeta["name"], rmeta["creationTimestamp"], phase, spec.queue_policy)
            refs.append(ref)
            if phase == "Succeeded" and rmeta["uid"] != me.uid and ref.created <= me.created:
                succeeded.append((ref.created, spec, rmeta["name"]))
        previous = None
        if succeeded:
            _, spec, name = max(succeeded, key=lambda t: t[0])
            previous = Previous(
                version=spec.checkpoint.version, path=spec.checkpoint.path, refit=name
            )
        return refs, previous

    # ------------------------------------------------------------------ preflight
    async def _preflight(self, view: RefitView, st: _RefitState) -> PreflightResult:
        spec = view.spec
        problem = await self._load_secrets(view, st)
        if problem is not None:
            return PreflightResult(problem=problem)
        reachable = [p for p in st.pods if p.ip]
        sem = asyncio.Semaphore(PREFLIGHT_CONCURRENCY)

        async def info(pod: PodView) -> RefitInfo | str:
            async with sem:
                try:
                    return await self._client(view, st, pod).refit_info(
                        timeout=float(spec.sequence.step_timeout_seconds)
                    )
                except WorkerError as e:
                    return f"refit_info failed ({e.kind}): {e.message}"

        infos = dict(
            zip(
                [p.name for p in reachable],
                await asyncio.gather(*map(info, reachable)),
                strict=True,
            )
        )
        problem = None
        if reachable and all(not isinstance(i, str) for i in infos.values()):
            problem = await self._check_reference(view, st, reachable[0])
        identity = {p.name: (p.uid, p.restarts) for p in reachable}
        st.admitted = {
            name: identity[name]
            for name, info in infos.items()
            if reconcile.admission_problem(info, spec.allow_unsafe_backends) is None
        }
        return PreflightResult(infos=infos, problem=problem)

    async def _check_reference(
        self, view: RefitView, st: _RefitState, pod: PodView
    ) -> tuple[str, str] | None:
        """Fetch the probe reference and score it on one pod (one request for all prompts): a
        reference the model cannot score fails the refit before any pod is touched."""
        client = self._client(view, st, pod)
        try:
            reference = await self._reference(view, st, view.spec.checkpoint.path, client)
        except (WorkerError, ContractError, ValueError, AccessDenied) as e:
            return "ReferenceInvalid", f"probe reference unusable: {e}"
        try:
            await client.score_prompts(
                [list(p.token_ids) for p in reference.prompts],
                timeout=float(view.spec.sequence.probe_timeout_seconds),
            )
        except WorkerError as e:
            if e.kind == "http" and e.status in (401, 403):
                return (
                    "ProbeUnauthorized",
                    f"pod {pod.name} refused the probe's /v1 request (HTTP {e.status}): set "
                    "spec.fleet.apiKeySecretRef to the Secret holding the pods' --api-key",
                )
            if e.kind == "http" and e.status is not None and 400 <= e.status < 500:
                return (
                    "ReferenceUnscorable",
                    f"pod {pod.name} cannot score the reference: {e.message}",
                )
            return "PodUnreachable", f"pod {pod.name}: scoring failed: {e.message}"
        return None

    async def _reference(
        self, view: RefitView, st: _RefitState, path: str, client: WorkerClient
    ) -> ProbeReference:
        if path in st.references:
            return st.references[path]
        src = view.spec.probe.reference
        # A rollback probes the previous checkpoint against its own reference file.
        if src.source == "ConfigMap" and src.config_map_ref and path == view.spec.checkpoint.path:
            cm = src.config_map_ref
            text = await self.cluster.read_key("ConfigMap", view.namespace, cm.name, cm.key)
            if text is None:
                raise ValueError(f"ConfigMap {cm.name} has no key {cm.key!r}")
            reference = ProbeReference.from_json_dict(json.loads(text))
        else:
            reference = await client.probe_reference(
                path, timeout=float(view.spec.sequence.step_timeout_seconds)
            )
        st.references[path] = reference
        return reference

    async def _load_secrets(self, view: RefitView, st: _RefitState) -> tuple[str, str] | None:
        """Read the admin token and the /v1 API key the spec names; a problem or None."""
        fleet = view.spec.fleet
        for ref, attr in ((fleet.admin_token_secret_ref, "token"),
                          (fleet.api_key_secret_ref, "api_key")):  # fmt: skip
            if ref is None:
                continue
            try:
                value = await self.cluster.read_key("Secret", view.namespace, ref.name, ref.key)
            except AccessDenied as e:
                return "SecretForbidden", str(e)
            if value is None:
                return "SecretMissing", f"Secret {ref.name} has no key {ref.key!r}"
            setattr(st, attr, value)
        st.secrets_loaded = True
        return None

    # ---------------------------------------------------------------- pod passes
    def _client(self, view: RefitView, st: _RefitState, pod: PodView) -> WorkerClient:
        url = f"http://{pod.ip}:{view.spec.fleet.port}"
        return WorkerClient(url, http=self.http, admin_token=st.token, api_key=st.api_key,
                            timeout=float(view.spec.sequence.step_timeout_seconds))  # fmt: skip

    async def _start(
        self, namespace: str, doc: dict[str, Any], view: RefitView, st: _RefitState, d: Decision
    ) -> None:
        if not st.secrets_loaded:  # after a restart the preflight that read them is not rerun
            await self._load_secrets(view, st)

        async def reference(path: str, client: WorkerClient) -> ProbeReference:
            return await self._reference(view, st, path, client)

        ctx = PassContext(
            cluster=self.cluster, namespace=namespace, refit_doc=doc, refit_name=view.name,
            refit_uid=view.uid, fleet=view.spec.fleet.selector.canonical(), spec=view.spec,
            client=lambda pod: self._client(view, st, pod), reference=reference,
            peer_nlls=lambda version: reconcile.peer_nlls(st.pods, version),
            admitted=st.admitted, live=st.live,
        )  # fmt: skip
        pods = {p.name: p for p in st.pods}
        for start in d.start:
            if start.pod in st.tasks or start.pod not in pods:
                continue
            task = asyncio.create_task(self._guarded(ctx, pods[start.pod], start, st))
            st.tasks[start.pod] = task

    async def _guarded(
        self, ctx: PassContext, pod: PodView, start: reconcile.PodStart, st: _RefitState
    ) -> None:
        try:
            await run_pass(ctx, pod, start)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # The pod's annotation holds its progress; the next tick resumes it.
            metrics.reconcile_error("internal")
            log.exception("pod %s: pass interrupted: %s", pod.name, e)
            await asyncio.sleep(1.0)
        finally:
            st.wake.set()

    # -------------------------------------------------------------------- status
    async def _write(
        self, namespace: str, doc: dict[str, Any], view: RefitView, st: _RefitState, d: Decision
    ) -> None:
        new = d.status.dump()
        old = view.status.dump()
        if new != old and new != st.written:
            await self.cluster.patch_status(namespace, view.name, new)
            st.written = new
        for e in d.events:
            await self.cluster.event(namespace, doc, e.reason, e.message, e.type)
        fleet = d.status.fleet
        phase = d.status.phase
        if phase != view.status.phase and phase in RESULTS:
            metrics.refit_finished(namespace, fleet, RESULTS[phase], refit=view.name)
        # Only the refit that owns the fleet (the active one, or the finished one that is still
        # the fleet's target) publishes fleet state, so two refits never alternate the series.
        if phase not in ACTIVE_PHASES and (phase not in RESULTS or d.dormant):
            return
        target = view.spec.checkpoint.version
        if phase in ("RollingBack", "RolledBack") and d.status.previous is not None:
            target = d.status.previous.version or target
        by_phase: dict[str, int] = {}
        for p in d.status.pods:
            by_phase[p.phase] = by_phase.get(p.phase, 0) + 1
        live = [p for p in st.pods if not p.deleting]
        active = phase in ACTIVE_PHASES
        metrics.fleet_state(
            namespace, fleet, view.name, pods_by_phase=by_phase,
            out_of_traffic=sum(not p.ready for p in live),
            version_skew=sum(not p.verified(target) for p in live),
            target_version=target,
            started_at=_epoch(d.status.start_time) if active else None,
            timeout_seconds=float(view.spec.sequence.total_timeout_seconds) if active else None,
        )  # fmt: skip
        if view.uid not in self.thresholds_published:
            t = view.spec.probe.thresholds
            metrics.probe_thresholds(
                namespace, fleet, view.name, mean_abs_diff=t.mean_abs_logprob_diff,
                max_abs_diff=t.max_abs_logprob_diff, nll_diff=t.nll_diff,
            )  # fmt: skip
            self.thresholds_published.add(view.uid)


def _epoch(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
