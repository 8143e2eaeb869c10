"""The reconcile loop of one WeightRefit: observe, decide (decision.decide), act.

Acting means running the fleet preflight, starting pod passes (pod_pass.run_pass) as tasks, and
writing the CR status at most once per tick and only when it changed: at once when it says
something someone waits on (a phase, a condition turning True: core/status.write_now), else at most
once per PROGRESS_WRITE_SECONDS, so API writes do not grow with pod events or hand-offs
(a 1000-pod refit writes its progress about once a second, not once per pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from refit_worker.contract import CAP_ERRORS_KEEP_CONNECTION, ProbeReference

from ..core import admission, checksums, decision, groups, history, plan, times
from ..core.api import (
    SENDING_ANNOTATION,
    TERMINAL_PHASES,
    Phase,
    WeightRefitSpec,
    WeightRefitStatus,
)
from ..core.decision import Decision, Observed
from ..core.index import Known, RefitIndex
from ..core.pod_state import RefitView
from ..core.podview import PodView
from ..core.status import PROGRESS_WRITE_SECONDS, pod_phases, write_now
from ..edges import metrics
from ..edges.cluster import ClaimLost, Kube, PodBusy
from ..edges.leader import LeadershipLost, Lease
from ..edges.worker_client import WorkerClient, WorkerError
from .pass_context import PassContext
from .pod_pass import run_pass
from .preflight import Preflight
from .refit_state import Listing, Passes, RefitState, Tick, revision
from .sources import source_for

log = logging.getLogger(__name__)

COLLECT_SECONDS = 30.0  # the least time between two collections of a namespace by dormant ticks
RESYNC_SECONDS = 60.0  # the index is checked against the API server's refits this often
WAITING_RESYNC_SECONDS = 5.0  # ... and this often while a refit waits for another one
SYNC_TRIES = 30  # seconds a starting API server may take before the first list succeeds
STOP_SECONDS = 5.0  # a cancelled pass runs only its cleanup; bounded all the same
ACTIVE_PHASES: frozenset[Phase] = frozenset({"Preflight", "Progressing", "RollingBack"})
RESULTS: dict[Phase, str] = {"Succeeded": "succeeded", "Failed": "failed", "Halted": "halted",
           "RolledBack": "rolled_back", "Superseded": "superseded"}  # fmt: skip


class WorkerFactory(Protocol):
    """Makes one pod's client, as WorkerClient's constructor without its session: by default
    WorkerClient over the engine's HTTP session; the explorer's reaches in-process workers."""

    def __call__(
        self,
        base_url: str,
        *,
        admin_token: str | None,
        api_key: str | None,
        timeout: float,
        fence: int | None,
        before_call: Callable[[], None] | None,
        keep_rpc_connections: bool = False,
    ) -> WorkerClient: ...


def _replaced(driven: PodView | None, now: PodView) -> bool:
    """Whether the pod a pass drives is no longer the pod listed under its name (another
    object, or another address): the pass's calls would reach the wrong process."""
    return driven is not None and (driven.uid, driven.ip) != (now.uid, now.ip)


class Engine:
    def __init__(
        self,
        cluster: Kube,
        http: aiohttp.ClientSession | None,
        lease: Lease | None = None,
        policy: history.Policy | None = None,
        *,
        workers: WorkerFactory | None = None,
    ) -> None:
        """``cluster``: Kubernetes (cluster.Cluster, or the explorer's in-memory one).
        ``http``: worker_client.session(), one for every pod; ``workers`` makes each pod's client
        (default: WorkerClient over ``http``; the explorer's talks to in-process workers)."""
        self.cluster = cluster
        self.http = http
        if workers is None:
            assert http is not None, "an Engine needs an HTTP session or a worker factory"
            workers = partial(WorkerClient, http=http)
        self.workers = workers
        self.preflight = Preflight(cluster, self._client)
        self.lease = lease  # None: a single replica without election (tests of the engine)
        self.policy = policy or history.Policy()
        self.refits: dict[str, RefitState] = {}  # by uid; only refits that exist
        self.index = RefitIndex()  # every WeightRefit watched
        self._passes = 0
        self._last_stamp = 0  # ns: the creation stamps this process gives grow strictly
        # namespace -> monotonic time of its last collection, and of its last resync
        self._collected: dict[str, float] = {}
        self._resynced: dict[str, float] = {}
        if lease is not None:
            cluster.before_write = lease.check

    def state(self, uid: str) -> RefitState:
        return self.refits.setdefault(uid, RefitState())

    # ------------------------------------------------------------------- the index
    def observe(self, doc: dict[str, Any], deleted: bool = False) -> None:
        """Fold a watched (or just read) WeightRefit into the index; forget a deleted one and
        everything kept for it, so nothing grows with the number of refits ever seen."""
        gone = self.index.observe(doc, deleted, self._stamp())
        self._trainer_sending(doc)
        if gone is not None:
            self._forget(gone)
        elif not deleted:
            st = self.refits.get(doc["metadata"]["uid"])
            if st is not None:
                st.saw(doc)

    def _forget(self, gone: Known) -> None:
        """Drop what was kept for a refit that no longer exists (a DELETED event, or missing
        from a resync's list), and wake the refits its deletion concerns."""
        for uid in self.index.to_wake_on_delete(gone):
            if uid in self.refits:
                self.refits[uid].wake.set()
        st = self.refits.pop(gone.uid, None)
        if st is not None:
            for task in st.passes.running():
                task.cancel()
        metrics.forget_refit(gone.namespace, gone.spec.fleet_label, gone.name)

    async def seen(self, doc: dict[str, Any], deleted: bool = False) -> None:
        """A watch event: fold it in, and write the creation stamp the refit was given at
        first sight, in watch order (the order the API server stored the refits in), if it
        came without one. A write that fails is retried by the refit's tick."""
        self.observe(doc, deleted)
        if not deleted:
            await self._try_stamp(doc["metadata"])

    def _stamp(self) -> str:
        self._last_stamp = max(int(times.now() * 1e9), self._last_stamp + 1)
        return times.stamp(self._last_stamp)

    async def _write_stamp(self, namespace: str, uid: str) -> None:
        """Persist the creation stamp the index gave refit ``uid``, so that a restarted
        operator, or the next leader, orders it as this one did."""
        k = self.index.unstamped(uid)
        if k is None:
            return
        await self.cluster.stamp_refit(namespace, k.name, uid, k.stamp)
        self.index.stamped(uid, k.stamp)

    async def _try_stamp(self, meta: dict[str, Any]) -> None:
        try:
            await self._write_stamp(meta.get("namespace", ""), meta["uid"])
        except ApiException as e:
            log.warning("creation stamp of %s not written: %s", meta["name"], e)

    def _trainer_sending(self, doc: dict[str, Any]) -> None:
        """The trainer's announcement of the round it sends (rounds.py) releases that round's
        pods at once, from the watch event, without waiting for a tick."""
        meta = doc.get("metadata") or {}
        st = self.refits.get(meta.get("uid", ""))
        announced = (meta.get("annotations") or {}).get(SENDING_ANNOTATION, "")
        if st is not None and st.broadcast is not None and announced.isdigit():
            st.broadcast.rounds.trainer_sending(int(announced))

    async def sync(self, namespaces: list[str] | None) -> None:
        """Fill the index before the first tick (None: every namespace), so the first refit
        to tick already sees every other one; the watch keeps it current from then on."""
        scopes: list[str | None] = list(namespaces) if namespaces else [None]
        for ns in scopes:
            for attempt in range(SYNC_TRIES):
                try:
                    docs = await self.cluster.list_refits(ns)
                    break
                except ApiException as e:
                    # A starting API server answers 429 "storage is (re)initializing".
                    if e.status not in (429, 500, 503) or attempt + 1 == SYNC_TRIES:
                        raise
                    metrics.api_retry("list")
                    await asyncio.sleep(1.0)
            # Refits created while no operator watched and without a stamp get theirs in the
            # order they were stored, as the watch would have shown them: a refit nobody wrote
            # since its creation still has its creation's revision (etcd's, which grows with
            # every write). A write since (labels) may misplace it, only within its second.
            docs.sort(key=lambda d: (d["metadata"]["creationTimestamp"], revision(d)))
            for doc in docs:
                self.observe(doc)
            for doc in docs:
                await self._try_stamp(doc["metadata"])

    def next_fence(self) -> int:
        if self.lease is not None:
            return self.lease.next_fence()
        self._passes += 1
        return self._passes

    def check(self) -> None:
        if self.lease is not None:
            self.lease.check()

    async def _resync(self, namespace: str, waiting: bool) -> None:
        """Drop the refits the API server no longer has: a watch that relisted never shows
        the DELETED events it missed, and such a ghost would keep its fleet's queue, its pods'
        claims or its pods' target forever. One list of the namespace's refits (which history
        keeps few): every RESYNC_SECONDS, or every WAITING_RESYNC_SECONDS while a refit of the
        namespace waits for another one (a ghost may be what it waits for)."""
        now = times.monotonic()
        last = self._resynced.get(namespace)
        every = WAITING_RESYNC_SECONDS if waiting else RESYNC_SECONDS
        if last is not None and now - last < every:
            return
        self._resynced[namespace] = now
        since = self.index.seq
        present = {d["metadata"]["uid"] for d in await self.cluster.list_refits(namespace)}
        for gone in self.index.drop_missing(namespace, present, since):
            log.warning("%s/%s is gone; its deletion was not seen", namespace, gone.name)
            self._forget(gone)

    async def tick(
        self, namespace: str, name: str, *, deleting: bool = False, fresh: bool = True
    ) -> Decision | None:
        """One reconcile of a refit, as Argo Rollouts' reconcile: read the refit, observe its
        pods, decide, act on the decision, write the status (at most once).

        ``fresh=False``: a hand-off (something the refit waited for happened: a round became
        ready, a pass ended, the trainer announced): decide from the newest document the watch
        or our own last write showed instead of reading it again. Its status write is
        conditional on that document's resourceVersion: a stale one costs a conflict and a
        read (_patch_status), never a status decided from an older one. Time-driven ticks
        read the refit (a deletion the watch missed is found there)."""
        t = await self._read(namespace, name, deleting, fresh)
        if t is None:
            return None
        obs = await self._observe(t)
        d = await self._decide(t, obs)
        await self._act(t, d)
        await self._write(t, d)
        if t.view.deleting and d.release_finalizer:
            # The refit is gone once kopf removes the finalizer: a later hand-off (a pass that
            # ends) reads it first, so a lost DELETED event leaves no ghost deciding on.
            t.state.doc = None
        phase = d.status.phase
        ended = phase != t.view.status.phase
        if ended and phase in TERMINAL_PHASES:
            self._wake(namespace, obs.fleet, t.view.uid)
        if phase in TERMINAL_PHASES and (d.dormant or ended):
            await self._collect(namespace, ended)
        metrics.reconcile_done()
        return d

    def _kept(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The newest document seen of refit ``name`` (RefitState.doc), if any: None for a
        finished refit, whose hand-offs (a convergence pass that ended, another refit's end)
        are off every critical path and read it, so that a deletion whose event was lost is
        found there and not at the next resync."""
        for k in self.index.known.values():
            if k.namespace == namespace and k.name == name:
                st = self.refits.get(k.uid)
                doc = st.doc if st is not None else None
                if doc is None or (doc.get("status") or {}).get("phase") in TERMINAL_PHASES:
                    return None
                return doc
        return None

    async def _read(self, namespace: str, name: str, deleting: bool, fresh: bool) -> Tick | None:
        """The refit as the API server has it now (or, for a hand-off, as last seen), with
        the spec it admitted; None, and everything kept for it forgotten, when it no longer
        exists."""
        doc = None if fresh else self._kept(namespace, name)
        if doc is None:
            since = self.index.seq
            doc = await self.cluster.get_refit(namespace, name)
            if doc is None:
                for ghost in self.index.drop_missing(namespace, set(), since, name):
                    self._forget(ghost)
                return None
            self.observe(doc)
        meta = doc["metadata"]
        # Decide only with an order the object carries: the pods' progress records it, and the
        # next operator must compare them with the same one.
        await self._write_stamp(namespace, meta["uid"])
        asked = WeightRefitSpec.model_validate(doc["spec"])
        status = WeightRefitStatus.model_validate(doc.get("status") or {})
        spec = admission.admitted_spec(asked, status)
        view = RefitView(
            name=name,
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            created=self.index.order(meta["uid"], meta),
            spec=spec,
            status=status,
            deleting=deleting or bool(meta.get("deletionTimestamp")),
            namespace=namespace,
        )
        st = self.state(view.uid)
        st.saw(doc)
        await self._resync(namespace, st.waiting)
        if spec is not asked and not st.reported.sequence_ignored:
            st.reported.sequence_ignored = True
            log.warning(
                "%s/%s: spec.sequence changed after the preflight (an API server with an older "
                "CRD accepted it): the refit keeps the sequence it admitted: %s",
                namespace, name, spec.sequence.model_dump(by_alias=True),
            )  # fmt: skip
        return Tick(doc, view, st)

    async def _observe(self, t: Tick) -> Observed:
        """List the refit's pods and stop the passes whose pod is gone or replaced: what
        decision.decide decides from."""
        namespace, view, st, passes = t.namespace, t.view, t.state, t.state.passes
        passes.tasks = {n: task for n, task in passes.tasks.items() if not task.done()}
        passes.driven = {n: p for n, p in passes.driven.items() if n in passes.tasks}
        selector = view.spec.fleet.selector.canonical()
        before = {p.name for p in st.listing.pods} | {p.name for p in view.status.pods}
        # The refit units: each pod, or each pod group as its leader (spec.fleet.groups), each
        # with the record of the weights this refit replaces (spec.track) as its progress.
        track = view.spec.track
        listed = groups.units([p.on_track(track) for p in await self.cluster.list_pods(
            namespace, selector)], view.spec.fleet.groups)  # fmt: skip
        # A pod replaced under its name (new uid) or readdressed: its pass stops calling the
        # old address now, and the pod as it is now gets a pass of its own (the uid's claim
        # and progress say whether that one resumes or starts afresh).
        await self._stop(
            passes, [p.name for p in listed if _replaced(passes.driven.get(p.name), p)]
        )
        st.listing = Listing.of(self._with_live(listed, passes))
        pods = st.listing.pods
        st.readbacks.reset((p.name, p.progress) for p in pods)
        fleet, previous = self.index.sharing(
            namespace, view.uid, view.created, view.status.phase, pods, view.spec.track, view.name
        )
        st.waiting = any(
            r.name != view.name and r.phase not in TERMINAL_PHASES for r in fleet
        ) or any(p.claim is not None and p.claim.uid != view.uid for p in pods)
        present = {p.name for p in pods if not p.deleting}
        vanished = frozenset(
            [n for n in passes.tasks
             if n not in present and await self._gone(namespace, passes.driven[n])]
        )  # fmt: skip
        await self._stop(passes, vanished)  # deleted mid-pass: nothing left to make safe
        for gone in before - present:
            metrics.forget_pod(namespace, view.spec.fleet_label, gone)
        refits = self.index.names(namespace)
        unseen = await self._unseen(namespace, pods, refits)
        return Observed(
            refit=view, fleet=fleet, pods=pods, in_flight=frozenset(passes.tasks),
            now=times.now(), previous=previous, vanished=vanished, refits=refits,
            broadcast=st.broadcast.rounds.view() if st.broadcast is not None else None,
            unseen=unseen, elsewhere=await self._elsewhere(pods, {*refits, *unseen}),
        )  # fmt: skip

    async def _decide(self, t: Tick, obs: Observed) -> Decision:
        d = decision.decide(obs)
        if d.need_preflight:
            d = decision.decide(replace(obs, preflight=await self.preflight.run(t)))
        return d

    async def _act(self, t: Tick, d: Decision) -> None:
        # A restarted pod before vLLM is back up and the kubelet would mark it Ready.
        for name, why in d.withdraw.items():
            await self.cluster.withdraw(
                t.state.listing.by_name[name], t.namespace, why.reason, why.message
            )
        if d.start:
            await self._start(t, d)
        if d.stage_ahead:
            await self._stage_ahead(t, d.stage_ahead)

    @staticmethod
    def _with_live(pods: list[PodView], passes: Passes) -> list[PodView]:
        """Pods as listed, with the in-memory progress of the passes in flight: a pass records
        its progress on the pod only at checkpoints, and the status shows every step."""
        live = passes.live
        for name in [n for n in live if n not in passes.tasks]:  # in place: passes hold it
            del live[name]
        return [replace(pod, progress=live[pod.name]) if pod.name in live else pod for pod in pods]

    async def _patch_status(self, t: Tick, new: dict[str, Any]) -> bool:
        """Write the status decided from ``t.doc``, conditional on the status being still the
        one read: a status decided from an older read (another replica's, or ours before a
        pause, or a hand-off's stale document) is never written. A conflict on the rest of
        the object (kopf's finalizer and annotations, the trainer's) is retried on a fresh
        read. False when the status itself changed. The refit as written (or read again) is
        what the next hand-off decides from."""
        namespace, doc, st = t.namespace, t.doc, t.state
        name, rv = doc["metadata"]["name"], doc["metadata"].get("resourceVersion", "")
        for _ in range(5):
            try:
                written = await self.cluster.patch_status(namespace, name, new, rv)
            except ApiException as exc:
                if exc.status == 404:
                    # Gone, its DELETED event lost (a hand-off decided from the document last
                    # seen): forget it now, not at the next resync.
                    for ghost in self.index.drop_missing(namespace, set(), self.index.seq, name):
                        self._forget(ghost)
                    return False
                if exc.status != 409:
                    raise
            else:
                if written:
                    # Into the index too, not only the refit's state: the refits this tick
                    # wakes decide from the index (a Succeeded here is what lets the fleet's
                    # previous target see its pods moved on), before the watch brings it.
                    self.observe(written)
                else:  # a Kube that does not answer with the object: read it next time
                    st.doc = None
                return True
            metrics.api_retry("patch")
            fresh = await self.cluster.get_refit(namespace, name)
            if fresh is not None:
                st.saw(fresh)
            if fresh is None or fresh.get("status") != doc.get("status"):
                return False
            rv = fresh["metadata"].get("resourceVersion", "")
        return False

    def _wake(self, namespace: str, fleet: Sequence[plan.RefitRef], me: str) -> None:
        """A refit just finished: the refits it concerns decide now, not at their next
        (possibly dormant) tick: the queued one starts, a finished one sees its pods moved on
        or takes up convergence again."""
        for uid in self.index.to_wake(namespace, fleet, me):
            st = self.refits.get(uid)
            if st is not None:
                st.wake.set()

    async def _gone(self, namespace: str, pod: PodView) -> bool:
        """A pod in flight that the list no longer shows: deleted (or being deleted, or
        replaced under its name), or only relabelled out of the selector, whose pass must
        then finish (it holds the pod)."""
        try:
            doc = await self.cluster.read_pod(namespace, pod.name)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        meta = doc["metadata"]
        return bool(meta.get("deletionTimestamp")) or meta.get("uid") != pod.uid

    @staticmethod
    async def _stop(passes: Passes, names: Collection[str]) -> None:
        """Stop these pods' passes, and wait until they have stopped: none calls its pod
        again once this returns (a cancelled pass runs nothing but its cleanup)."""
        tasks = [passes.tasks.pop(n) for n in names]
        for name in names:
            passes.driven.pop(name, None)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_SECONDS)

    async def _unseen(
        self, namespace: str, pods: list[PodView], refits: Mapping[str, str]
    ) -> frozenset[str]:
        """The uids of refits that claim pods of this fleet, exist, and this process's watch
        has not shown yet: another process may have created one a moment ago, and its live
        pass must not be taken for a crashed one's (a claim whose refit is gone is free). One
        read per such refit; none in the common case."""
        me = self.cluster.identity
        claims = [p.claim for p in pods if p.claim is not None and p.claim.holder != me]
        unseen = {(c.uid, c.refit) for c in claims if c.uid not in refits}
        found: set[str] = set()
        for uid, name in sorted(unseen):
            doc = await self.cluster.get_refit(namespace, name)
            if doc is not None and doc["metadata"].get("uid") == uid:
                found.add(uid)
        return frozenset(found)

    async def _elsewhere(self, pods: list[PodView], refits: Collection[str]) -> frozenset[str]:
        """Pods whose claim belongs to another operator process that may still act
        (leader.holder_alive): no pass of this process takes them over. A claim that names
        no Lease (written before claims did) is judged by this process's own Lease."""
        if self.lease is None:
            return frozenset()
        me = self.cluster.identity
        claims = {
            p.name: (p.claim.lease or self.lease.key, p.claim.holder, p.claim.lease_seconds)
            for p in pods
            if p.claim is not None and p.claim.holder != me and p.claim.uid in refits
        }
        if not claims:
            return frozenset()
        alive = await self.lease.holders_alive(set(claims.values()))
        return frozenset(name for name, h in claims.items() if h in alive)

    async def _collect(self, namespace: str, ended: bool) -> None:
        """Delete finished refits the history policy no longer keeps (docs/concepts.md). Refits
        are grouped by the pods they share, so it lists the namespace's pods: at once when a
        refit has just ended, else (a dormant refit's tick, for TTLs) at most once every
        COLLECT_SECONDS per namespace."""
        now = times.monotonic()
        if not ended and now - self._collected.get(namespace, -COLLECT_SECONDS) < COLLECT_SECONDS:
            return
        self._collected[namespace] = now
        pods = await self.cluster.list_pods(namespace, "")
        for k in self.index.to_collect(namespace, self.policy, times.now(), pods):
            await self.cluster.delete_refit(namespace, k.name)

    # ---------------------------------------------------------------- pod passes
    def _client(self, t: Tick, pod: PodView, fence: int | None = None) -> WorkerClient:
        spec, secrets = t.view.spec, t.state.secrets
        url = f"http://{pod.ip}:{spec.fleet.port}"
        # The one place a pod's client gets the token: never for a pod the Pod object does
        # not vouch for (the decisions call none; this holds if one ever did).
        token = secrets.token if pod.vetted else None
        # RPCs share the pooled connection where the pod's process said it keeps one open
        # after a refusal (its refit_info, as the preflight or an admission read it).
        known = self.preflight.of_process(t, pod)
        keep = known is not None and CAP_ERRORS_KEEP_CONNECTION in known.info.capabilities
        return self.workers(url, admin_token=token, api_key=secrets.api_key,
                            timeout=float(spec.sequence.step_timeout_seconds),
                            fence=fence, before_call=self.check,
                            keep_rpc_connections=keep)  # fmt: skip

    async def _start(self, t: Tick, d: Decision) -> None:
        view, st, passes = t.view, t.state, t.state.passes
        if not st.secrets.loaded:  # after a restart the preflight that read them is not rerun
            await self.preflight.load_secrets(t)
        # After a restart, as the secrets: what the source's passes need (a broadcast's
        # manifest). A problem fails each pass with it: the gate then decides.
        source = source_for(view.spec)
        problem = await source.ready_to_pass(t, self.cluster)
        if problem is not None:
            log.error(
                "%s: no %s source: %s: %s", view.name, source.kind, problem.reason, problem.message
            )

        async def reference(path: str, client: WorkerClient) -> ProbeReference:
            return await self.preflight.reference(t, path, client)

        ctx = PassContext(
            cluster=self.cluster, namespace=t.namespace, refit_doc=t.doc, refit_name=view.name,
            refit_uid=view.uid, refit_created=view.created,
            fleet=view.spec.fleet_label, spec=view.spec,
            client=lambda pod, fence: self._client(t, pod, fence),
            next_fence=self.next_fence, reference=reference,
            peer_nlls=st.peer_nlls, readbacks=st.readbacks,
            recorded_checksum=lambda v, layout: checksums.recorded(
                view.status.checksums, v, layout
            ),
            admitted=passes.admitted, answers=self.preflight.answers(t),
            lora=passes.lora, drafters=passes.drafters,
            layout=view.status.layout,
            live=passes.live,
            broadcast=st.broadcast,
            source_problem=problem, lease=self.lease.key if self.lease else "",
            lease_seconds=self.lease.duration if self.lease else 0,
        )  # fmt: skip
        pods = st.listing.by_name
        if st.broadcast is not None:  # the passes started together receive one send
            st.broadcast.rounds.open(
                s.pod for s in d.start
                if s.pod in pods and s.pod not in passes.tasks and source.receives(pods[s.pod], s)
            )  # fmt: skip
        for start in d.start:
            if start.pod in passes.tasks or start.pod not in pods:
                continue
            task = asyncio.create_task(self._guarded(ctx, pods[start.pod], start, st.wake))
            passes.tasks[start.pod] = task
            passes.driven[start.pod] = pods[start.pod]

    async def _stage_ahead(self, t: Tick, names: list[str]) -> None:
        """Ask the next batch's pods to stage the checkpoint while they serve. Without a
        fencing token, like the admission's refit_info: staging changes nothing a pass relies
        on (the load uses staged bytes only if no file changed since), and a token would fence
        off a pass that took the pod meanwhile. Best effort: the pass stages anyway."""
        view, st, passes = t.view, t.state, t.state.passes
        if not st.secrets.loaded:
            await self.preflight.load_secrets(t)
        pods = st.listing.by_name
        path = view.spec.path
        timeout = float(view.spec.sequence.load_timeout_seconds)

        async def stage(pod: PodView) -> None:
            try:
                note = (await self._client(t, pod).stage(path, timeout=timeout)).get("note")
                log.info("%s: pod %s staged ahead of its turn: %s", view.name, pod.name, note)
            except (WorkerError, LeadershipLost) as e:
                log.info("%s: pod %s did not stage ahead: %s", view.name, pod.name, e)

        for name in names:
            if name in pods and name not in passes.tasks and name not in passes.staged_ahead:
                passes.staged_ahead[name] = asyncio.create_task(stage(pods[name]))

    async def _guarded(
        self, ctx: PassContext, pod: PodView, start: decision.PodStart, wake: asyncio.Event
    ) -> None:
        try:
            await run_pass(ctx, pod, start)
        except asyncio.CancelledError:
            raise
        except PodBusy as e:
            log.info("%s: not started: %s", ctx.refit_name, e)
            # The pods the tick decided from lagged the pod (a watch-fed list): read it, so
            # that the next tick decides from it as it is, not from the same stale copy.
            with contextlib.suppress(ApiException):
                await self.cluster.read_pod(ctx.namespace, pod.name)
        except ClaimLost as e:
            log.warning("%s: pass stopped, another pass owns the pod: %s", ctx.refit_name, e)
        except LeadershipLost as e:
            log.error("pod %s: pass stopped: %s", pod.name, e)
        except Exception as e:
            # The pod's annotation holds its progress; the next tick resumes it.
            metrics.reconcile_error("internal")
            log.exception("pod %s: pass interrupted: %s", pod.name, e)
            await asyncio.sleep(1.0)
        finally:
            wake.set()

    # -------------------------------------------------------------------- status
    async def _write(self, t: Tick, d: Decision) -> None:
        """The tick's one status write (only if the decision changed it), its events, and the
        metrics of the fleet the refit owns."""
        namespace, doc, view, st = t.namespace, t.doc, t.view, t.state
        new = d.status.dump()
        old = view.status.dump()
        # A tick that emits Events writes the status that records their transition: the next
        # tick, deciding from a status without it, would emit them again.
        due = (
            bool(d.events)
            or write_now(d.status, view.status)
            or times.monotonic() - st.reported.written_at >= PROGRESS_WRITE_SECONDS
        )
        if new != old and new != st.reported.written and due:
            if not await self._patch_status(t, new):
                st.wake.set()  # someone else wrote the status: decide again from a fresh read
                return
            st.reported.written = new
            st.reported.written_at = times.monotonic()
        for e in d.events:
            await self.cluster.event(namespace, doc, e.reason, e.message, e.type)
        fleet = view.spec.fleet_label
        phase = d.status.phase
        if phase != view.status.phase and phase in RESULTS:
            metrics.refit_finished(namespace, fleet, RESULTS[phase], refit=view.name)
        # Only the refit that owns the fleet (the active one, or the finished one that is still
        # the fleet's target) publishes fleet state, so two refits never alternate the series.
        # The tick that ends a refit publishes too: it still owns the fleet, and its pods as
        # they were left (a failed pod out of traffic) are what the alerts must see.
        ending = phase != view.status.phase and phase in RESULTS
        if phase not in ACTIVE_PHASES and (phase not in RESULTS or (d.dormant and not ending)):
            return
        target = view.spec.version
        if phase in ("RollingBack", "RolledBack") and d.status.previous is not None:
            target = d.status.previous.version or target
        pods = st.listing.pods
        by_phase = pod_phases(d.status.pods, pods, view.uid)
        live = [p for p in pods if not p.deleting]
        active = phase in ACTIVE_PHASES
        metrics.fleet_state(
            namespace, fleet, view.name, pods_by_phase=by_phase,
            out_of_traffic=sum(not p.ready for p in live),
            version_skew=sum(not p.verified(target) for p in live),
            target_version=target,
            started_at=times.epoch(d.status.start_time) if active else None,
            timeout_seconds=float(view.spec.sequence.total_timeout_seconds) if active else None,
        )  # fmt: skip
        if not st.reported.thresholds_published:
            th = view.spec.probe.thresholds
            metrics.probe_thresholds(
                namespace, fleet, view.name, mean_abs_diff=th.mean_abs_logprob_diff,
                max_abs_diff=th.max_abs_logprob_diff, nll_diff=th.nll_diff,
            )  # fmt: skip
            st.reported.thresholds_published = True
