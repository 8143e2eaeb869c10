"""Kubernetes I/O of the operator: pods, their readiness-gate condition and progress
annotation, WeightRefits and their status, Events, Secrets, ConfigMaps, the leader Lease.

Thin by design: every decision lives in the pure modules. Documents travel as plain JSON
dicts (``_preload_content=False``) so nothing is lost to client-side model classes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from refit_worker.contract import API_GROUP, READINESS_GATE

from ..core import api, times
from ..core.claim import CLAIM_ANNOTATION, Claim
from ..core.podflow import Progress, Readiness, progress_annotation
from ..core.podview import PodView
from ..core.times import rfc3339
from . import metrics
from .pod_watch import PodWatch

log = logging.getLogger(__name__)

FINALIZER = f"{API_GROUP}/safe-pods"  # kopf manages it (settings.persistence.finalizer)
SMP = "application/strategic-merge-patch+json"
WITHDRAW_TRIES = 3  # a withdrawal that meets others' writes of the pod (the kubelet's)
MERGE = "application/merge-patch+json"


async def _body(resp: Any) -> bytes:
    """The body of a ``_preload_content=False`` answer, which does not raise on errors."""
    body: bytes = await resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException(status=resp.status, reason=body.decode(errors="replace")[:500])
    return body


async def read_json(resp: Any) -> Any:
    return json.loads(await _body(resp))


async def _done(resp: Any) -> None:
    """Check a write's answer without building client-side models of the object returned
    (deserializing a Pod costs more CPU than sending the patch)."""
    await _body(resp)


async def connect(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (KUBECONFIG or path).

    The environment's proxy for the API server is resolved here, once. kubernetes_asyncio's
    session trusts the environment, which makes aiohttp look up proxies and ~/.netrc in a
    thread for every request: at 10,000 pods that thread traffic cost the operator's one
    event loop more CPU than the requests themselves (bench/results/HISTORY.md).
    """
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    if cfg.proxy is None:
        cfg.proxy = _env_proxy(cfg.host or "")
    api_client = client.ApiClient(configuration=cfg)
    # The session's only per-request use of the environment is what _env_proxy did once.
    api_client.rest_client.pool_manager._trust_env = False
    return api_client


def _env_proxy(url: str) -> str | None:
    """The proxy HTTPS_PROXY/HTTP_PROXY (minus NO_PROXY) name for url, as curl reads them."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if urllib.request.proxy_bypass(host):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(urllib.parse.urlsplit(url).scheme or "https")


class AccessDenied(PermissionError):
    """RBAC forbids a read the refit needs: a user error, not a transient one."""


class PodBusy(Exception):
    """The pod changed since it was listed (another pass may have claimed it): this pass
    does not start; the next reconcile decides again from a fresh view."""


class ClaimLost(Exception):
    """Another pass has taken the pod over (a newer leader, or the pod was claimed again):
    this pass stops at once and touches the pod no more."""


def _condition(readiness: Readiness) -> dict[str, Any]:
    """The pod's readiness-gate condition, as pods/status takes it."""
    return {
        "type": READINESS_GATE,
        "status": "True" if readiness.ready else "False",
        "reason": readiness.reason,
        "message": readiness.message[:1000],
        "lastTransitionTime": rfc3339(times.now()),
    }


def _record_body(progress: Progress, readiness: Readiness | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"annotations": {progress_annotation(progress.track): progress.to_annotation()}}
    }
    if readiness is not None:
        body["status"] = {"conditions": [_condition(readiness)]}
    return body


def _no_check() -> None:
    return None


def kubelet_ready(doc: dict[str, Any]) -> bool:
    """Whether the pod's ``Ready`` condition is True in ``doc``: endpoints may still list it.
    False also where no kubelet reports one (a pod without a node)."""
    conds = (doc.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


@dataclass
class ClaimedPod:
    """A pod this pass holds the claim of. Every write is one strategic-merge patch of
    pods/status conditional on the pod's resourceVersion: a write that meets a change it did
    not make re-reads the pod and goes on only while the claim is still this pass's."""

    cluster: Cluster
    namespace: str
    name: str
    claim: Claim
    resource_version: str
    uid: str  # the pod object claimed: a pod recreated under its name is another pod
    members: tuple[str, ...] = ()  # a pod group's followers: each readiness goes to them too
    # The pod's Ready condition as the answer to the pass's last write showed it: False means
    # endpoints no longer list it (or never did), so the drain needs no read of the pod to
    # know (steps._wait_out_of_endpoints). The kubelet never turns it True again while the
    # pass holds the readiness gate False.
    ready: bool = True

    async def record(
        self, progress: Progress, readiness: Readiness | None = None, *, release: bool = False
    ) -> None:
        """Record the pass's progress (and the readiness condition, when given); ``release``
        removes the claim in the same write: the pass's last write."""
        body = _record_body(progress, readiness)
        body["metadata"]["annotations"][CLAIM_ANNOTATION] = (
            None if release else self.claim.to_annotation()
        )
        await self.cluster.mirror(self.namespace, self.members, readiness, before=True)
        while True:
            body["metadata"]["resourceVersion"] = self.resource_version
            try:
                doc = await self.cluster._patch_pod_status(self.namespace, self.name, body)
                self.resource_version = str(doc["metadata"]["resourceVersion"])
                self.ready = kubelet_ready(doc)
                await self.cluster.mirror(self.namespace, self.members, readiness, before=False)
                return
            except ApiException as e:
                if e.status != 409:
                    raise
            metrics.api_retry("patch")
            now = PodView.from_pod(await self.cluster.read_pod(self.namespace, self.name))
            if now.uid != self.uid:
                raise ClaimLost(f"pod {self.name}: replaced by another pod of that name")
            if now.claim != self.claim:
                raise ClaimLost(
                    f"pod {self.name}: claim taken over by "
                    + (f"{now.claim.refit} (fence {now.claim.fence})" if now.claim else "nobody")
                )
            self.resource_version = now.resource_version


class Kube(Protocol):
    """What the engine and its passes ask of Kubernetes. :class:`Cluster` asks an API server;
    the deterministic explorer's in-memory cluster (testbed/explorer) stands in for it, so an
    Engine runs without a server."""

    identity: str
    before_write: Callable[[], None]  # called before every write (the lease check)

    async def list_pods(self, namespace: str, selector: str) -> list[PodView]: ...
    async def pods_named(self, namespace: str, names: Sequence[str]) -> list[PodView]: ...
    async def read_pod(self, namespace: str, name: str) -> dict[str, Any]: ...
    async def claim(
        self,
        namespace: str,
        pod: PodView,
        claim: Claim,
        progress: Progress,
        readiness: Readiness | None,
    ) -> ClaimedPod: ...
    async def withdraw(self, pod: PodView, namespace: str, reason: str, message: str) -> None: ...
    async def get_refit(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def list_refits(self, namespace: str | None) -> list[dict[str, Any]]: ...
    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str = ""
    ) -> dict[str, Any] | None: ...
    async def delete_refit(self, namespace: str, name: str) -> None: ...
    async def stamp_refit(self, namespace: str, name: str, uid: str, stamp: str) -> None: ...
    async def event(
        self, namespace: str, involved: dict[str, Any], reason: str, message: str, etype: str
    ) -> None: ...
    async def read_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None: ...


@dataclass
class Cluster:
    api_client: client.ApiClient
    identity: str = "refit-operator"
    # Each namespace's pods, kept by a watch (pod_watch.py): listed once, not per tick.
    _pod_watches: dict[str, PodWatch] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # Called before every write: raises when this replica may have lost its leadership.
        # (Set here, not as a field, so that the Kube protocol may assign it.)
        self.before_write: Callable[[], None] = _no_check

    # Typed as Any: with _preload_content=False the generated signatures no longer hold.
    @property
    def core(self) -> Any:
        return client.CoreV1Api(self.api_client)

    @property
    def custom(self) -> Any:
        return client.CustomObjectsApi(self.api_client)

    # ---------------------------------------------------------------------- pods
    async def list_pods(self, namespace: str, selector: str) -> list[PodView]:
        """The namespace's pods that ``selector`` selects, as a LIST would return them, from
        the namespace's watch (started by the first call: its one LIST)."""
        return await self._pods(namespace).pods(selector)

    async def pods_named(self, namespace: str, names: Sequence[str]) -> list[PodView]:
        """The pods of these names that exist, from the namespace's watch (no request)."""
        return await self._pods(namespace).named(names)

    def _pods(self, namespace: str) -> PodWatch:
        watch = self._pod_watches.get(namespace)
        if watch is None:
            watch = self._pod_watches[namespace] = PodWatch(lambda: self.core, namespace)
        return watch

    def _pod_seen(self, namespace: str, doc: dict[str, Any]) -> None:
        """A pod as one of our own reads or writes answered: the watch's copy is at least as
        new from now on (the next tick decides from our last write, not from before it)."""
        watch = self._pod_watches.get(namespace)
        if watch is not None:
            watch.put(doc)

    async def close(self) -> None:
        """Stop the pod watches."""
        tasks = [w.task for w in self._pod_watches.values() if w.task is not None]
        self._pod_watches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        resp = await self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        doc: dict[str, Any] = await read_json(resp)
        self._pod_seen(namespace, doc)
        return doc

    async def claim(
        self,
        namespace: str,
        pod: PodView,
        claim: Claim,
        progress: Progress,
        readiness: Readiness | None,
    ) -> ClaimedPod:
        """Take the pod for a pass: record ``claim`` with the pass's first progress (and
        readiness condition) in ONE patch of pods/status, conditional on the pod being
        exactly as listed (its resourceVersion). The status subresource also takes
        metadata.annotations, so a pod is never Ready without the record of its passed probe,
        and the operator needs no right to patch pods (which would let it change their spec).
        Raises PodBusy when the pod changed since it was listed."""
        body = _record_body(progress, readiness)
        body["metadata"]["annotations"][CLAIM_ANNOTATION] = claim.to_annotation()
        body["metadata"]["resourceVersion"] = pod.resource_version
        await self.mirror(namespace, pod.members, readiness, before=True)
        try:
            doc = await self._patch_pod_status(namespace, pod.name, body)
        except ApiException as e:
            if e.status == 409:
                raise PodBusy(f"pod {pod.name} changed since it was listed") from e
            raise
        await self.mirror(namespace, pod.members, readiness, before=False)
        rv = str(doc["metadata"]["resourceVersion"])
        return ClaimedPod(self, namespace, pod.name, claim, rv, pod.uid, pod.members,
                          ready=kubelet_ready(doc))  # fmt: skip

    async def withdraw(self, pod: PodView, namespace: str, reason: str, message: str) -> None:
        """Set the pod's readiness condition False, without a claim (taking a pod out of
        traffic is safe whoever does it), conditional on the pod being exactly as listed: a
        pass that claimed or recorded it since decides its readiness instead. A pod changed
        since only by others (the kubelet: a restart, its Ready condition; a list that
        lagged) still carries the claim and records the decision read: withdrawn all the
        same, conditional on the pod as read now."""
        out = Readiness(False, reason, message)
        body: dict[str, Any] = {"metadata": {"resourceVersion": pod.resource_version},
                                "status": {"conditions": [_condition(out)]}}  # fmt: skip
        await self.mirror(namespace, pod.members, out, before=True)
        for _ in range(WITHDRAW_TRIES):
            try:
                await self._patch_pod_status(namespace, pod.name, body)
                return
            except ApiException as e:
                if e.status == 404:  # deleted: nothing left to take out of traffic
                    return
                if e.status != 409:
                    raise
            try:
                now = PodView.from_pod(await self.read_pod(namespace, pod.name))
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            if (now.uid, now.claim, now.records) != (pod.uid, pod.claim, pod.records):
                return  # a pass claimed or recorded it since: its readiness is the pass's
            body["metadata"]["resourceVersion"] = now.resource_version

    async def mirror(
        self, namespace: str, names: Sequence[str], readiness: Readiness | None, *, before: bool
    ) -> None:
        """A pod group's followers (core/groups.py) get the readiness condition its leader
        gets: the group serves, and leaves traffic, as one. Out of traffic before the
        leader's write (``before``), back in only after it: a follower is Ready only while
        its leader is, and never before the leader's record holds the passed probe. A write
        of the leader that then fails leaves the followers out, which is safe: the group is
        not Ready as a whole, and a pass takes it up. A follower deleted meanwhile has
        nothing to gate."""
        if readiness is None or readiness.ready == before:
            return
        body = {"status": {"conditions": [_condition(readiness)]}}
        for name in names:
            try:
                await self._patch_pod_status(namespace, name, body)
            except ApiException as e:
                if e.status != 404:
                    raise

    async def _patch_pod_status(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """One strategic-merge patch of pods/status; the pod as the write left it (its new
        resourceVersion, its Ready condition: what a pass would otherwise read the pod for)."""
        self.before_write()
        resp = await self.core.patch_namespaced_pod_status(
            name, namespace, body, _content_type=SMP, _preload_content=False
        )
        doc: dict[str, Any] = await read_json(resp)
        self._pod_seen(namespace, doc)
        return doc

    # --------------------------------------------------------------- WeightRefits
    async def get_refit(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = await self.custom.get_namespaced_custom_object(
                API_GROUP, api.VERSION, namespace, api.PLURAL, name, _preload_content=False
            )
            doc: dict[str, Any] = await read_json(resp)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return doc

    async def list_refits(self, namespace: str | None) -> list[dict[str, Any]]:
        """The WeightRefits of ``namespace`` (None: of every namespace)."""
        if namespace is None:
            resp = await self.custom.list_cluster_custom_object(
                API_GROUP, api.VERSION, api.PLURAL, _preload_content=False
            )
        else:
            resp = await self.custom.list_namespaced_custom_object(
                API_GROUP, api.VERSION, namespace, api.PLURAL, _preload_content=False
            )
        items: list[dict[str, Any]] = (await read_json(resp)).get("items", [])
        return items

    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str = ""
    ) -> dict[str, Any]:
        """Merge-patch a WeightRefit's status, conditional on ``resource_version`` when given
        (409 then means someone else wrote it since it was read); the refit as written."""
        self.before_write()
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        doc: dict[str, Any] = await read_json(
            await self.custom.patch_namespaced_custom_object_status(
                API_GROUP,
                api.VERSION,
                namespace,
                api.PLURAL,
                name,
                body,
                _content_type=MERGE,
                _preload_content=False,
            )
        )
        return doc

    async def stamp_refit(self, namespace: str, name: str, uid: str, stamp: str) -> None:
        """Write the creation stamp on a WeightRefit that has none (times.CREATED_ANNOTATION);
        only on the object of that uid (a refit deleted and created again under the name has
        its own). Gone already is fine."""
        self.before_write()
        body = {"metadata": {"uid": uid, "annotations": {times.CREATED_ANNOTATION: stamp}}}
        try:
            await _done(
                await self.custom.patch_namespaced_custom_object(
                    API_GROUP, api.VERSION, namespace, api.PLURAL, name, body,
                    _content_type=MERGE, _preload_content=False,
                )
            )  # fmt: skip
        except ApiException as e:
            if e.status not in (404, 409):  # 409: another object under the name now
                raise

    async def delete_refit(self, namespace: str, name: str) -> None:
        """Delete a WeightRefit (history collection); its finalizer still runs. Gone already
        is fine."""
        self.before_write()
        try:
            await _done(
                await self.custom.delete_namespaced_custom_object(
                    API_GROUP, api.VERSION, namespace, api.PLURAL, name, _preload_content=False
                )
            )
        except ApiException as e:
            if e.status != 404:
                raise

    # -------------------------------------------------------------------- Events
    async def event(
        self, namespace: str, involved: dict[str, Any], reason: str, message: str, etype: str
    ) -> None:
        """Best effort: a lost Event must never stop a refit."""
        self.before_write()
        meta = involved["metadata"]
        now = rfc3339(times.now())
        body = {
            "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", "v1"),
                "kind": involved.get("kind", "Pod"),
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta.get("uid", ""),
            },
            "reason": reason,
            "message": message[:1000],
            "type": etype,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": "refit-operator"},
            "reportingComponent": "refit-operator",
            "reportingInstance": self.identity,
        }
        try:
            await _done(
                await self.core.create_namespaced_event(namespace, body, _preload_content=False)
            )
        except ApiException as e:
            log.warning("event %s on %s not recorded: %s", reason, meta["name"], e.reason)

    # ----------------------------------------------------------- Secrets, ConfigMaps
    async def read_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's or ConfigMap's values by key (a Secret's decoded); None when the object
        is absent. One read for every key the caller wants (controller/inputs.Reads)."""
        try:
            if kind == "Secret":
                resp = await self.core.read_namespaced_secret(
                    name, namespace, _preload_content=False
                )
            else:
                resp = await self.core.read_namespaced_config_map(
                    name, namespace, _preload_content=False
                )
            doc = await read_json(resp)
        except ApiException as e:
            if e.status == 404:
                return None
            if e.status == 403:
                raise AccessDenied(
                    f"the operator may not read {kind} {name!r} in {namespace} (RBAC: add it to "
                    "the chart's adminToken.secretNames or probeReferences.configMapNames)"
                ) from e
            raise
        data = {k: v for k, v in (doc.get("data") or {}).items() if isinstance(v, str)}
        if kind != "Secret":
            return data
        values = {}
        for k, v in data.items():
            try:
                values[k] = base64.b64decode(v).decode().strip()
            except (ValueError, UnicodeDecodeError):
                continue  # not text: no token or key the operator reads
        return values
