"""An in-memory Kubernetes for the explorer: the objects the operator touches, with the API
server's semantics that its correctness rests on (tests/cluster/test_memcluster_contract.py
holds them to a real kube-apiserver):

- one resourceVersion counter for every object; every write moves the object's;
- a write conditional on ``metadata.resourceVersion`` that meets another answers 409
  (kubernetes_asyncio's ApiException, as Cluster sees it);
- pods/status takes the status (conditions merged by type, as a strategic merge does) and
  metadata.annotations (null deletes a key); a WeightRefit's status is a subresource: its
  writes never move ``generation``, a spec write does;
- creationTimestamp has one-second resolution: refits created in one second tie;
- deleting an object with finalizers sets deletionTimestamp; it goes when the last finalizer
  does;
- every change of a WeightRefit is a watch event (ADDED, MODIFIED, DELETED) on each
  subscriber's feed, which the explorer delivers late, coalesced, never, or relisted.

:class:`MemoryCluster` is the operator's own ``cluster.Cluster`` over this store: claims,
withdrawals and a pass's conditional records are the real code; only the transport differs.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from refit_operator.core import times
from refit_operator.core.podview import PodView
from refit_operator.edges.cluster import FINALIZER, Cluster
from refit_worker.contract import READINESS_GATE, READY_PATH

Key = tuple[str, str, str]  # kind, namespace, name
Docs = list[dict[str, Any]]  # (Store.list shadows ``list`` in its class body)

# The store's revision when the running task (a tick) last listed pods: a status it writes is
# decided from that list, and the checks hold it to that moment (Store.decided_from).
LISTED_AT: contextvars.ContextVar[int | None] = contextvars.ContextVar("listed", default=None)
# The pods that list returned (the stored documents, never changed in place).
LISTED_PODS: contextvars.ContextVar[tuple[dict[str, Any], ...] | None] = contextvars.ContextVar(
    "listed_pods", default=None
)


def clone(doc: Any) -> Any:
    """A deep copy of a JSON document (dicts, lists, scalars): what copy.deepcopy does for
    these, several times faster (the copies the operator gets are the explorer's hot path)."""
    t = type(doc)
    if t is dict:
        return {k: clone(v) for k, v in doc.items()}
    if t is list:
        return [clone(v) for v in doc]
    if t is str or t is int or t is float or t is bool or doc is None:
        return doc
    return copy.deepcopy(doc)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, null deletes, anything else replaces. The
    result shares the subtrees the patch leaves alone with ``target`` (stored documents are
    never changed in place)."""
    if not isinstance(patch, dict):
        return clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _conditions(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Strategic merge of pod conditions: by type."""
    out = [dict(c) for c in old]
    for c in new:
        for i, have in enumerate(out):
            if have.get("type") == c.get("type"):
                out[i] = {**have, **c}
                break
        else:
            out.append(dict(c))
    return out


def labels_match(selector: str, labels: dict[str, str]) -> bool:
    """A canonical selector's equality terms (``k=v,k2=v2``) against labels."""
    for term in filter(None, selector.split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


@dataclass
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    doc: dict[str, Any]


@dataclass
class Store:
    """The API server's state. ``latency`` gives each request's virtual delay (seeded).

    A stored document is never changed in place: every write stores a new one (sharing the
    subtrees it leaves alone). So the explorer and its checks read them as they are
    (``peek``, ``scan``, ``objects``, watch events), and only what the operator gets is
    copied (``get``, ``list``, MemoryCluster; a delivered watch event). Writes answer with
    the stored document too."""

    latency: Callable[[], float] = lambda: 0.0
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    feeds: list[list[Event]] = field(default_factory=list)  # one per subscriber
    created: dict[str, int] = field(default_factory=dict)  # uid -> creation order
    on_write: Callable[[str, dict[str, Any] | None, dict[str, Any] | None], None] = (
        lambda kind, old, new: None
    )
    events: int = 0  # Events recorded (counted, not kept)
    # While a refit's status is written: the revision of the pod list it was decided from,
    # and the pods that list returned.
    decided_from: int | None = None
    decided_pods: tuple[dict[str, Any], ...] | None = None
    revision: int = 0  # the last resourceVersion given out: the store's logical clock
    _uid: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # ------------------------------------------------------------------ primitives
    def _next_rv(self) -> str:
        self.revision += 1
        return str(self.revision)

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        doc = self.objects.get((kind, ns, name))
        return clone(doc) if doc is not None else None

    def peek(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        """The stored document itself: read it, never change it."""
        return self.objects.get((kind, ns, name))

    def _put(self, kind: str, doc: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        meta = {**doc["metadata"], "resourceVersion": self._next_rv()}
        doc = {**doc, "metadata": meta}  # its own metadata: ``old`` keeps its version
        key = (kind, meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.objects[key]
            self.on_write(kind, old, None)
            self._notify(kind, "DELETED", doc)
            return doc
        self.objects[key] = doc
        self.on_write(kind, old, doc)
        self._notify(kind, "ADDED" if old is None else "MODIFIED", doc)
        return doc

    def _notify(self, kind: str, etype: str, doc: dict[str, Any]) -> None:
        if kind == "WeightRefit":
            event = Event(etype, doc)  # immutable: the deliverer copies what it hands over
            for feed in self.feeds:
                feed.append(event)

    def subscribe(self) -> list[Event]:
        feed: list[Event] = []
        self.feeds.append(feed)
        return feed

    @staticmethod
    def _conflict(doc: dict[str, Any], patch_meta: dict[str, Any]) -> None:
        want = patch_meta.get("resourceVersion")
        if want and want != doc["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict: the object has been modified")

    @staticmethod
    def _missing(kind: str, name: str) -> ApiException:
        return ApiException(status=404, reason=f"{kind} {name!r} not found")

    def create(self, kind: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        key = (kind, ns, meta["name"])
        if key in self.objects:
            raise ApiException(status=409, reason=f"AlreadyExists: {meta['name']}")
        uid = f"uid-{next(self._uid)}"
        meta.update(namespace=ns, uid=uid, generation=1,
                    creationTimestamp=times.rfc3339(times.now()))  # fmt: skip
        self.created[uid] = len(self.created)
        return self._put(kind, clone(body), None)

    def patch(self, kind: str, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the main resource (spec, labels, finalizers)."""
        old = self.objects.get((kind, ns, name))
        if old is None:
            raise self._missing(kind, name)
        self._conflict(old, patch.get("metadata") or {})
        new = merge_patch(old, {k: v for k, v in patch.items() if k != "status"})
        if new.get("spec") != old.get("spec"):
            generation = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"] = {**new["metadata"], "generation": generation}
        return self._put(kind, new, old)

    def replace(self, kind: str, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """An update (PUT) of the whole object, as a Lease's renewal writes it: conditional
        on ``metadata.resourceVersion`` (409 when stale; 422 without one, as the API server
        answers for Leases, which allow no unconditional update). The server keeps the
        object's identity (uid, creationTimestamp). A Lease that is absent is created (Leases
        allow create on update, whatever resourceVersion the body names)."""
        old = self.objects.get((kind, ns, name))
        if old is None and kind == "Lease":
            meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "resourceVersion"}
            return self.create(kind, ns, {**clone(body), "metadata": meta})
        if old is None:
            raise self._missing(kind, name)
        meta = dict(body.get("metadata") or {})
        if not meta.get("resourceVersion"):
            raise ApiException(status=422, reason="metadata.resourceVersion: must be specified")
        self._conflict(old, meta)
        kept = ("namespace", "name", "uid", "creationTimestamp", "generation")
        meta.update({k: old["metadata"][k] for k in kept if k in old["metadata"]})
        return self._put(kind, {**clone(body), "metadata": meta}, old)

    def remove(self, kind: str, ns: str, name: str) -> None:
        """Gone at once, finalizers or not (the explorer's pod_replace)."""
        old = self.objects.pop((kind, ns, name))
        self._next_rv()
        self.on_write(kind, old, None)
        self._notify(kind, "DELETED", old)

    def delete(self, kind: str, ns: str, name: str) -> None:
        old = self.objects.get((kind, ns, name))
        if old is None:
            raise self._missing(kind, name)
        if old["metadata"].get("deletionTimestamp"):
            return
        stamp = times.rfc3339(times.now())
        self._put(kind, {**old, "metadata": {**old["metadata"], "deletionTimestamp": stamp}}, old)

    # -------------------------------------------------------------------- status
    def patch_status(self, kind: str, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A patch of the status subresource, as the API server takes it: pods/status takes
        the status and metadata.annotations (a strategic merge), a WeightRefit's only the
        status (a merge patch); both ignore the spec and the rest of the metadata, and both
        are conditional on metadata.resourceVersion when it is given."""
        if kind == "Pod":
            return self.patch_pod_status(ns, name, body)
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        return self.patch_refit_status(ns, name, body.get("status") or {}, rv)

    def patch_pod_status(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        old = self.objects.get(("Pod", ns, name))
        if old is None:
            raise self._missing("Pod", name)
        meta = body.get("metadata") or {}
        self._conflict(old, meta)
        new = dict(old)
        if "annotations" in meta:
            notes = merge_patch(old["metadata"].get("annotations") or {}, meta["annotations"])
            new["metadata"] = {**old["metadata"], "annotations": notes}
        status = dict(body.get("status") or {})
        conds = status.pop("conditions", None)
        new["status"] = merge_patch(old.get("status") or {}, status)
        if conds is not None:
            new["status"]["conditions"] = _conditions(new["status"].get("conditions") or [], conds)
        return self._put("Pod", new, old)

    def patch_refit_status(
        self, ns: str, name: str, status: dict[str, Any], rv: str
    ) -> dict[str, Any]:
        old = self.objects.get(("WeightRefit", ns, name))
        if old is None:
            raise self._missing("WeightRefit", name)
        self._conflict(old, {"resourceVersion": rv})
        new = {**old, "status": merge_patch(old.get("status") or {}, status)}
        return self._put("WeightRefit", new, old)

    def list(self, kind: str, ns: str | None) -> Docs:
        return [clone(d) for d in self.scan(kind, ns)]

    def scan(self, kind: str, ns: str | None) -> Docs:
        """The stored documents themselves, by key: read them, never change them."""
        return [
            d
            for (k, n, _), d in sorted(self.objects.items())
            if k == kind and (ns is None or n == ns)
        ]


def pod_body(name: str, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    """A fleet pod as the kubelet shows it: Running at ``ip``, its container started, the
    weights-ready gate declared and /refit/ready as its readiness probe."""
    return {
        "metadata": {"name": name, "labels": dict(labels), "annotations": {}},
        "spec": {
            "containers": [{"name": "vllm", "readinessProbe": {"httpGet": {"path": READY_PATH}}}],
            "readinessGates": [{"conditionType": READINESS_GATE}],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "containerStatuses": [{"name": "vllm", "restartCount": 0, "started": True}],
        },
    }


def finalized(doc: dict[str, Any]) -> dict[str, Any]:
    """A WeightRefit document (refit_document.build_refit's) with the finalizer kopf's
    handlers add when they first see it: the in-memory cluster runs no kopf."""
    doc.setdefault("metadata", {}).setdefault("finalizers", []).append(FINALIZER)
    return doc


class _Answer:
    """A ``_preload_content=False`` answer, as cluster.read_json reads it."""

    def __init__(self, status: int, doc: Any) -> None:
        self.status = status
        self._body = json.dumps(doc).encode()

    async def read(self) -> bytes:
        return self._body


class MemoryLeases:
    """What leader.Lease asks of kubernetes_asyncio's CoordinationV1Api (coordination.k8s.io
    Leases: read, create, conditional replace; delete for the explorer's faults), over a
    :class:`Store`. ``latency`` gives each request's virtual delay; ``thawed`` is the
    process's freeze (explore.py, ``lease_expiry``): a frozen process sends nothing."""

    def __init__(
        self,
        store: Store,
        latency: Callable[[], float] = lambda: 0.0,
        thawed: asyncio.Event | None = None,
    ) -> None:
        self.store, self.latency, self.thawed = store, latency, thawed

    async def _send(self) -> None:
        if self.thawed is not None and not self.thawed.is_set():
            await self.thawed.wait()
        await asyncio.sleep(self.latency())

    async def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> _Answer:
        await self._send()
        doc = self.store.peek("Lease", namespace, name)
        if doc is None:
            return _Answer(404, {"kind": "Status", "reason": "NotFound", "code": 404})
        return _Answer(200, doc)

    async def create_namespaced_lease(
        self, namespace: str, body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        await self._send()
        return clone(self.store.create("Lease", namespace, clone(body)))

    async def replace_namespaced_lease(
        self, name: str, namespace: str, body: dict[str, Any], **_: Any
    ) -> dict[str, Any]:
        await self._send()
        return clone(self.store.replace("Lease", namespace, name, body))

    async def delete_namespaced_lease(self, name: str, namespace: str, **_: Any) -> None:
        await self._send()
        self.store.delete("Lease", namespace, name)


class MemoryCluster(Cluster):
    """cluster.Cluster over a :class:`Store`: every request waits its (virtual) latency, then
    acts at once, so requests of ticks and passes interleave as the seed says. ``thawed``:
    the process's freeze (explore.py, ``lease_expiry``): while it is clear, the process
    sends nothing, and what it sends next it sends only after the lease check."""

    def __init__(self, store: Store, identity: str, thawed: asyncio.Event | None = None) -> None:
        super().__init__(api_client=None, identity=identity)  # type: ignore[arg-type]
        self.store = store
        self.thawed = thawed
        # Called with each write as it is sent (after before_write): the explorer checks
        # that a process whose lease may have expired sends none.
        self.on_send: Callable[[], None] = lambda: None

    async def _thaw(self) -> None:
        if self.thawed is not None and not self.thawed.is_set():
            await self.thawed.wait()

    async def _wait(self) -> None:
        await self._thaw()
        await asyncio.sleep(self.store.latency())

    async def _send(self) -> None:
        """A write: the lease check, then the request leaves (it lands even if the lease
        expires meanwhile)."""
        await self._thaw()
        self.before_write()
        self.on_send()
        await asyncio.sleep(self.store.latency())

    async def list_pods(self, namespace: str, selector: str) -> list[PodView]:
        await self._wait()
        LISTED_AT.set(self.store.revision)
        docs = tuple(
            d
            for d in self.store.scan("Pod", namespace)
            if labels_match(selector, d["metadata"].get("labels") or {})
        )
        LISTED_PODS.set(docs)
        return [PodView.from_pod(d) for d in docs]  # from_pod copies what it keeps

    async def pods_named(self, namespace: str, names: Sequence[str]) -> list[PodView]:
        await self._wait()
        docs = (self.store.get("Pod", namespace, n) for n in names)
        return [PodView.from_pod(d) for d in docs if d is not None]

    async def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        await self._wait()
        doc = self.store.get("Pod", namespace, name)
        if doc is None:
            raise Store._missing("Pod", name)
        return doc

    async def _patch_pod_status(
        self, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        await self._send()  # sent: it lands even if the lease expires meanwhile
        return clone(self.store.patch_pod_status(namespace, name, clone(body)))

    async def get_refit(self, namespace: str, name: str) -> dict[str, Any] | None:
        await self._wait()
        return self.store.get("WeightRefit", namespace, name)

    async def list_refits(self, namespace: str | None) -> list[dict[str, Any]]:
        await self._wait()
        return self.store.list("WeightRefit", namespace)

    async def patch_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str = ""
    ) -> dict[str, Any]:
        await self._send()
        self.store.decided_from = LISTED_AT.get()
        self.store.decided_pods = LISTED_PODS.get()
        try:
            return clone(
                self.store.patch_refit_status(namespace, name, clone(status), resource_version)
            )
        finally:
            self.store.decided_from = None
            self.store.decided_pods = None

    async def stamp_refit(self, namespace: str, name: str, uid: str, stamp: str) -> None:
        """The creation stamp, on the object of that uid only (the API server takes
        metadata.uid in a patch as a precondition); gone already is fine."""
        await self._send()
        doc = self.store.peek("WeightRefit", namespace, name)
        if doc is None or doc["metadata"].get("uid") != uid:
            return
        patch = {"metadata": {"annotations": {times.CREATED_ANNOTATION: stamp}}}
        self.store.patch("WeightRefit", namespace, name, patch)

    async def delete_refit(self, namespace: str, name: str) -> None:
        await self._send()
        try:
            self.store.delete("WeightRefit", namespace, name)
        except ApiException as e:
            if e.status != 404:
                raise

    async def event(
        self, namespace: str, involved: dict[str, Any], reason: str, message: str, etype: str
    ) -> None:
        await self._thaw()
        self.before_write()
        self.on_send()
        self.store.events += 1

    async def read_data(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        await self._wait()
        doc = self.store.peek(kind, namespace, name)
        if doc is None:
            return None
        return {k: v for k, v in (doc.get("data") or {}).items() if isinstance(v, str)}
